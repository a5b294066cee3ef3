/**
 * Every task endpoint of the cloud REST API on both databases: create (fields, agents, effort, files), get,
 * list, jobs, follow-up messages, approve-plan, cancel and archive. Jobs stay PENDING here (no executor
 * runs); tests that need a job to run or end drive it with the engine's own startJob/finishJob. Selection by
 * `/trigger` is in routing.test.ts; body validation of agents, effort and files and the edge errors are in
 * errors.test.ts.
 */
import { createHash } from 'node:crypto';
import type { LightMyRequestResponse } from 'fastify';
import { describe, expect, it } from 'vitest';
import { finishJob, startJob, type JobResult } from '../../src/engine/jobs.js';
import type { CancelTaskResponse, GetTaskResponse, Job, ListJobsResponse, ListTasksResponse, TaskAndJob } from '../../src/protocol/rest.js';
import { findJob, listMessages, upsertPullRequests } from '../../src/store/tasks.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const ISO = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/;
const NOT_FOUND = { error: { code: 'not_found', message: 'Task not found' } };

function expectError(response: LightMyRequestResponse, status: number, code: string) {
  expect(response.statusCode, response.body).toBe(status);
  const { error } = response.json() as { error: { code: string; message: string; details?: { issues?: Array<{ field: string; message: string }> } } };
  expect(error.code).toBe(code);
  return error;
}

const fieldsOf = (response: LightMyRequestResponse) =>
  expectError(response, 400, 'validation_error').details!.issues!.map((issue) => issue.field);

