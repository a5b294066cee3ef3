/**
 * The execution engine for end-to-end tests: the test API (real database, real HTTP routes), an
 * executor over its data dir running the real agent loop against a fake model server, and helpers to
 * wait for tasks. `useTestEngine(driver, (ready) => (engine = ready))` in a describe block.
 */
import { hostname } from 'node:os';
import pino from 'pino';
import { afterAll, afterEach, beforeAll } from 'vitest';
import { Executor } from '../../src/engine/executor.js';
import { ForkLifecycle } from '../../src/engine/fork-lifecycle.js';
import { startDevServers } from '../../src/sandbox/dev-servers.js';
import { addRepository } from '../../src/engine/repositories.js';
import { startFakeModel, type FakeModel, type ScriptedAnswer } from './fake-model.js';
import { startTestApi, TEST_PUBLIC_URL, type Tenant, type TestApi } from './api.js';
import type { TestDriver } from './db.js';
import { join } from 'node:path';

export const FAKE_AGENT = 'openai-compatible/fake';

/** The events of a logs stream (GET /tasks/{id}/logs, Server-Sent Events). */
export const journal = (stream: string): Array<{ kind: string; data: Record<string, unknown> }> =>
  stream
    .split('\n')
    .filter((line) => line.startsWith('data: '))
    .map((line) => JSON.parse(line.slice(6)) as { kind: string; data: Record<string, unknown> });

export interface TestEngine {
  api: TestApi;
  tenant: Tenant;
  model: FakeModel;
  /** The model's answers, consumed in order; emptied after each test. */
  script: ScriptedAnswer[];
  executor: Executor;
  forks: ForkLifecycle;
  /** POST /tasks with the fake agent; answers the created task (201 or it throws). */
  create(body: Record<string, unknown>): Promise<{ id: string; slug: string }>;
  /** Connects a repository (a path) to the tenant's workspace. */
  connect(source: string, fullName: string): Promise<void>;
  /** Waits (bounded) until the task is neither PENDING nor IN_PROGRESS; answers GET /tasks/{id}. */
  settled(taskId: string): Promise<{ task: Record<string, unknown> & { status: string; prs: Array<Record<string, unknown>> }; latestJob: Record<string, unknown> }>;
  /** Waits (bounded) until `predicate` holds on GET /tasks/{id}. */
  until(taskId: string, predicate: (body: { task: { status: string }; latestJob: { status: string } }) => boolean): Promise<void>;
}

export function useTestEngine(driver: TestDriver, ready: (engine: TestEngine) => void, options: { leaseMs?: number } = {}): void {
  let engine: TestEngine | undefined;
  beforeAll(async () => {
    const api = await startTestApi(driver);
    const tenant = await api.newTenant();
    const script: ScriptedAnswer[] = [];
    const model = await startFakeModel(script);
    const logger = pino({ level: process.env.SVC_TEST_LOG ?? 'silent' });
    const forks = new ForkLifecycle({
      database: api.db.database,
      forksRoot: join(api.dataDir, 'forks'),
      host: hostname(),
      policy: { hiddenPaths: [api.dataDir], allowUnsandboxed: false, memoryMiB: 4096, cpuSeconds: 600 },
      durations: { idleStopMs: 60_000, archiveMs: 60_000, deleteMs: 60_000 },
      logger,
    });
    const executor = new Executor({
      database: api.db.database,
      environments: api.environments,
      publicUrl: TEST_PUBLIC_URL,
      forks,
      startDevServers,
      owner: 'test',
      concurrency: 1,
      leaseMs: options.leaseMs ?? 30_000,
      pollMs: 200,
      modelEnv: { OPENAI_COMPATIBLE_BASE_URL: model.baseUrl },
      logger,
    });
    await executor.start();
    const read = async (taskId: string) => (await tenant.request('GET', `/api/v1/tasks/${taskId}`)).json();
    const until: TestEngine['until'] = async (taskId, predicate) => {
      for (let i = 0; i < 600; i++) {
        if (predicate(await read(taskId))) return;
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      throw new Error(`task ${taskId} did not reach the expected state in 60 s: ${JSON.stringify(await read(taskId))}`);
    };
    engine = {
      api,
      tenant,
      model,
      script,
      executor,
      forks,
      async create(body) {
        const response = await tenant.request('POST', '/api/v1/tasks', { agent: FAKE_AGENT, ...body });
        if (response.statusCode !== 201) throw new Error(`POST /tasks answered ${response.statusCode}: ${response.body}`);
        return response.json().task as { id: string; slug: string };
      },
      async connect(source, fullName) {
        await addRepository(api.db.database.db, api.environments, { workspace: tenant.workspace.name, source, fullName, setup: false });
      },
      async settled(taskId) {
        await until(taskId, (body) => !['PENDING', 'IN_PROGRESS'].includes(body.task.status));
        return read(taskId);
      },
      until,
    };
    ready(engine);
  });
  afterEach(() => {
    if (engine) engine.script.length = 0;
  });
  afterAll(async () => {
    await engine?.executor.stop();
    await engine?.model.close();
    await engine?.api.close();
  });
}
