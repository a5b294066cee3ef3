/**
 * Calls a real HTTP server through openapi-fetch typed by the `paths` that openapi-typescript generated
 * from the committed document. `npm test` typechecks this file, so a document that drifts from the routes
 * or from the zod schemas breaks the build here; at run time every answer is also checked against the
 * document the server publishes (status, media type, headers, body).
 */
import { tmpdir } from 'node:os';
import createClient, { type Client, type Middleware } from 'openapi-fetch';
import { afterAll, afterEach, beforeAll, describe, expect, expectTypeOf, it } from 'vitest';
import type { z } from 'zod';
import { answerProblems, type Json } from '../../scripts/openapi.js';
import { finishJob, startJob } from '../../src/engine/jobs.js';
import type { ErrorCode } from '../../src/protocol/errors.js';
import type { components, paths } from '../../src/protocol/openapi.js';
import type * as rest from '../../src/protocol/rest.js';
import { buildServer } from '../../src/server/app.js';
import { createApiKey } from '../../src/store/api-keys.js';
import { upsertPullRequests } from '../../src/store/tasks.js';
import { createWorkspace } from '../../src/store/workspaces.js';
import { DEFAULT_AGENT } from '../support/api.js';
import { openTestDatabase, testDrivers, type TestDatabase } from '../support/db.js';

type Schemas = components['schemas'];

// The generated types are the zod schemas' own: answers as the server sends them, bodies as it takes them.
expectTypeOf<Schemas['Task']>().toEqualTypeOf<z.output<typeof rest.Task>>();
expectTypeOf<Schemas['Job']>().toEqualTypeOf<z.output<typeof rest.Job>>();
expectTypeOf<Schemas['TaskListItem']>().toEqualTypeOf<z.output<typeof rest.TaskListItem>>();
expectTypeOf<Schemas['RoutingConfig']>().toEqualTypeOf<z.output<typeof rest.RoutingConfig>>();
expectTypeOf<Schemas['TaskStatus']>().toEqualTypeOf<rest.TaskStatus>();
expectTypeOf<Schemas['JobType']>().toEqualTypeOf<rest.JobType>();
expectTypeOf<Schemas['CreateTaskBody']>().toEqualTypeOf<z.input<typeof rest.CreateTaskBody>>();
expectTypeOf<Schemas['SendMessageBody']>().toEqualTypeOf<z.input<typeof rest.SendMessageBody>>();
expectTypeOf<Schemas['ApprovePlanBody']>().toEqualTypeOf<z.input<typeof rest.ApprovePlanBody>>();
expectTypeOf<Schemas['PutRoutingConfigBody']>().toEqualTypeOf<z.input<typeof rest.PutRoutingConfigBody>>();
expectTypeOf<Schemas['ErrorEnvelope']['error']['code']>().toEqualTypeOf<ErrorCode>();

