import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Executor } from '../src/engine/executor.js';
import { startFakeModel, type FakeModel, type ScriptedAnswer } from './support/fake-model.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

describe.each(testDrivers)('the executor on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  let model: FakeModel;
  let executor: Executor;
  const script: ScriptedAnswer[] = [];
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  beforeAll(async () => {
    model = await startFakeModel(script);
    executor = new Executor({
      database: api.db.database,
      dataDir: mkdtempSync(join(tmpdir(), 'svc-executor-')),
      owner: 'test',
      concurrency: 1,
      leaseMs: 30_000,
      pollMs: 200,
      allowUnsandboxed: false,
      modelEnv: { OPENAI_COMPATIBLE_BASE_URL: model.baseUrl },
      logger: pino({ level: 'silent' }),
    });
    await executor.start();
  });
  afterAll(async () => {
    await executor?.stop();
    await model?.close();
  });
  afterEach(() => {
    script.length = 0;
  });

  /** Polls the task until its job is done (bounded); the executor picks it up on NOTIFY. */
  async function settled(taskId: string) {
    for (let i = 0; i < 300; i++) {
      const body = (await tenant.request('GET', `/api/v1/tasks/${taskId}`)).json();
      if (!['PENDING', 'IN_PROGRESS'].includes(body.task.status)) return body;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    throw new Error('the task did not settle in 30 s');
  }

  it('answers an ask task and journals the run', async () => {
    script.push({ toolCalls: [{ name: 'list_files', arguments: { path: '.' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'The answer is 42.' } }] });
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'What is the answer?', userIntent: 'ASK', agent: 'openai-compatible/fake' })).json();
    const done = await settled(task.id);
    expect(done.task.status).toBe('COMPLETED');
    expect(done.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'The answer is 42.', type: 'ASK', error: null });
    const logs = (await tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    expect(logs).toContain('"kind":"tool_call"');
    expect(logs).toContain('"kind":"final"');
  });

  it('drafts a plan that waits for approval, and a follow-up sees the thread', async () => {
    script.push({ toolCalls: [{ name: 'submit_plan', arguments: { plan: '1. Do it' } }] });
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'Plan the work', userIntent: 'PLAN', agent: 'openai-compatible/fake' })).json();
    const planned = await settled(task.id);
    expect(planned.task.status).toBe('AWAITING_APPROVAL');
    expect(planned.latestJob).toMatchObject({ plan: '1. Do it', planOutcome: 'READY' });

    script.push({ text: 'Noted.' });
    const requestsBefore = model.requests.length;
    await tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Why?', userIntent: 'ASK' });
    const answered = await settled(task.id);
    expect(answered.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Noted.' });
    const seen = JSON.stringify(model.requests[requestsBefore]!.messages);
    expect(seen).toContain('Plan the work');
    expect(seen).toContain('1. Do it');
    expect(seen).toContain('Why?');
  });

  it('fails a job whose model has no key, saying which key', async () => {
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'Anything', agent: 'openai/gpt-5' })).json();
    const failed = await settled(task.id);
    expect(failed.task.status).toBe('FAILED');
    expect(failed.latestJob.error).toBe('OPENAI_API_KEY is not set: the agent openai/gpt-5 needs it');
  });
});