describe.each(testDrivers)('task endpoints on %s', (driver) => {
  let api: TestApi;
  let t: Tenant;
  const db = () => api.db.database.db;
  useTestApi(driver, (ready) => ({ api, tenant: t } = ready));

  async function create(body: Record<string, unknown>, tenant: Tenant = t): Promise<TaskAndJob> {
    const response = await tenant.request('POST', '/api/v1/tasks', body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json() as TaskAndJob;
  }
  async function send(taskKey: string, body: Record<string, unknown>): Promise<TaskAndJob> {
    const response = await t.request('POST', `/api/v1/tasks/${taskKey}/messages`, body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json() as TaskAndJob;
  }
  const getTask = async (key: string, tenant: Tenant = t) => (await tenant.request('GET', `/api/v1/tasks/${key}`)).json() as GetTaskResponse;
  const jobsOf = async (key: string, query = '') => (await t.request('GET', `/api/v1/tasks/${key}/jobs${query}`)).json() as ListJobsResponse;
  const listIds = async (query: string, tenant: Tenant = t) =>
    ((await tenant.request('GET', `/api/v1/tasks${query}`)).json() as ListTasksResponse).tasks.map((task) => task.id);

  /** What an executor would do: claim the job, then end it with `result`. */
  async function runJob(jobId: string, result: JobResult = { status: 'COMPLETED' }) {
    const started = await startJob(db(), jobId);
    expect(started?.status).toBe('IN_PROGRESS');
    return finishJob(db(), jobId, started!.generation, result);
  }

  describe('POST /tasks', () => {
    it('answers 201 with the task and its first queued job, every field present', async () => {
      const response = await t.request('POST', '/api/v1/tasks', { command: 'Fix the flaky login test\nIt fails on CI.' });
      expect(response.statusCode).toBe(201);
      expect(response.headers['content-type']).toMatch(/^application\/json/);
      const { task, job } = response.json() as TaskAndJob;
      expect(task).toEqual({
        id: expect.stringMatching(UUID),
        slug: expect.stringMatching(/^fix-the-flaky-login-test-[a-z0-9]{6}$/),
        title: 'Fix the flaky login test',
        url: `${TEST_PUBLIC_URL}/tasks/${task.slug}`,
        status: 'PENDING',
        mode: 'agent',
        agent: DEFAULT_AGENT,
        effort: 'medium',
        archived: false,
        createdAt: expect.stringMatching(ISO),
        updatedAt: expect.stringMatching(ISO),
        prs: [],
      });
      expect(job).toEqual({
        id: expect.stringMatching(UUID),
        status: 'PENDING',
        type: 'SWE',
        agentProvider: 'anthropic',
        agent: DEFAULT_AGENT,
        input: 'Fix the flaky login test\nIt fails on CI.',
        finalAnswer: null,
        plan: null,
        planOutcome: null,
        error: null,
        createdAt: expect.stringMatching(ISO),
        startedAt: null,
        completedAt: null,
      });
      expect(await getTask(task.id)).toEqual({ task, latestJob: job });
      const [message] = await listMessages(db(), task.id);
      expect(message).toMatchObject({ role: 'user', body: 'Fix the flaky login test\nIt fails on CI.', userIntent: null, files: [] });
    });

    it.each([
      ['missing', {}],
      ['empty', { command: '' }],
      ['blank', { command: ' \t\n  ' }],
      ['null', { command: null }],
      ['a number', { command: 42 }],
    ])('refuses a %s command with validation_error naming `command`, creating nothing', async (_label, body) => {
      const tenant = await api.newTenant();
      const error = expectError(await tenant.request('POST', '/api/v1/tasks', body), 400, 'validation_error');
      expect(error.message).toBe('Invalid request body');
      expect(error.details?.issues).toEqual([{ field: 'command', message: expect.any(String) }]);
      expect(await listIds('?archived=include', tenant)).toEqual([]);
    });

    it('takes a complete agent id, an effort (ultracode with claude-code) and a title; refusals are in errors.test.ts', async () => {
      const pinned = await create({ command: 'Refactor', agent: 'openai-compatible/meta-llama/Llama-3.3-70B', title: '  Named  ', effort: 'low' });
      expect(pinned.task).toMatchObject({ agent: 'openai-compatible/meta-llama/Llama-3.3-70B', mode: 'agent', effort: 'low', title: 'Named' });
      expect(pinned.job).toMatchObject({ agent: 'openai-compatible/meta-llama/Llama-3.3-70B', agentProvider: 'openai-compatible' });
      const ultra = await create({ command: 'Go deep', agent: 'claude-code/opus', effort: 'ultracode' });
      expect(ultra.task).toMatchObject({ agent: 'claude-code/opus', effort: 'ultracode' });
      expect(ultra.job.agentProvider).toBe('claude-code');
      const long = await create({ command: `${'word '.repeat(40)}\nsecond line` });
      expect(long.task.title).toHaveLength(80);
      expect(long.task.title.endsWith('…')).toBe(true);
    });

    it('sets the mode and first run type from userIntent', async () => {
      const expected = { PLAN: ['plan', 'PLAN'], SWE: ['agent', 'SWE'], ASK: ['ask', 'ASK'], DEV_ENVIRONMENT: ['dev_env', 'DEV_ENVIRONMENT'], GOAL: ['goal', 'GOAL'] };
      for (const [userIntent, [mode, type]] of Object.entries(expected)) {
        const { task, job } = await create({ command: 'Do it', userIntent });
        expect([task.mode, job.type], userIntent).toEqual([mode, type]);
        expect((await listMessages(db(), task.id))[0]?.userIntent).toBe(userIntent);
      }
    });

    it('stores data: files decoded and keeps http(s) files as references', async () => {
      const png = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0, 1, 2, 255]);
      const { task, job } = await create({
        command: 'Look at these',
        files: [
          { name: 'shot.png', url: `data:image/png;base64,${png.toString('base64')}` },
          { url: 'https://example.com/docs/spec%20v2.pdf?x=1' },
          { name: 'notes.md', url: 'data:text/markdown,%23%20Title%0Abody' },
          { url: 'http://example.com/raw' },
          { url: 'data:,plain' },
        ],
      });
      expect(task.status).toBe('PENDING');
      expect(job.status).toBe('PENDING');
      const [message] = await listMessages(db(), task.id);
      const files = message!.files;
      expect(files.map((file) => [file.position, file.name, file.kind, file.mediaType, file.sizeBytes, file.url])).toEqual([
        [0, 'shot.png', 'inline', 'image/png', png.length, null],
        [1, 'spec v2.pdf', 'remote', null, null, 'https://example.com/docs/spec%20v2.pdf?x=1'],
        [2, 'notes.md', 'inline', 'text/markdown', 12, null],
        [3, 'raw', 'remote', null, null, 'http://example.com/raw'],
        [4, 'file-5', 'inline', 'text/plain', 5, null],
      ]);
      expect(Buffer.from(files[0]!.content!).equals(png)).toBe(true);
      expect(files[0]!.sha256).toBe(createHash('sha256').update(png).digest('hex'));
      expect(Buffer.from(files[2]!.content!).toString()).toBe('# Title\nbody');
      expect(files[1]!.content).toBeNull();
      expect(Buffer.from(files[4]!.content!).toString()).toBe('plain');
    });

    it('fails the task and its job when a file is a browser blob: URL, naming the file', async () => {
      const { task, job } = await create({
        command: 'See attachment',
        files: [
          { name: 'ok.txt', url: 'data:text/plain,fine' },
          { name: 'screenshot.png', url: 'blob:http://localhost:3000/0f1e-22' },
        ],
      });
      expect(task.status).toBe('FAILED');
      expect(job).toMatchObject({ status: 'FAILED', completedAt: expect.stringMatching(ISO), startedAt: null });
      expect(job.error).toContain('"screenshot.png"');
      expect(job.error).toContain('blob:');
      expect(job.error).not.toContain('ok.txt');
      expect((await getTask(task.slug)).latestJob?.status).toBe('FAILED');
      const files = (await listMessages(db(), task.id))[0]!.files;
      expect(files.map((file) => [file.name, file.kind])).toEqual([['ok.txt', 'inline'], ['screenshot.png', 'blob']]);
      // A blob: file without a name is named by its position.
      const unnamed = await create({ command: 'x', files: [{ url: 'https://e.test/a.txt' }, { url: 'blob:https://app.test/9' }] });
      expect(unnamed.job.error).toContain('"file-2"');
    });
  });

  describe('GET /tasks/{taskIdOrSlug}', () => {
    it('finds a task by id, upper-case id and slug', async () => {
      const { task, job } = await create({ command: 'Find me' });
      for (const key of [task.id, task.id.toUpperCase(), task.slug]) {
        const response = await t.request('GET', `/api/v1/tasks/${key}`);
        expect(response.statusCode, key).toBe(200);
        expect(response.json()).toEqual({ task, latestJob: job });
      }
    });

    it('answers 404 not_found "Task not found" for an unknown id or slug and a malformed id', async () => {
      const { task } = await create({ command: 'Known' });
      const keys = ['00000000-0000-4000-8000-000000000000', 'no-such-task-abc123', encodeURIComponent('not a uuid!'), 'zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz', task.slug.toUpperCase(), `${task.slug}x`];
      for (const key of keys) {
        const response = await t.request('GET', `/api/v1/tasks/${key}`);
        expect(response.statusCode, key).toBe(404);
        expect(response.json()).toEqual(NOT_FOUND);
      }
    });

    it('shows the newest job as latestJob and the pull requests', async () => {
      const { task, job } = await create({ command: 'Ship it' });
      await runJob(job.id, { status: 'COMPLETED', finalAnswer: 'Done.' });
      await upsertPullRequests(db(), task.id, [
        { repoFullName: 'acme/web', prNumber: 7, prUrl: 'https://git.test/acme/web/pull/7', title: 'Fix', state: 'merged' },
        { repoFullName: 'acme/api', prNumber: 3, prUrl: 'https://git.test/acme/api/pull/3', title: 'API', state: 'open' },
      ]);
      const done = await getTask(task.id);
      expect(done.latestJob).toMatchObject({ id: job.id, status: 'COMPLETED', finalAnswer: 'Done.', startedAt: expect.stringMatching(ISO), completedAt: expect.stringMatching(ISO) });
      // Recorded together, so listed by number.
      expect(done.task.prs).toEqual([
        { repoFullName: 'acme/api', prNumber: 3, prUrl: 'https://git.test/acme/api/pull/3', title: 'API', state: 'open' },
        { repoFullName: 'acme/web', prNumber: 7, prUrl: 'https://git.test/acme/web/pull/7', title: 'Fix', state: 'merged' },
      ]);
      const followUp = await send(task.id, { message: 'One more' });
      expect((await getTask(task.slug)).latestJob).toEqual(followUp.job);
    });
  });

  describe('GET /tasks', () => {
    it('lists newest first with the latest job status and pull requests', async () => {
      const tenant = await api.newTenant();
      const first = await create({ command: 'First' }, tenant);
      const second = await create({ command: 'Second', files: [{ url: 'blob:x' }] }, tenant);
      await upsertPullRequests(db(), first.task.id, [{ repoFullName: 'a/b', prNumber: 1, prUrl: 'https://git.test/a/b/pull/1', title: 'T', state: 'open' }]);
      const response = await tenant.request('GET', '/api/v1/tasks');
      expect(response.statusCode).toBe(200);
      const body = response.json() as ListTasksResponse;
      expect(body.nextCursor).toBeNull();
      expect(body.tasks).toEqual([
        { ...second.task, latestJobStatus: 'FAILED' },
        { ...first.task, latestJobStatus: 'PENDING', prs: [{ repoFullName: 'a/b', prNumber: 1, prUrl: 'https://git.test/a/b/pull/1', title: 'T', state: 'open' }] },
      ]);
      const page = (await tenant.request('GET', '/api/v1/tasks?limit=1')).json() as ListTasksResponse;
      expect(page.tasks.map((task) => task.id)).toEqual([second.task.id]);
      expect(page.nextCursor).toEqual(expect.any(String));
    });

    it('filters by status (one, a comma list, any case) and by archived state', async () => {
      const tenant = await api.newTenant();
      const pending = await create({ command: 'Pending' }, tenant);
      const running = await create({ command: 'Running' }, tenant);
      await startJob(db(), running.job.id);
      const done = await create({ command: 'Done' }, tenant);
      await runJob(done.job.id);
      const archived = await create({ command: 'Archived' }, tenant);
      await runJob(archived.job.id, { status: 'FAILED', error: 'boom' });
      expect((await tenant.request('POST', `/api/v1/tasks/${archived.task.id}/archive`)).statusCode).toBe(200);

      expect(await listIds('', tenant)).toEqual([done.task.id, running.task.id, pending.task.id]);
      expect(await listIds('?status=PENDING', tenant)).toEqual([pending.task.id]);
      expect(await listIds('?status=IN_PROGRESS', tenant)).toEqual([running.task.id]);
      expect(await listIds('?status=completed,%20pending', tenant)).toEqual([done.task.id, pending.task.id]);
      expect(await listIds('?status=FAILED', tenant)).toEqual([]);
      expect(await listIds('?status=CANCELLED', tenant)).toEqual([]);
      expect(await listIds('?archived=exclude', tenant)).toEqual([done.task.id, running.task.id, pending.task.id]);
      expect(await listIds('?archived=only', tenant)).toEqual([archived.task.id]);
      expect(await listIds('?archived=include', tenant)).toEqual([archived.task.id, done.task.id, running.task.id, pending.task.id]);
      expect(await listIds('?archived=include&status=FAILED', tenant)).toEqual([archived.task.id]);

      for (const [query, field] of [
        ['?status=BOGUS', 'status'],
        ['?status=PENDING,NOPE', 'status'],
        ['?status=', 'status'],
        ['?status=,', 'status'],
        ['?archived=maybe', 'archived'],
        ['?limit=0', 'limit'],
        ['?limit=101', 'limit'],
        ['?limit=ten', 'limit'],
        ['?cursor=not-a-cursor', 'cursor'],
      ]) {
        const error = expectError(await tenant.request('GET', `/api/v1/tasks${query}`), 400, 'validation_error');
        expect(error.message, query).toBe('Invalid query parameters');
        expect(error.details?.issues?.map((issue) => issue.field), query).toEqual([field]);
      }
    });
  });

  describe('GET /tasks/{taskIdOrSlug}/jobs', () => {
    it('lists every job with every field, chronologically, newest page first', async () => {
      const { task, job } = await create({ command: 'First', agent: 'openai/gpt-5' });
      await runJob(job.id, { status: 'COMPLETED', finalAnswer: 'Answer one' });
      const second = await send(task.id, { message: 'Second', userIntent: 'ASK' });
      const third = await send(task.slug, { message: 'Third' });

      const page = await jobsOf(task.slug);
      expect(page.nextCursor).toBeNull();
      expect(page.jobs.map((item) => [item.id, item.type, item.status, item.input])).toEqual([
        [job.id, 'SWE', 'COMPLETED', 'First'],
        [second.job.id, 'ASK', 'PENDING', 'Second'],
        [third.job.id, 'SWE', 'PENDING', 'Third'],
      ]);
      const ended = { status: 'COMPLETED', finalAnswer: 'Answer one', startedAt: expect.stringMatching(ISO), completedAt: expect.stringMatching(ISO) };
      expect(page.jobs[0]).toEqual({ ...job, ...ended });
      expect(page.jobs[1]).toEqual(second.job);
      expect(page.jobs[2]).toEqual(third.job);

      const newest = await jobsOf(task.id, '?limit=2');
      expect(newest.jobs.map((item) => item.id)).toEqual([second.job.id, third.job.id]);
      expect(newest.nextCursor).toEqual(expect.any(String));
      const older = await jobsOf(task.id, `?limit=2&cursor=${newest.nextCursor}`);
      expect(older.jobs.map((item) => item.id)).toEqual([job.id]);
      expect(older.nextCursor).toBeNull();
    });

    it('validates limit and cursor, and answers 404 for an unknown task', async () => {
      const { task } = await create({ command: 'Jobs' });
      for (const [query, field] of [['?limit=0', 'limit'], ['?limit=101', 'limit'], ['?limit=1.5', 'limit'], ['?cursor=%2F%2F', 'cursor']]) {
        const error = expectError(await t.request('GET', `/api/v1/tasks/${task.id}/jobs${query}`), 400, 'validation_error');
        expect(error.details?.issues?.map((issue) => issue.field)).toEqual([field]);
      }
      const tasksCursor = ((await t.request('GET', '/api/v1/tasks?limit=1')).json() as ListTasksResponse).nextCursor;
      expectError(await t.request('GET', `/api/v1/tasks/${task.id}/jobs?cursor=${tasksCursor}`), 400, 'validation_error');
      for (const key of ['00000000-0000-4000-8000-000000000000', 'missing-slug']) {
        const response = await t.request('GET', `/api/v1/tasks/${key}/jobs`);
        expect(response.statusCode).toBe(404);
        expect(response.json()).toEqual(NOT_FOUND);
      }
    });
  });

  describe('POST /tasks/{taskIdOrSlug}/messages', () => {
    it('requires a non-blank message and a known userIntent', async () => {
      const { task } = await create({ command: 'Start' });
      for (const body of [{}, { message: '' }, { message: ' \n ' }, { message: 7 }]) {
        expect(fieldsOf(await t.request('POST', `/api/v1/tasks/${task.id}/messages`, body)), JSON.stringify(body)).toEqual(['message']);
      }
      expect(fieldsOf(await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'x', userIntent: 'GOAL' }))).toEqual(['userIntent']);
      expect(fieldsOf(await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'x', files: [{ url: 'ftp://x' }] }))).toEqual(['files.0.url']);
      const unknown = await t.request('POST', '/api/v1/tasks/00000000-0000-4000-8000-000000000000/messages', { message: 'x' });
      expect(unknown.statusCode).toBe(404);
      expect(unknown.json()).toEqual(NOT_FOUND);
      expect((await jobsOf(task.id)).jobs).toHaveLength(1);
    });

    it('queues a job that keeps the task agent, effort and mode; userIntent switches the run type', async () => {
      const { task } = await create({ command: 'Start', agent: 'openai/gpt-5', effort: 'high', userIntent: 'ASK' });
      const plain = await send(task.id, { message: 'And also' });
      expect(plain.job).toMatchObject({ type: 'ASK', status: 'PENDING', agent: 'openai/gpt-5', agentProvider: 'openai', input: 'And also' });
      expect(plain.task).toMatchObject({ id: task.id, status: 'PENDING', mode: 'ask', effort: 'high' });
      for (const [userIntent, type] of [['PLAN', 'PLAN'], ['SWE', 'SWE'], ['ASK', 'ASK'], ['DEV_ENVIRONMENT', 'DEV_ENVIRONMENT']]) {
        const sent = await send(task.slug, { message: `as ${userIntent}`, userIntent });
        expect(sent.job.type).toBe(type);
        expect(sent.task.mode).toBe('ask');
      }
      const thread = await listMessages(db(), task.id);
      expect(thread.map((message) => [message.body, message.userIntent])).toEqual([
        ['Start', 'ASK'],
        ['And also', null],
        ['as PLAN', 'PLAN'],
        ['as SWE', 'SWE'],
        ['as ASK', 'ASK'],
        ['as DEV_ENVIRONMENT', 'DEV_ENVIRONMENT'],
      ]);
    });

    it('queues behind a running job without changing the task status; the task goes on when it ends', async () => {
      const { task, job } = await create({ command: 'Long' });
      await startJob(db(), job.id);
      const queued = await send(task.id, { message: 'Then this' });
      expect(queued.task.status).toBe('IN_PROGRESS');
      expect(queued.job.status).toBe('PENDING');
      const running = await findJob(db(), job.id);
      await finishJob(db(), job.id, running!.generation, { status: 'COMPLETED' });
      expect((await getTask(task.id)).task.status).toBe('PENDING');
    });

    it('resumes a cancelled, archived task on the same thread with a new job', async () => {
      const { task, job } = await create({ command: 'Long one' });
      expect((await t.request('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(200);
      expect(((await t.request('POST', `/api/v1/tasks/${task.id}/archive`)).json() as { task: { archived: boolean } }).task.archived).toBe(true);
      expect(await listIds('?limit=100')).not.toContain(task.id);

      const resumed = await send(task.id, { message: 'Resume please', files: [{ name: 'log.txt', url: 'data:text/plain,trace' }] });
      expect(resumed.task).toMatchObject({ id: task.id, slug: task.slug, status: 'PENDING', archived: false });
      expect(resumed.job).toMatchObject({ status: 'PENDING', input: 'Resume please' });
      expect(resumed.job.id).not.toBe(job.id);
      expect((await jobsOf(task.id)).jobs.map((item) => [item.id, item.status])).toEqual([[job.id, 'CANCELLED'], [resumed.job.id, 'PENDING']]);
      expect(await listIds('?limit=100')).toContain(task.id);
      const thread = await listMessages(db(), task.id);
      expect(thread.map((message) => message.body)).toEqual(['Long one', 'Resume please']);
      expect(thread[1]!.files.map((file) => [file.name, Buffer.from(file.content!).toString()])).toEqual([['log.txt', 'trace']]);
    });

    it('fails a follow-up whose file is a blob: URL at once, leaving the task where it was', async () => {
      const { task, job } = await create({ command: 'Done soon' });
      await runJob(job.id);
      const sent = await send(task.id, { message: 'With a blob', files: [{ name: 'pic.png', url: 'blob:https://app.test/1' }] });
      expect(sent.job).toMatchObject({ status: 'FAILED', error: expect.stringContaining('"pic.png"'), completedAt: expect.stringMatching(ISO) });
      expect(sent.task.status).toBe('COMPLETED');
      expect((await getTask(task.id)).latestJob?.id).toBe(sent.job.id);
      // On a queued task the failed follow-up does not stop the job already waiting.
      const queued = await create({ command: 'Queued' });
      const failed = await send(queued.task.id, { message: 'x', files: [{ url: 'blob:https://app.test/2' }] });
      expect([failed.task.status, failed.job.status]).toEqual(['PENDING', 'FAILED']);
      expect((await jobsOf(queued.task.id)).jobs.map((item) => item.status)).toEqual(['PENDING', 'FAILED']);
    });
  });

  describe('POST /tasks/{taskIdOrSlug}/approve-plan', () => {
    it('is 409 conflict without a READY plan', async () => {
      const planning = await create({ command: 'Plan it', userIntent: 'PLAN' });
      const early = expectError(await t.request('POST', `/api/v1/tasks/${planning.task.id}/approve-plan`), 409, 'conflict');
      expect(early.message).toMatch(/plan/i);
      const native = await create({ command: 'Native plan', userIntent: 'PLAN' });
      await runJob(native.job.id, { status: 'COMPLETED', plan: 'local plan', planOutcome: 'NATIVE' });
      expect((await getTask(native.task.id)).task.status).toBe('COMPLETED');
      expectError(await t.request('POST', `/api/v1/tasks/${native.task.id}/approve-plan`), 409, 'conflict');
      const plain = await create({ command: 'No plan' });
      await runJob(plain.job.id);
      expectError(await t.request('POST', `/api/v1/tasks/${plain.task.slug}/approve-plan`), 409, 'conflict');
      expect((await jobsOf(plain.task.id)).jobs).toHaveLength(1);
      const missing = await t.request('POST', '/api/v1/tasks/no-such-plan/approve-plan');
      expect(missing.statusCode).toBe(404);
      expect(missing.json()).toEqual(NOT_FOUND);
    });

    it('approves a READY plan once, queuing an IMPLEMENT_PLAN job', async () => {
      const { task, job } = await create({ command: 'Plan it', userIntent: 'PLAN', agent: 'openai/gpt-5' });
      await runJob(job.id, { status: 'COMPLETED', plan: '1. Do A\n2. Do B', planOutcome: 'READY' });
      const waiting = await getTask(task.id);
      expect(waiting.task.status).toBe('AWAITING_APPROVAL');
      expect(waiting.latestJob).toMatchObject({ id: job.id, type: 'PLAN', plan: '1. Do A\n2. Do B', planOutcome: 'READY' });
      expect(fieldsOf(await t.request('POST', `/api/v1/tasks/${task.id}/approve-plan`, { message: 5 }))).toEqual(['message']);

      const response = await t.request('POST', `/api/v1/tasks/${task.slug}/approve-plan`);
      expect(response.statusCode).toBe(201);
      const approved = response.json() as TaskAndJob;
      expect(approved.task).toMatchObject({ id: task.id, status: 'PENDING', mode: 'plan' });
      expect(approved.job).toEqual({
        ...job,
        id: expect.stringMatching(UUID),
        type: 'IMPLEMENT_PLAN',
        input: '1. Do A\n2. Do B',
        plan: '1. Do A\n2. Do B',
        createdAt: expect.stringMatching(ISO),
      });
      expect(approved.job.id).not.toBe(job.id);
      const history = (await jobsOf(task.id)).jobs;
      expect(history.map((item) => [item.type, item.planOutcome])).toEqual([['PLAN', 'APPROVED'], ['IMPLEMENT_PLAN', null]]);
      const twice = expectError(await t.request('POST', `/api/v1/tasks/${task.id}/approve-plan`), 409, 'conflict');
      expect(twice.message).toMatch(/plan/i);
      expect((await jobsOf(task.id)).jobs).toHaveLength(2);
    });

    it('appends an optional message to the implementation input', async () => {
      const { task, job } = await create({ command: 'Plan', userIntent: 'PLAN' });
      await runJob(job.id, { status: 'COMPLETED', plan: 'The plan', planOutcome: 'READY' });
      const approved = await t.request('POST', `/api/v1/tasks/${task.id}/approve-plan`, { message: 'Keep it small' });
      expect((approved.json() as TaskAndJob).job.input).toBe('The plan\n\nKeep it small');
    });

    it('approves exactly once when two approvals race', async () => {
      const { task, job } = await create({ command: 'Race', userIntent: 'PLAN' });
      await runJob(job.id, { status: 'COMPLETED', plan: 'P', planOutcome: 'READY' });
      const answers = await Promise.all([1, 2].map(() => t.request('POST', `/api/v1/tasks/${task.id}/approve-plan`)));
      expect(answers.map((answer) => answer.statusCode).sort()).toEqual([201, 409]);
      expect((await jobsOf(task.id)).jobs.map((item) => item.type)).toEqual(['PLAN', 'IMPLEMENT_PLAN']);
    });
  });

  describe('task status after a job ends', () => {
    it('waits for input after a question and for review with an open pull request; a reply resumes it', async () => {
      const asked = await create({ command: 'Ambiguous' });
      await runJob(asked.job.id, { status: 'COMPLETED', finalAnswer: 'Which database?', awaitingInput: true });
      const waiting = await getTask(asked.task.id);
      expect(waiting.task.status).toBe('AWAITING_INPUT');
      expect(waiting.latestJob?.finalAnswer).toBe('Which database?');
      expect((await send(asked.task.id, { message: 'PostgreSQL' })).task.status).toBe('PENDING');

      const reviewed = await create({ command: 'With PR' });
      await upsertPullRequests(db(), reviewed.task.id, [{ repoFullName: 'a/b', prNumber: 1, prUrl: 'https://git.test/a/b/pull/1', title: 'T', state: 'open' }]);
      await runJob(reviewed.job.id);
      expect((await getTask(reviewed.task.id)).task.status).toBe('IN_REVIEW');
      expect(await listIds('?status=IN_REVIEW,AWAITING_INPUT&limit=100')).toEqual([reviewed.task.id]);
      expectError(await t.request('POST', `/api/v1/tasks/${reviewed.task.id}/cancel`), 409, 'conflict');
    });
  });

  describe('POST /tasks/{taskIdOrSlug}/cancel', () => {
    it('cancels pending and running jobs, leaves finished ones, and is harmless twice', async () => {
      const { task, job: first } = await create({ command: 'Cancel me' });
      await runJob(first.id);
      const running = await send(task.id, { message: 'running' });
      const started = await startJob(db(), running.job.id);
      const queued = await send(task.id, { message: 'queued' });

      const response = await t.request('POST', `/api/v1/tasks/${task.slug}/cancel`);
      expect(response.statusCode).toBe(200);
      const body = response.json() as CancelTaskResponse;
      expect(body.task).toMatchObject({ id: task.id, status: 'CANCELLED' });
      expect(body.cancelledJobs.map((item) => item.id).sort()).toEqual([running.job.id, queued.job.id].sort());
      for (const item of body.cancelledJobs) expect(item).toMatchObject({ status: 'CANCELLED', completedAt: expect.stringMatching(ISO) });
      expect((await jobsOf(task.id)).jobs.map((item: Job) => item.status)).toEqual(['COMPLETED', 'CANCELLED', 'CANCELLED']);

      const again = await t.request('POST', `/api/v1/tasks/${task.id}/cancel`);
      expect(again.statusCode).toBe(200);
      expect((again.json() as CancelTaskResponse).cancelledJobs).toEqual([]);
      expect((again.json() as CancelTaskResponse).task.status).toBe('CANCELLED');
      // The executor that held the running job cannot finish it any more; the task stays cancelled.
      await expect(finishJob(db(), running.job.id, started!.generation, { status: 'COMPLETED' })).rejects.toThrow(/no longer held/);
      expect(await startJob(db(), queued.job.id)).toBeNull();
      expect((await getTask(task.id)).task.status).toBe('CANCELLED');
    });

    it('cancels a task waiting for approval; refuses finished tasks with 409', async () => {
      const plan = await create({ command: 'Plan', userIntent: 'PLAN' });
      await runJob(plan.job.id, { status: 'COMPLETED', plan: 'p', planOutcome: 'READY' });
      const waiting = (await t.request('POST', `/api/v1/tasks/${plan.task.id}/cancel`)).json() as CancelTaskResponse;
      expect(waiting).toMatchObject({ task: { status: 'CANCELLED' }, cancelledJobs: [] });

      for (const result of [{ status: 'COMPLETED' }, { status: 'FAILED', error: 'x' }] as const) {
        const { task, job } = await create({ command: `Finished ${result.status}` });
        await runJob(job.id, result);
        const error = expectError(await t.request('POST', `/api/v1/tasks/${task.id}/cancel`), 409, 'conflict');
        expect(error.message).toContain(result.status);
        expect((await getTask(task.id)).task.status).toBe(result.status);
      }
      const missing = await t.request('POST', '/api/v1/tasks/00000000-0000-4000-8000-000000000000/cancel');
      expect(missing.json()).toEqual(NOT_FOUND);
    });
  });

  describe('POST /tasks/{taskIdOrSlug}/archive', () => {
    it('refuses active tasks, archives idle ones idempotently and hides them from the default list', async () => {
      const { task, job } = await create({ command: 'Archive me' });
      expectError(await t.request('POST', `/api/v1/tasks/${task.id}/archive`), 409, 'conflict');
      await startJob(db(), job.id);
      expectError(await t.request('POST', `/api/v1/tasks/${task.slug}/archive`), 409, 'conflict');
      const running = await findJob(db(), job.id);
      await finishJob(db(), job.id, running!.generation, { status: 'COMPLETED' });

      const first = await t.request('POST', `/api/v1/tasks/${task.id}/archive`);
      expect(first.statusCode).toBe(200);
      const archived = (first.json() as { task: GetTaskResponse['task'] }).task;
      expect(archived).toMatchObject({ id: task.id, status: 'COMPLETED', archived: true });
      const second = await t.request('POST', `/api/v1/tasks/${task.slug}/archive`);
      expect(second.statusCode).toBe(200);
      expect((second.json() as { task: unknown }).task).toEqual(archived);

      expect(await listIds('?limit=100')).not.toContain(task.id);
      expect(await listIds('?limit=100&archived=only')).toContain(task.id);
      expect((await getTask(task.id)).task.archived).toBe(true);
      const missing = await t.request('POST', '/api/v1/tasks/nothing-here/archive');
      expect(missing.json()).toEqual(NOT_FOUND);
    });
  });
});