describe.each(testDrivers)('typed client over HTTP on %s', (driver) => {
  let testDb: TestDatabase;
  let app: Awaited<ReturnType<typeof buildServer>>;
  let baseUrl: string;
  let document: Json;
  let client: Client<paths>;
  let anonymous: Client<paths>;
  const problems: string[] = [];
  let answers = 0;

  /** Checks every answer against the document the server publishes. */
  const described: Middleware = {
    async onResponse({ request, response, schemaPath }) {
      answers += 1;
      const body = await response.clone().text();
      problems.push(...answerProblems(document, { method: request.method, path: schemaPath, status: response.status, headers: response.headers, body }));
    },
  };

  beforeAll(async () => {
    testDb = await openTestDatabase(driver);
    app = await buildServer({ database: testDb.database, publicUrl: 'http://svc.test', dataDir: tmpdir(), rateLimits: { perMinute: 1000, perHour: 10000 } });
    await app.listen({ port: 0, host: '127.0.0.1' });
    const address = app.server.address();
    if (!address || typeof address !== 'object') throw new Error('the server has no TCP address');
    baseUrl = `http://127.0.0.1:${address.port}`;
    document = (await (await fetch(`${baseUrl}/api/v1/openapi.json`)).json()) as Json;
    const workspace = await createWorkspace(testDb.database.db, { name: `typed-${driver}`, defaultAgent: DEFAULT_AGENT });
    const { key } = await createApiKey(testDb.database.db, { workspaceId: workspace!.id, name: 'typed' });
    client = createClient<paths>({ baseUrl, headers: { authorization: `Bearer ${key}` } });
    anonymous = createClient<paths>({ baseUrl });
    client.use(described);
    anonymous.use(described);
  });
  afterEach(() => {
    const found = problems.splice(0);
    expect(found, 'answers the document does not describe').toEqual([]);
  });
  afterAll(async () => {
    await app?.close();
    await testDb?.close();
  });

  /** Ends the task's job as an executor would. */
  async function runJob(jobId: string, result: Parameters<typeof finishJob>[3]) {
    const started = await startJob(testDb.database.db, jobId);
    expect(started?.status).toBe('IN_PROGRESS');
    await finishJob(testDb.database.db, jobId, started!.generation, result);
  }

  it('creates a task through a routing trigger, reads it by id and slug, lists it, pages its jobs and follows up', async () => {
    const put = await client.PUT('/api/v1/routing-configs/{name}', {
      params: { path: { name: 'docs' } },
      body: { mode: 'ask', agent: 'openai/gpt-5', effort: 'high', instructions: 'Answer briefly.' },
    });
    expect(put.response.status).toBe(200);
    expect(put.data!.routingConfig).toMatchObject({ name: 'docs', trigger: '/docs', mode: 'ask', agent: 'openai/gpt-5' });

    const created = await client.POST('/api/v1/tasks', { body: { command: '/docs Where is the cache configured?' } });
    expect(created.response.status).toBe(201);
    const { task, job } = created.data!;
    const status: Schemas['TaskStatus'] = task.status;
    expect(status).toBe('PENDING');
    expect(task).toMatchObject({ mode: 'ask', agent: 'openai/gpt-5', effort: 'high', archived: false, prs: [] });
    expect(job).toMatchObject({ type: 'ASK', status: 'PENDING', input: 'Where is the cache configured?', planOutcome: null, completedAt: null });

    await upsertPullRequests(testDb.database.db, task.id, [
      { repoFullName: 'acme/web', prNumber: 7, prUrl: 'https://github.com/acme/web/pull/7', title: 'Cache docs', state: 'open' },
    ]);
    for (const taskIdOrSlug of [task.id, task.slug]) {
      const got = await client.GET('/api/v1/tasks/{taskIdOrSlug}', { params: { path: { taskIdOrSlug } } });
      expect(got.data!.task.id).toBe(task.id);
      expect(got.data!.task.prs).toEqual([expect.objectContaining({ prNumber: 7, state: 'open' })]);
      expect(got.data!.latestJob?.id).toBe(job.id);
    }

    const listed = await client.GET('/api/v1/tasks', { params: { query: { limit: 10, status: 'PENDING,IN_PROGRESS' } } });
    expect(listed.data!.tasks.map((item) => [item.id, item.latestJobStatus])).toEqual([[task.id, 'PENDING']]);
    expect(listed.data!.nextCursor).toBeNull();
    const none = await client.GET('/api/v1/tasks', { params: { query: { status: 'COMPLETED' } } });
    expect(none.data!.tasks).toEqual([]);

    const followUp = await client.POST('/api/v1/tasks/{taskIdOrSlug}/messages', {
      params: { path: { taskIdOrSlug: task.slug } },
      body: { message: 'And the TTL?', userIntent: 'SWE' },
    });
    expect(followUp.response.status).toBe(201);
    expect(followUp.data!.job).toMatchObject({ type: 'SWE', input: 'And the TTL?' });

    const newest = await client.GET('/api/v1/tasks/{taskIdOrSlug}/jobs', { params: { path: { taskIdOrSlug: task.id }, query: { limit: 1 } } });
    expect(newest.data!.jobs.map((item) => item.id)).toEqual([followUp.data!.job.id]);
    const cursor = newest.data!.nextCursor;
    expect(cursor).toEqual(expect.any(String));
    const older = await client.GET('/api/v1/tasks/{taskIdOrSlug}/jobs', { params: { path: { taskIdOrSlug: task.id }, query: { limit: 1, cursor: cursor! } } });
    expect(older.data!.jobs.map((item) => item.id)).toEqual([job.id]);
    expect(older.data!.nextCursor).toBeNull();
  });

  it('approves a READY plan (409 before it is ready), with the body left out', async () => {
    const created = await client.POST('/api/v1/tasks', { body: { command: 'Plan the migration', userIntent: 'PLAN' } });
    const { task, job } = created.data!;
    expect(job.type).toBe('PLAN');

    const early = await client.POST('/api/v1/tasks/{taskIdOrSlug}/approve-plan', { params: { path: { taskIdOrSlug: task.id } }, body: {} });
    expect(early.response.status).toBe(409);
    const code: Schemas['ErrorEnvelope']['error']['code'] = early.error!.error.code;
    expect(code).toBe('conflict');
    expect(early.data).toBeUndefined();

    await runJob(job.id, { status: 'COMPLETED', plan: '1. Add the column\n2. Backfill', planOutcome: 'READY' });
    const waiting = await client.GET('/api/v1/tasks/{taskIdOrSlug}', { params: { path: { taskIdOrSlug: task.slug } } });
    expect(waiting.data!.task.status).toBe('AWAITING_APPROVAL');
    expect(waiting.data!.latestJob).toMatchObject({ planOutcome: 'READY', plan: '1. Add the column\n2. Backfill' });

    const approved = await client.POST('/api/v1/tasks/{taskIdOrSlug}/approve-plan', { params: { path: { taskIdOrSlug: task.slug } } });
    expect(approved.response.status).toBe(201);
    expect(approved.data!.job).toMatchObject({ type: 'IMPLEMENT_PLAN', status: 'PENDING', plan: '1. Add the column\n2. Backfill' });
    const jobs = await client.GET('/api/v1/tasks/{taskIdOrSlug}/jobs', { params: { path: { taskIdOrSlug: task.id } } });
    expect(jobs.data!.jobs.map((item) => [item.type, item.planOutcome])).toEqual([
      ['PLAN', 'APPROVED'],
      ['IMPLEMENT_PLAN', null],
    ]);
  });

  it('cancels, archives and lists archived tasks', async () => {
    const { task } = (await client.POST('/api/v1/tasks', { body: { command: 'Refactor the billing module', effort: 'low' } })).data!;
    const cancelled = await client.POST('/api/v1/tasks/{taskIdOrSlug}/cancel', { params: { path: { taskIdOrSlug: task.id } } });
    expect(cancelled.response.status).toBe(200);
    expect(cancelled.data!.task.status).toBe('CANCELLED');
    expect(cancelled.data!.cancelledJobs.map((job) => job.status)).toEqual(['CANCELLED']);

    const archived = await client.POST('/api/v1/tasks/{taskIdOrSlug}/archive', { params: { path: { taskIdOrSlug: task.slug } } });
    expect(archived.data!.task.archived).toBe(true);
    const visible = await client.GET('/api/v1/tasks', { params: { query: { limit: 100 } } });
    expect(visible.data!.tasks.map((item) => item.id)).not.toContain(task.id);
    const only = await client.GET('/api/v1/tasks', { params: { query: { archived: 'only' } } });
    expect(only.data!.tasks.map((item) => item.id)).toEqual([task.id]);

    const again = await client.POST('/api/v1/tasks/{taskIdOrSlug}/cancel', { params: { path: { taskIdOrSlug: task.id } } });
    expect(again.data!.cancelledJobs).toEqual([]);
  });

  it('lists, replaces and deletes routing configs; the default one stays', async () => {
    const put = await client.PUT('/api/v1/routing-configs/{name}', {
      params: { path: { name: 'quick' } },
      body: { mode: 'agent', agent: 'anthropic/claude-sonnet-4-5', effort: 'low', instructions: null },
    });
    expect(put.data!.routingConfig).toMatchObject({ name: 'quick', trigger: '/quick', instructions: null });
    const configs = await client.GET('/api/v1/routing-configs');
    expect(configs.data!.routingConfigs.map((config) => config.name)).toEqual(expect.arrayContaining(['default', 'quick']));
    expect(configs.data!.routingConfigs.find((config) => config.name === 'default')).toMatchObject({ trigger: null, mode: 'agent', effort: 'medium' });

    const deleted = await client.DELETE('/api/v1/routing-configs/{name}', { params: { path: { name: 'quick' } } });
    expect(deleted.response.status).toBe(204);
    const gone = await client.DELETE('/api/v1/routing-configs/{name}', { params: { path: { name: 'quick' } } });
    expect(gone.response.status).toBe(404);
    expect(gone.error!.error).toEqual({ code: 'not_found', message: 'Routing config not found' });
    const kept = await client.DELETE('/api/v1/routing-configs/{name}', { params: { path: { name: 'default' } } });
    expect(kept.response.status).toBe(409);
    expect(kept.error!.error.code).toBe('conflict');
  });

  it('streams a task log as text/event-stream', async () => {
    const { task } = (await client.POST('/api/v1/tasks', { body: { command: 'Stream me' } })).data!;
    const logs = await client.GET('/api/v1/tasks/{taskIdOrSlug}/logs', { params: { path: { taskIdOrSlug: task.id } }, parseAs: 'text' });
    expect(logs.response.status).toBe(200);
    expect(logs.response.headers.get('content-type')).toMatch(/^text\/event-stream/);
    expect(logs.data).toContain('event: end');
  });

  it('reads errors through the typed `error`: 401, 404 and 400 with details.issues', async () => {
    const refused = await anonymous.GET('/api/v1/tasks');
    expect(refused.response.status).toBe(401);
    expect(refused.error!.error).toEqual({ code: 'unauthorized', message: 'Invalid or missing API key' });

    const missing = await client.GET('/api/v1/tasks/{taskIdOrSlug}', { params: { path: { taskIdOrSlug: 'missing-aaaaaa' } } });
    expect(missing.response.status).toBe(404);
    expect(missing.error!.error).toEqual({ code: 'not_found', message: 'Task not found' });
    expect(missing.response.headers.get('x-request-id')).toEqual(expect.any(String));

    const invalid = await client.POST('/api/v1/tasks', { body: { command: '   ' } });
    expect(invalid.response.status).toBe(400);
    expect(invalid.error!.error).toMatchObject({ code: 'validation_error', message: 'Invalid request body' });
    expect(invalid.error!.error.details).toEqual({ issues: [{ field: 'command', message: expect.any(String) }] });

    const badQuery = await client.GET('/api/v1/tasks', { params: { query: { limit: 0 } } });
    expect(badQuery.response.status).toBe(400);
    expect(badQuery.error!.error.message).toBe('Invalid query parameters');
  });

  it('checked every answer against the document', () => {
    expect(answers).toBeGreaterThanOrEqual(30);
  });
});
