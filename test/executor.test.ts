import { execFileSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { SHUTDOWN_ERROR } from '../src/engine/executor.js';
import type { FakeModel, ScriptedAnswer } from './support/fake-model.js';
import type { Tenant } from './support/api.js';
import { testDrivers } from './support/db.js';
import { useTestEngine, type TestEngine } from './support/engine.js';

describe.each(testDrivers)('the executor on %s', (driver) => {
  let engine: TestEngine;
  let tenant: Tenant;
  let model: FakeModel;
  let script: ScriptedAnswer[];
  useTestEngine(driver, (ready) => {
    engine = ready;
    ({ tenant, model, script } = ready);
  });
  const settled = (taskId: string) => engine.settled(taskId);

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

  // Last: it stops this block's executor.
  it('stops running jobs on shutdown, failing each with a message that says so', async () => {
    const marker = `${Math.floor(Math.random() * 1e6) + 1000}.75`;
    script.push({ toolCalls: [{ name: 'run_command', arguments: { command: `sleep ${marker}` } }] });
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'Take long', agent: 'openai-compatible/fake' })).json();
    const sleeping = () => execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' }).includes(`sleep ${marker}`);
    await engine.until(task.id, () => sleeping());
    await Promise.all([engine.executor.stop(), engine.executor.stop()]);
    expect(sleeping()).toBe(false);
    const stopped = (await tenant.request('GET', `/api/v1/tasks/${task.id}`)).json();
    expect(stopped.latestJob).toMatchObject({ status: 'FAILED', error: SHUTDOWN_ERROR });
    expect(stopped.task.status).toBe('FAILED');
  });
});
