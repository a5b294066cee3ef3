import { existsSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pg from 'pg';
import { afterEach, describe, expect, it } from 'vitest';
import { createApiKey } from '../src/store/api-keys.js';
import { openDatabase } from '../src/store/db.js';
import { loadMigrations } from '../src/store/migrate.js';
import { findWorkspaceByName } from '../src/store/workspaces.js';
import { createTestSchema, dropTestSchema, postgresUrl } from './support/db.js';
import { bootstrapKeyOf, eventually, killAll, logLines, runSvc, startSvcServer, urlWithSchema } from './support/processes.js';
import { startFakeModel } from './support/fake-model.js';

afterEach(() => killAll());

/** Each `svc` process opens its store (PGlite: ~3 s); under a loaded CI machine a flow of them takes a while. */
const SPAWN_TIMEOUT_MS = 240_000;

async function call(url: string, key: string | null, method = 'GET', body?: unknown, headers: Record<string, string> = {}) {
  const response = await fetch(url, {
    method,
    headers: { ...(key ? { authorization: `Bearer ${key}` } : {}), ...(body === undefined ? {} : { 'content-type': 'application/json' }), ...headers },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: response.status, headers: response.headers, body: (await response.json()) as { tasks: Array<{ title: string }>; task: { id: string; slug: string; status: string } } & Record<string, unknown> };
}

describe('svc server on the embedded database', () => {
  it('bootstraps once, holds its data dir, answers health checks and stops cleanly on SIGTERM', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'svc-embedded-'));
    const server = await startSvcServer(['--data-dir', dataDir]);
    // The key is alone on its line, once; everything else on stdout is pino's JSON lines.
    const key = bootstrapKeyOf(server.stdout());
    expect(key).toMatch(/^service_[A-Za-z0-9_-]{43}$/);
    expect(server.stdout().split('\n').filter((line) => line.includes('service_'))).toEqual([key]);
    const listening = logLines(server.stdout()).find((line) => line.msg === 'svc is listening');
    expect(listening).toMatchObject({ url: server.url, driver: 'pglite' });

    const health = await call(`${server.url}/healthz`, null);
    expect(health).toMatchObject({ status: 200, body: { status: 'ok' } });
    expect(health.headers.get('x-request-id')).toBeTruthy();
    expect((await call(`${server.url}/readyz`, null)).status).toBe(200);
    const created = await call(`${server.url}/api/v1/tasks`, key, 'POST', { command: 'Hello from a process' });
    expect(created.status).toBe(201);
    expect(created.headers.get('x-request-id')).toMatch(/^[0-9a-f-]{36}$/);
    // A well-formed request id is kept, answered and logged with the request.
    const traced = await call(`${server.url}/api/v1/tasks`, key, 'GET', undefined, { 'x-request-id': 'trace-proc-1' });
    expect(traced.headers.get('x-request-id')).toBe('trace-proc-1');
    expect(await eventually(() => logLines(server.stdout()).some((line) => line.requestId === 'trace-proc-1'))).toBe(true);

    const blocked = await runSvc(['admin', 'api-key', 'list', '--workspace', 'default', '--data-dir', dataDir]);
    expect(blocked.code).toBe(1);
    expect(blocked.stderr.trim().split('\n')).toHaveLength(1);
    expect(blocked.stderr).toMatch(/data dir .* is in use by process \d+/);
    expect(blocked.stdout).toBe('');

    // SIGTERM: exit 0 well within the bound (stop() kills after 15 s, which would not be 0), lock released.
    expect(await server.stop()).toBe(0);
    expect(existsSync(join(dataDir, 'svc.lock'))).toBe(false);
    expect(logLines(server.stdout()).some((line) => line.msg === 'shutting down' && line.signal === 'SIGTERM')).toBe(true);
    const listed = await runSvc(['admin', 'api-key', 'list', '--workspace', 'default', '--data-dir', dataDir, '--json']);
    expect(listed.code, listed.stderr).toBe(0);
    expect(JSON.parse(listed.stdout)).toMatchObject([{ name: 'bootstrap', revokedAt: null }]);

    const again = await startSvcServer(['--data-dir', dataDir]);
    expect(bootstrapKeyOf(again.stdout())).toBeNull();
    expect(again.stdout()).not.toContain('service_');
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
      expect(refusedOnA.body).toMatchObject({ error: { code: 'rate_limited', message: 'Rate limit exceeded. Max 10 requests per minute.' } });
      expect(Number(refusedOnA.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
      expect(Number(refusedOnA.headers.get('retry-after'))).toBeLessThanOrEqual(61);
      expect((await call(`${b.url}/api/v1/tasks`, key)).status).toBe(429);

      // A burst on both processes at once with a fresh key: exactly the limit gets through.
      const database = await openDatabase({ driver: 'postgres', url: postgresUrl(), schema, poolSize: 1 }, { migrate: false });
      let second: string;
      try {
        const workspace = await findWorkspaceByName(database.db, 'default');
        second = (await createApiKey(database.db, { workspaceId: workspace!.id, name: 'burst' })).key;
      } finally {
        await database.close();
      }
      const burst = await Promise.all(Array.from({ length: 30 }, (_, i) => call(`${i % 2 ? a.url : b.url}/api/v1/tasks`, second)));
      const statuses = burst.map((response) => response.status);
      expect(statuses.filter((status) => status === 200)).toHaveLength(10);
      expect(statuses.filter((status) => status === 429)).toHaveLength(20);

      expect(await a.stop()).toBe(0);
      expect(await b.stop()).toBe(0);
    } finally {
      await dropTestSchema(schema);
    }
  }, SPAWN_TIMEOUT_MS);
});
