import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pg from 'pg';
import { afterEach, describe, expect, it } from 'vitest';
import { loadMigrations } from '../src/store/migrate.js';
import { createTestSchema, dropTestSchema, postgresUrl } from './support/db.js';
import { bootstrapKeyOf, killAll, runSvc, startSvcServer, urlWithSchema } from './support/processes.js';
import { startFakeModel } from './support/fake-model.js';

afterEach(() => killAll());

/** Each `svc` process opens its store (PGlite: ~3 s); under a loaded CI machine a flow of them takes a while. */
const SPAWN_TIMEOUT_MS = 240_000;

async function call(url: string, key: string | null, method = 'GET', body?: unknown) {
  const response = await fetch(url, {
    method,
    headers: { ...(key ? { authorization: `Bearer ${key}` } : {}), ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: response.status, headers: response.headers, body: (await response.json()) as { tasks: Array<{ title: string }>; task: { id: string; slug: string; status: string } } & Record<string, unknown> };
}

describe('svc server on the embedded database', () => {
  it('bootstraps once, holds its data dir, answers health checks and stops cleanly on SIGTERM', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'svc-embedded-'));
    const server = await startSvcServer(['--data-dir', dataDir]);
    const key = bootstrapKeyOf(server.stdout());
    expect(key).toMatch(/^service_/);
    expect((await call(`${server.url}/healthz`, null)).body).toEqual({ status: 'ok' });
    expect((await call(`${server.url}/readyz`, null)).status).toBe(200);
    const created = await call(`${server.url}/api/v1/tasks`, key, 'POST', { command: 'Hello from a process' });
    expect(created.status).toBe(201);
    expect(created.headers.get('x-request-id')).toBeTruthy();

    const blocked = await runSvc(['admin', 'api-key', 'list', '--workspace', 'default', '--data-dir', dataDir]);
    expect(blocked.code).toBe(1);
    expect(blocked.stderr.trim().split('\n')).toHaveLength(1);
    expect(blocked.stderr).toMatch(/data dir .* is in use by process \d+/);

    expect(await server.stop()).toBe(0);
    const listed = await runSvc(['admin', 'api-key', 'list', '--workspace', 'default', '--data-dir', dataDir, '--json']);
    expect(listed.code).toBe(0);
    expect(JSON.parse(listed.stdout)).toHaveLength(1);

    const again = await startSvcServer(['--data-dir', dataDir]);
    expect(bootstrapKeyOf(again.stdout())).toBeNull();
    const kept = await call(`${again.url}/api/v1/tasks`, key);
    expect(kept.body.tasks.map((task: { title: string }) => task.title)).toEqual(['Hello from a process']);
    expect(await again.stop()).toBe(0);
  }, SPAWN_TIMEOUT_MS);
});

describe('svc server runs jobs', () => {
  it('executes a task with its built-in executor', async () => {
    const model = await startFakeModel([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Done by the server.' } }] }]);
    try {
      const dataDir = mkdtempSync(join(tmpdir(), 'svc-executing-'));
      const server = await startSvcServer(['--data-dir', dataDir], { SVC_EXECUTOR_CONCURRENCY: '1', OPENAI_COMPATIBLE_BASE_URL: model.baseUrl });
      const key = bootstrapKeyOf(server.stdout());
      const created = await call(`${server.url}/api/v1/tasks`, key, 'POST', { command: 'Say done', userIntent: 'ASK', agent: 'openai-compatible/fake' });
      let latest = created.body;
      for (let i = 0; i < 300 && ['PENDING', 'IN_PROGRESS'].includes(String((latest.task as { status: string }).status)); i++) {
        await new Promise((resolve) => setTimeout(resolve, 100));
        latest = (await call(`${server.url}/api/v1/tasks/${created.body.task.id}`, key)).body;
      }
      expect(latest.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Done by the server.' });
      expect(await server.stop()).toBe(0);
    } finally {
      await model.close();
    }
  }, SPAWN_TIMEOUT_MS);
});

describe.skipIf(!process.env.DATABASE_URL)('two svc servers on one PostgreSQL', () => {
  it('start together on a fresh database, bootstrap once, and share tasks and rate limits', async () => {
    const schema = await createTestSchema();
    try {
      const env = { DATABASE_URL: urlWithSchema(postgresUrl(), schema), SVC_RATE_LIMIT_PER_MINUTE: '10' };
      const [a, b] = await Promise.all([startSvcServer([], env), startSvcServer([], env)]);
      const keys = [bootstrapKeyOf(a.stdout()), bootstrapKeyOf(b.stdout())].filter(Boolean) as string[];
      expect(keys).toHaveLength(1);
      const key = keys[0]!;

      const client = new pg.Client({ connectionString: postgresUrl() });
      await client.connect();
      try {
        const workspaces = await client.query(`select name from ${schema}.workspaces`);
        expect(workspaces.rows).toEqual([{ name: 'default' }]);
        const migrations = await client.query(`select name from ${schema}.svc_migrations order by name`);
        expect(migrations.rows.map((row) => row.name)).toEqual(loadMigrations().map((migration) => migration.name));
      } finally {
        await client.end();
      }

      const created = await call(`${a.url}/api/v1/tasks`, key, 'POST', { command: 'Made on A' });
      expect(created.status).toBe(201);
      const read = await call(`${b.url}/api/v1/tasks/${created.body.task.slug}`, key);
      expect(read.status).toBe(200);
      expect(read.body.task.id).toBe(created.body.task.id);

      // Two requests are spent above; 4 more on A and 4 on B fill the minute of 10.
      for (let i = 0; i < 4; i++) expect((await call(`${a.url}/api/v1/tasks`, key)).status).toBe(200);
      for (let i = 0; i < 4; i++) expect((await call(`${b.url}/api/v1/tasks`, key)).status).toBe(200);
      const refusedOnA = await call(`${a.url}/api/v1/tasks`, key);
      expect(refusedOnA.status).toBe(429);
      expect(refusedOnA.headers.get('retry-after')).toMatch(/^\d+$/);
      expect((await call(`${b.url}/api/v1/tasks`, key)).status).toBe(429);

      expect(await a.stop()).toBe(0);
      expect(await b.stop()).toBe(0);
    } finally {
      await dropTestSchema(schema);
    }
  }, SPAWN_TIMEOUT_MS);
});
