/**
 * Calls a real HTTP server through a client typed by openapi-typescript from the committed document.
 * `npm test` typechecks this file, so a document that drifts from the routes breaks the build here.
 */
import createClient from 'openapi-fetch';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { paths } from '../../src/protocol/openapi.js';
import { buildServer } from '../../src/server/app.js';
import { createApiKey } from '../../src/store/api-keys.js';
import { createWorkspace } from '../../src/store/workspaces.js';
import { DEFAULT_AGENT } from '../support/api.js';
import { openTestDatabase, testDrivers, type TestDatabase } from '../support/db.js';

describe.each(testDrivers)('typed client over HTTP on %s', (driver) => {
  let testDb: TestDatabase;
  let app: Awaited<ReturnType<typeof buildServer>>;
  let client: ReturnType<typeof createClient<paths>>;
  let baseUrl: string;

  beforeAll(async () => {
    testDb = await openTestDatabase(driver);
    app = await buildServer({ database: testDb.database, publicUrl: 'http://svc.test', rateLimits: { perMinute: 1000, perHour: 10000 } });
    await app.listen({ port: 0, host: '127.0.0.1' });
    const address = app.server.address();
    baseUrl = `http://127.0.0.1:${typeof address === 'object' && address ? address.port : 0}`;
    const workspace = await createWorkspace(testDb.database.db, { name: 'typed', defaultAgent: DEFAULT_AGENT });
    const { key } = await createApiKey(testDb.database.db, { workspaceId: workspace!.id, name: 'typed' });
    client = createClient<paths>({ baseUrl, headers: { authorization: `Bearer ${key}` } });
  });
  afterAll(async () => {
    await app?.close();
    await testDb?.close();
  });

  it('drives every endpoint with typed requests and answers', async () => {
    const created = await client.POST('/api/v1/tasks', { body: { command: 'Typed task', effort: 'low' } });
    expect(created.response.status).toBe(201);
    const task = created.data!.task;
    const firstJob = created.data!.job;
    expect(task.effort).toBe('low');
    const status: 'PENDING' | 'IN_PROGRESS' | 'AWAITING_INPUT' | 'AWAITING_APPROVAL' | 'IN_REVIEW' | 'COMPLETED' | 'FAILED' | 'CANCELLED' = task.status;
    expect(status).toBe('PENDING');

    const listed = await client.GET('/api/v1/tasks', { params: { query: { limit: 10, status: 'PENDING' } } });
    expect(listed.data!.tasks.map((item) => item.id)).toEqual([task.id]);
    expect(listed.data!.tasks[0]!.latestJobStatus).toBe('PENDING');
    expect(listed.data!.nextCursor).toBeNull();

    for (const taskIdOrSlug of [task.id, task.slug]) {
      const got = await client.GET('/api/v1/tasks/{taskIdOrSlug}', { params: { path: { taskIdOrSlug } } });
      expect(got.data!.task.id).toBe(task.id);
      expect(got.data!.latestJob?.id).toBe(firstJob.id);
    }

    const followUp = await client.POST('/api/v1/tasks/{taskIdOrSlug}/messages', {
      params: { path: { taskIdOrSlug: task.slug } },
      body: { message: 'Also this', userIntent: 'ASK' },
    });
    expect(followUp.response.status).toBe(201);
    expect(followUp.data!.job.type).toBe('ASK');

    const jobs = await client.GET('/api/v1/tasks/{taskIdOrSlug}/jobs', { params: { path: { taskIdOrSlug: task.id }, query: { limit: 1 } } });
    expect(jobs.data!.jobs.map((job) => job.id)).toEqual([followUp.data!.job.id]);
    expect(jobs.data!.nextCursor).toEqual(expect.any(String));

    const approve = await client.POST('/api/v1/tasks/{taskIdOrSlug}/approve-plan', { params: { path: { taskIdOrSlug: task.id } }, body: {} });
    expect(approve.response.status).toBe(409);
    expect(approve.error!.error.code).toBe('conflict');

    const cancelled = await client.POST('/api/v1/tasks/{taskIdOrSlug}/cancel', { params: { path: { taskIdOrSlug: task.id } } });
    expect(cancelled.data!.task.status).toBe('CANCELLED');
    expect(cancelled.data!.cancelledJobs).toHaveLength(2);

    const archived = await client.POST('/api/v1/tasks/{taskIdOrSlug}/archive', { params: { path: { taskIdOrSlug: task.id } } });
    expect(archived.data!.task.archived).toBe(true);

    const put = await client.PUT('/api/v1/routing-configs/{name}', {
      params: { path: { name: 'docs' } },
      body: { mode: 'ask', agent: 'openai/gpt-5', effort: 'medium', instructions: 'Answer briefly.' },
    });
    expect(put.data!.routingConfig.trigger).toBe('/docs');
    const configs = await client.GET('/api/v1/routing-configs');
    expect(configs.data!.routingConfigs.map((config) => config.name)).toEqual(['default', 'docs']);
    const deleted = await client.DELETE('/api/v1/routing-configs/{name}', { params: { path: { name: 'docs' } } });
    expect(deleted.response.status).toBe(204);

    const missing = await client.GET('/api/v1/tasks/{taskIdOrSlug}', { params: { path: { taskIdOrSlug: 'missing-aaaaaa' } } });
    expect(missing.response.status).toBe(404);
    expect(missing.error!.error).toEqual({ code: 'not_found', message: 'Task not found' });

    const anonymous = createClient<paths>({ baseUrl });
    const refused = await anonymous.GET('/api/v1/tasks');
    expect(refused.response.status).toBe(401);
    expect(refused.error!.error.code).toBe('unauthorized');
  });
});
