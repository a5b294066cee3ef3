/**
 * Tenant isolation on both databases: a key sees only its own workspace. Every task route answers 404 for
 * another workspace's task (by id and by slug) exactly as for a task that does not exist, lists never show
 * it, routing configs are per workspace, and nothing the stranger tries changes anything of the owner.
 */
import { eq } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { finishJob, startJob } from '../../src/engine/jobs.js';
import type { GetTaskResponse, ListJobsResponse, ListTasksResponse, RoutingConfig, TaskAndJob } from '../../src/protocol/rest.js';
import { createApiKey } from '../../src/store/api-keys.js';
import { tasks } from '../../src/store/schema.js';
import { listMessages } from '../../src/store/tasks.js';
import { useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const NOT_FOUND = { error: { code: 'not_found', message: 'Task not found' } };

type Attempt = [method: 'GET' | 'POST', path: string, body?: unknown];

/** Every route that names a task, as a stranger would call it, each with a body the owner could send. */
const taskRoutes = (key: string): Attempt[] => [
  ['GET', `/api/v1/tasks/${key}`],
  ['GET', `/api/v1/tasks/${key}/jobs`],
  ['GET', `/api/v1/tasks/${key}/jobs?limit=1`],
  ['GET', `/api/v1/tasks/${key}/logs`],
  ['POST', `/api/v1/tasks/${key}/messages`, { message: 'hijack', userIntent: 'SWE' }],
  ['POST', `/api/v1/tasks/${key}/approve-plan`, { message: 'approve it' }],
  ['POST', `/api/v1/tasks/${key}/approve-plan`],
  ['POST', `/api/v1/tasks/${key}/cancel`],
  ['POST', `/api/v1/tasks/${key}/archive`],
];

describe.each(testDrivers)('tenant isolation on %s', (driver) => {
  let api: TestApi;
  const db = () => api.db.database.db;
  useTestApi(driver, (ready) => ({ api } = ready));

  async function create(tenant: Tenant, body: Record<string, unknown>): Promise<TaskAndJob> {
    const response = await tenant.request('POST', '/api/v1/tasks', body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json() as TaskAndJob;
  }

  /** A task of `owner` whose plan is READY: every action on it would succeed for its owner. */
  async function planAwaitingApproval(owner: Tenant) {
    const { task, job } = await create(owner, { command: 'Private plan', userIntent: 'PLAN' });
    const started = await startJob(db(), job.id);
    await finishJob(db(), job.id, started!.generation, { status: 'COMPLETED', plan: 'Secret plan', planOutcome: 'READY' });
    return task;
  }

  /** Everything the owner can see about a task, to compare before and after. */
  async function snapshot(owner: Tenant, taskId: string) {
    const got = (await owner.request('GET', `/api/v1/tasks/${taskId}`)).json() as GetTaskResponse;
    const jobs = (await owner.request('GET', `/api/v1/tasks/${taskId}/jobs`)).json() as ListJobsResponse;
    const thread = (await listMessages(db(), taskId)).map((message) => message.body);
    return { got, jobs, thread };
  }

  it('answers 404 "Task not found" on every task route for another workspace\'s task, by id and slug', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const task = await planAwaitingApproval(owner);
    const before = await snapshot(owner, task.id);
    expect(before.got.task.status).toBe('AWAITING_APPROVAL');

    for (const key of [task.id, task.id.toUpperCase(), task.slug]) {
      for (const [method, path, body] of taskRoutes(key)) {
        const response = await stranger.request(method, path, body);
        expect(response.statusCode, `${method} ${path}`).toBe(404);
        expect(response.json()).toEqual(NOT_FOUND);
      }
    }
    // The same answer as for a task that does not exist anywhere.
    for (const [method, path, body] of taskRoutes('00000000-0000-4000-8000-000000000000')) {
      expect((await stranger.request(method, path, body)).json(), `${method} ${path}`).toEqual(NOT_FOUND);
    }

    expect(await snapshot(owner, task.id)).toEqual(before);
    // The owner can still do what the stranger could not: the task really was approvable.
    const approved = await owner.request('POST', `/api/v1/tasks/${task.slug}/approve-plan`);
    expect(approved.statusCode).toBe(201);
    expect((approved.json() as TaskAndJob).job.type).toBe('IMPLEMENT_PLAN');
  });

  it('leaves a cancelled task of the owner alone: no follow-up resumes it, no archive hides it', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const { task } = await create(owner, { command: 'Cancelled work' });
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(200);
    const before = await snapshot(owner, task.id);

    for (const key of [task.id, task.slug]) {
      expect((await stranger.request('POST', `/api/v1/tasks/${key}/messages`, { message: 'resume it' })).json()).toEqual(NOT_FOUND);
      expect((await stranger.request('POST', `/api/v1/tasks/${key}/archive`)).json()).toEqual(NOT_FOUND);
    }
    const after = await snapshot(owner, task.id);
    expect(after).toEqual(before);
    expect(after.got.task).toMatchObject({ status: 'CANCELLED', archived: false });
  });

  it('never lists another workspace\'s tasks, whatever the filter or cursor', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const ownerTasks = [];
    for (let i = 0; i < 3; i++) ownerTasks.push((await create(owner, { command: `Owner task ${i}` })).task);
    const mine = (await create(stranger, { command: 'Stranger task' })).task;

    const ids = async (tenant: Tenant, query: string) =>
      ((await tenant.request('GET', `/api/v1/tasks${query}`)).json() as ListTasksResponse).tasks.map((item) => item.id);
    for (const query of ['', '?archived=include', '?archived=only', '?status=PENDING', '?status=PENDING,IN_PROGRESS,CANCELLED', '?limit=100']) {
      expect(await ids(stranger, query), query).toEqual(query === '?archived=only' ? [] : [mine.id]);
    }
    // A cursor taken from the owner's listing pages through the stranger's own tasks only (none are older).
    const page = (await owner.request('GET', '/api/v1/tasks?limit=1')).json() as ListTasksResponse;
    expect(page.nextCursor).toEqual(expect.any(String));
    expect(await ids(owner, `?cursor=${page.nextCursor}&limit=100`)).toEqual([ownerTasks[1]!.id, ownerTasks[0]!.id]);
    expect(await ids(stranger, `?cursor=${page.nextCursor}&limit=100`)).toEqual([]);
    expect(await ids(owner, '?limit=100')).toEqual(ownerTasks.map((item) => item.id).reverse());
  });

  it('resolves a slug within the caller\'s workspace even when another workspace has the same slug', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const ownerTask = (await create(owner, { command: 'Same slug' })).task;
    const strangerTask = (await create(stranger, { command: 'Same slug too' })).task;
    await db().update(tasks).set({ slug: ownerTask.slug }).where(eq(tasks.id, strangerTask.id));

    const seenByStranger = (await stranger.request('GET', `/api/v1/tasks/${ownerTask.slug}`)).json() as GetTaskResponse;
    expect(seenByStranger.task.id).toBe(strangerTask.id);
    expect(((await owner.request('GET', `/api/v1/tasks/${ownerTask.slug}`)).json() as GetTaskResponse).task.id).toBe(ownerTask.id);

    const cancelled = await stranger.request('POST', `/api/v1/tasks/${ownerTask.slug}/cancel`);
    expect(cancelled.statusCode).toBe(200);
    expect((cancelled.json() as TaskAndJob).task.id).toBe(strangerTask.id);
    const ownerView = (await owner.request('GET', `/api/v1/tasks/${ownerTask.id}`)).json() as GetTaskResponse;
    expect(ownerView.task.status).toBe('PENDING');
    expect(ownerView.latestJob?.status).toBe('PENDING');
  });

  it('keeps routing configs per workspace: not listed, not deletable, not replaceable, never triggered', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const secret = { mode: 'ask', agent: 'openai/gpt-5', effort: 'low', instructions: 'Owner only.' };
    expect((await owner.request('PUT', '/api/v1/routing-configs/secret', secret)).statusCode).toBe(200);
    const configs = async (tenant: Tenant) =>
      ((await tenant.request('GET', '/api/v1/routing-configs')).json() as { routingConfigs: RoutingConfig[] }).routingConfigs;
    const ownerBefore = await configs(owner);
    expect(ownerBefore.map((config) => config.name)).toEqual(['default', 'secret']);

    expect((await configs(stranger)).map((config) => config.name)).toEqual(['default']);
    const deleted = await stranger.request('DELETE', '/api/v1/routing-configs/secret');
    expect(deleted.statusCode).toBe(404);
    expect(deleted.json()).toEqual({ error: { code: 'not_found', message: 'Routing config not found' } });

    // The owner's trigger selects nothing for the stranger.
    const created = await create(stranger, { command: '/secret hello' });
    expect(created.task.mode).toBe('agent');
    expect(created.job.input).toBe('/secret hello');

    // A stranger's config of the same name, and an edit of its own default, are its own.
    expect((await stranger.request('PUT', '/api/v1/routing-configs/secret', { mode: 'plan', agent: 'codex/gpt-5-codex', effort: 'high' })).statusCode).toBe(200);
    expect((await stranger.request('PUT', '/api/v1/routing-configs/default', { mode: 'goal', agent: 'openai/gpt-5', effort: 'xhigh' })).statusCode).toBe(200);
    expect((await create(stranger, { command: '/secret hi' })).task).toMatchObject({ mode: 'plan', agent: 'codex/gpt-5-codex' });
    expect((await stranger.request('DELETE', '/api/v1/routing-configs/secret')).statusCode).toBe(204);

    expect(await configs(owner)).toEqual(ownerBefore);
    const ownerTask = await create(owner, { command: '/secret hello' });
    expect(ownerTask.task).toMatchObject({ mode: 'ask', agent: 'openai/gpt-5', effort: 'low' });
    expect(ownerTask.job.input).toBe('hello');
    expect((await create(owner, { command: 'plain' })).task.mode).toBe('agent');
  });

  it('lets every key of the same workspace see its tasks', async () => {
    const owner = await api.newTenant();
    const { task } = await create(owner, { command: 'Shared in the workspace' });
    const { key } = await createApiKey(db(), { workspaceId: owner.workspace.id, name: 'second' });
    const headers = { authorization: `Bearer ${key}` };
    const got = await api.app.inject({ method: 'GET', url: `/api/v1/tasks/${task.slug}`, headers });
    expect(got.statusCode).toBe(200);
    expect((got.json() as GetTaskResponse).task.id).toBe(task.id);
    const cancelled = await api.app.inject({ method: 'POST', url: `/api/v1/tasks/${task.id}/cancel`, headers });
    expect((cancelled.json() as TaskAndJob).task.status).toBe('CANCELLED');
  });
});
