import { eq } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { finishJob, startJob } from '../../src/engine/jobs.js';
import { jobs } from '../../src/store/schema.js';
import { listMessages, upsertPullRequests } from '../../src/store/tasks.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const ISO = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$/;

describe.each(testDrivers)('task endpoints on %s', (driver) => {
  let api: TestApi;
  let t: Tenant;
  const db = () => api.db.database.db;

  useTestApi(driver, (ready) => ({ api, tenant: t } = ready));

  async function create(body: Record<string, unknown>, tenant: Tenant = t) {
    const response = await tenant.request('POST', '/api/v1/tasks', body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json();
  }

  /** Runs the task's pending job to an end through the engine's own moves (the executor's job later). */
  async function runLatestJob(taskId: string, result: Parameters<typeof finishJob>[3]) {
    const [pending] = await db().select().from(jobs).where(eq(jobs.taskId, taskId)).orderBy(jobs.seq);
    const all = await db().select().from(jobs).where(eq(jobs.taskId, taskId));
    const job = all.filter((row) => row.status === 'PENDING').sort((a, b) => a.seq - b.seq)[0] ?? pending!;
    const started = await startJob(db(), job.id);
    expect(started?.status).toBe('IN_PROGRESS');
    return finishJob(db(), job.id, started!.generation, result);
  }

  describe('POST /tasks', () => {
    it('answers 201 with the task and its queued job, every field present', async () => {
      const { task, job } = await create({ command: 'Fix the flaky login test\nIt fails on CI.' });
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
    });

    it.each([
      [{}, 'command'],
      [{ command: '' }, 'command'],
      [{ command: '   \n ' }, 'command'],
      [{ command: 42 }, 'command'],
      [{ command: 'x', agent: 'openai' }, 'agent'],
      [{ command: 'x', agent: 'nosuch/model' }, 'agent'],
      [{ command: 'x', agent: 'openai/' }, 'agent'],
      [{ command: 'x', userIntent: 'DEPLOY' }, 'userIntent'],
      [{ command: 'x', effort: 'max' }, 'effort'],
      [{ command: 'x', effort: 'ultracode' }, 'effort'],
      [{ command: 'x', files: [{ url: 'ftp://example.com/a' }] }, 'files.0.url'],
      [{ command: 'x', files: [{ url: 'data:text/plain;base64,@@@' }] }, 'files.0.url'],
      [{ command: 'x', files: 'nope' }, 'files'],
    ])('refuses %j with a validation error naming %s', async (body, field) => {
      const response = await t.request('POST', '/api/v1/tasks', body);
      expect(response.statusCode).toBe(400);
      const { error } = response.json();
      expect(error.code).toBe('validation_error');
      expect(error.message).toBe('Invalid request body');
      expect(error.details.issues.map((issue: { field: string }) => issue.field)).toContain(field);
    });

    it('accepts a complete agent id, a pinned effort and a title', async () => {
      const { task, job } = await create({
        command: 'Refactor',
        agent: 'openai-compatible/meta-llama/Llama-3.3-70B',
        effort: 'high',
        title: 'My title',
      });
      expect(task.agent).toBe('openai-compatible/meta-llama/Llama-3.3-70B');
      expect(task.effort).toBe('high');
      expect(task.title).toBe('My title');
      expect(job.agentProvider).toBe('openai-compatible');
      const ultra = await create({ command: 'Go', agent: 'claude-code/opus', effort: 'ultracode' });
      expect(ultra.task.effort).toBe('ultracode');
    });

    it('selects a routing config by its /trigger and strips it', async () => {
      const put = await t.request('PUT', '/api/v1/routing-configs/research', {
        mode: 'plan',
        agent: 'openai/gpt-5',
        effort: 'high',
        instructions: 'Cite files.',
      });
      expect(put.statusCode).toBe(200);
      const { task, job } = await create({ command: '/research  how does auth work?' });
      expect(task.mode).toBe('plan');
      expect(task.agent).toBe('openai/gpt-5');
      expect(task.effort).toBe('high');
      expect(task.title).toBe('how does auth work?');
      expect(job.type).toBe('PLAN');
      expect(job.input).toBe('how does auth work?');
      const [stored] = await db().select().from(jobs).where(eq(jobs.id, job.id));
      expect(stored?.instructions).toBe('Cite files.');

      // userIntent and agent override the config's mode and agent; the trigger is still stripped.
      const pinned = await create({ command: '/RESEARCH go', userIntent: 'ASK', agent: 'anthropic/claude-opus-4' });
      expect(pinned.task.mode).toBe('ask');
      expect(pinned.task.agent).toBe('anthropic/claude-opus-4');
      expect(pinned.task.effort).toBe('high');
      expect(pinned.job.type).toBe('ASK');
      expect(pinned.job.input).toBe('go');
    });

    it('leaves an unknown /word in place and uses the default config', async () => {
      const { task, job } = await create({ command: '/usr/bin/env is missing' });
      expect(task.mode).toBe('agent');
      expect(job.input).toBe('/usr/bin/env is missing');
    });

    it('refuses a trigger with nothing after it', async () => {
      await t.request('PUT', '/api/v1/routing-configs/empty', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low' });
      const response = await t.request('POST', '/api/v1/tasks', { command: '/empty   ' });
      expect(response.statusCode).toBe(400);
      expect(response.json().error.details.issues[0].field).toBe('command');
    });

    it('stores data: files decoded and http(s) files as references', async () => {
      const content = Buffer.from('hello, file');
      const { task, job } = await create({
        command: 'Look at these',
        files: [
          { name: 'notes.txt', url: `data:text/plain;base64,${content.toString('base64')}` },
          { url: 'https://example.com/shots/screen.png' },
          { name: 'inline.md', url: 'data:text/markdown,%23%20Title' },
        ],
      });
      expect(job.status).toBe('PENDING');
      const [message] = await listMessages(db(), task.id);
      expect(message?.body).toBe('Look at these');
      const files = message!.files;
      expect(files.map((file) => [file.name, file.kind])).toEqual([
        ['notes.txt', 'inline'],
        ['screen.png', 'remote'],
        ['inline.md', 'inline'],
      ]);
      expect(files[0]?.content?.equals(content)).toBe(true);
      expect(files[0]?.mediaType).toBe('text/plain');
      expect(files[0]?.sizeBytes).toBe(content.length);
      expect(files[1]?.url).toBe('https://example.com/shots/screen.png');
      expect(files[1]?.content).toBeNull();
      expect(files[2]?.content?.toString()).toBe('# Title');
    });

    it('fails the task when a file is a browser blob: URL, naming the file', async () => {
      const { task, job } = await create({
        command: 'See attachment',
        files: [{ name: 'screenshot.png', url: 'blob:http://localhost:3000/0f1e-22' }],
      });
      expect(task.status).toBe('FAILED');
      expect(job.status).toBe('FAILED');
      expect(job.error).toContain('"screenshot.png"');
      expect(job.error).toContain('blob:');
      expect(job.completedAt).not.toBeNull();
    });

    it('refuses files over the per-file limit', async () => {
      const big = Buffer.alloc(10 * 1024 * 1024 + 1, 97).toString('base64');
      const response = await t.request('POST', '/api/v1/tasks', { command: 'x', files: [{ name: 'big.bin', url: `data:application/octet-stream;base64,${big}` }] });
      expect(response.statusCode).toBe(400);
      expect(response.json().error.details.issues[0]).toMatchObject({ field: 'files.0.url', message: expect.stringContaining('big.bin') });
    });
  });

  describe('GET /tasks/{id} and /tasks/{id}/jobs', () => {
    it('finds a task by id, upper-case id and slug; 404 otherwise', async () => {
      const { task } = await create({ command: 'Find me' });
      for (const key of [task.id, task.id.toUpperCase(), task.slug]) {
        const response = await t.request('GET', `/api/v1/tasks/${key}`);
        expect(response.statusCode).toBe(200);
        expect(response.json().task).toEqual(task);
      }
      for (const key of ['00000000-0000-4000-8000-000000000000', 'no-such-slug-abcdef', 'not a uuid!']) {
        const response = await t.request('GET', `/api/v1/tasks/${encodeURIComponent(key)}`);
        expect(response.statusCode).toBe(404);
        expect(response.json()).toEqual({ error: { code: 'not_found', message: 'Task not found' } });
      }
    });

    it('carries pull requests and the latest job', async () => {
      const { task } = await create({ command: 'Ship it' });
      await runLatestJob(task.id, { status: 'COMPLETED', finalAnswer: 'Done.' });
      await upsertPullRequests(db(), task.id, [
        { repoFullName: 'acme/web', prNumber: 7, prUrl: 'https://git.example/acme/web/pull/7', title: 'Fix', state: 'open' },
      ]);
      const response = await t.request('GET', `/api/v1/tasks/${task.slug}`);
      const body = response.json();
      expect(body.task.prs).toEqual([
        { repoFullName: 'acme/web', prNumber: 7, prUrl: 'https://git.example/acme/web/pull/7', title: 'Fix', state: 'open' },
      ]);
      expect(body.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Done.', startedAt: expect.stringMatching(ISO), completedAt: expect.stringMatching(ISO) });
      const listed = (await t.request('GET', '/api/v1/tasks?limit=100')).json().tasks.find((item: { id: string }) => item.id === task.id);
      expect(listed.latestJobStatus).toBe('COMPLETED');
      expect(listed.prs).toHaveLength(1);
    });

    it('lists jobs oldest first within the page', async () => {
      const { task, job } = await create({ command: 'First' });
      const second = (await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Second' })).json().job;
      const third = (await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Third', userIntent: 'ASK' })).json().job;
      const response = await t.request('GET', `/api/v1/tasks/${task.slug}/jobs`);
      expect(response.statusCode).toBe(200);
      const body = response.json();
      expect(body.jobs.map((item: { id: string }) => item.id)).toEqual([job.id, second.id, third.id]);
      expect(body.jobs.map((item: { type: string }) => item.type)).toEqual(['SWE', 'SWE', 'ASK']);
      expect(body.nextCursor).toBeNull();
      for (const item of body.jobs) {
        expect(Object.keys(item).sort()).toEqual(
          ['agent', 'agentProvider', 'completedAt', 'createdAt', 'error', 'finalAnswer', 'id', 'input', 'plan', 'planOutcome', 'startedAt', 'status', 'type'],
        );
      }
    });
  });

  describe('GET /tasks', () => {
    it('filters by status and archived state', async () => {
      const tenant = await api.newTenant();
      const pending = await create({ command: 'Pending one' }, tenant);
      const done = await create({ command: 'Done one' }, tenant);
      await runLatestJob(done.task.id, { status: 'COMPLETED' });
      const archived = await create({ command: 'Archived one' }, tenant);
      await runLatestJob(archived.task.id, { status: 'FAILED', error: 'boom' });
      expect((await tenant.request('POST', `/api/v1/tasks/${archived.task.id}/archive`)).statusCode).toBe(200);

      const ids = async (query: string) =>
        (await tenant.request('GET', `/api/v1/tasks${query}`)).json().tasks.map((item: { id: string }) => item.id);
      expect(await ids('')).toEqual([done.task.id, pending.task.id]);
      expect(await ids('?status=PENDING')).toEqual([pending.task.id]);
      expect(await ids('?status=completed,PENDING')).toEqual([done.task.id, pending.task.id]);
      expect(await ids('?archived=only')).toEqual([archived.task.id]);
      expect(await ids('?archived=include')).toEqual([archived.task.id, done.task.id, pending.task.id]);
      expect(await ids('?archived=include&status=FAILED')).toEqual([archived.task.id]);
      for (const query of ['?status=BOGUS', '?status=', '?archived=maybe', '?limit=0', '?limit=101', '?limit=ten']) {
        const response = await tenant.request('GET', `/api/v1/tasks${query}`);
        expect(response.statusCode, query).toBe(400);
        expect(response.json().error.code).toBe('validation_error');
      }
    });
  });

  describe('follow-ups, plans, cancel and archive', () => {
    it('requires a message and queues a job that keeps the agent and mode', async () => {
      const { task } = await create({ command: 'Start', agent: 'openai/gpt-5' });
      const blank = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: '  ' });
      expect(blank.statusCode).toBe(400);
      expect(blank.json().error.details.issues[0].field).toBe('message');
      const missing = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, {});
      expect(missing.statusCode).toBe(400);
      const badIntent = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'x', userIntent: 'GOAL' });
      expect(badIntent.statusCode).toBe(400);
      const sent = await t.request('POST', `/api/v1/tasks/${task.slug}/messages`, { message: 'More please', userIntent: 'DEV_ENVIRONMENT' });
      expect(sent.statusCode).toBe(201);
      expect(sent.json().job).toMatchObject({ type: 'DEV_ENVIRONMENT', agent: 'openai/gpt-5', input: 'More please', status: 'PENDING' });
      expect(sent.json().task.status).toBe('PENDING');
    });

    it('cancels active jobs, stays cancelled, and resumes on a follow-up', async () => {
      const { task, job } = await create({ command: 'Long one' });
      const queued = (await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'and then' })).json().job;
      await startJob(db(), job.id);
      const cancel = await t.request('POST', `/api/v1/tasks/${task.id}/cancel`);
      expect(cancel.statusCode).toBe(200);
      expect(cancel.json().task.status).toBe('CANCELLED');
      expect(cancel.json().cancelledJobs.map((item: { id: string; status: string }) => [item.id, item.status]).sort()).toEqual(
        [[job.id, 'CANCELLED'], [queued.id, 'CANCELLED']].sort(),
      );
      const again = await t.request('POST', `/api/v1/tasks/${task.id}/cancel`);
      expect(again.statusCode).toBe(200);
      expect(again.json().cancelledJobs).toEqual([]);

      const resumed = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Resume please' });
      expect(resumed.statusCode).toBe(201);
      expect(resumed.json().task.status).toBe('PENDING');
      const jobsPage = (await t.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs;
      expect(jobsPage.map((item: { status: string }) => item.status)).toEqual(['CANCELLED', 'CANCELLED', 'PENDING']);
      const thread = await listMessages(db(), task.id);
      expect(thread.map((message) => message.body)).toEqual(['Long one', 'and then', 'Resume please']);
    });

    it('refuses to cancel a finished task', async () => {
      const { task } = await create({ command: 'Quick' });
      await runLatestJob(task.id, { status: 'COMPLETED' });
      const response = await t.request('POST', `/api/v1/tasks/${task.id}/cancel`);
      expect(response.statusCode).toBe(409);
      expect(response.json().error.code).toBe('conflict');
    });

    it('approves a READY plan once and queues its implementation', async () => {
      const { task } = await create({ command: 'Plan it', userIntent: 'PLAN' });
      const early = await t.request('POST', `/api/v1/tasks/${task.id}/approve-plan`);
      expect(early.statusCode).toBe(409);
      expect(early.json().error.code).toBe('conflict');

      await runLatestJob(task.id, { status: 'COMPLETED', plan: '1. Do A\n2. Do B', planOutcome: 'READY' });
      const waiting = (await t.request('GET', `/api/v1/tasks/${task.id}`)).json();
      expect(waiting.task.status).toBe('AWAITING_APPROVAL');
      expect(waiting.latestJob).toMatchObject({ type: 'PLAN', plan: '1. Do A\n2. Do B', planOutcome: 'READY' });

      const approved = await t.request('POST', `/api/v1/tasks/${task.slug}/approve-plan`, { message: 'Keep it small' });
      expect(approved.statusCode).toBe(201);
      expect(approved.json().task.status).toBe('PENDING');
      expect(approved.json().job).toMatchObject({ type: 'IMPLEMENT_PLAN', status: 'PENDING', plan: '1. Do A\n2. Do B' });
      expect(approved.json().job.input).toContain('Keep it small');
      const twice = await t.request('POST', `/api/v1/tasks/${task.slug}/approve-plan`);
      expect(twice.statusCode).toBe(409);
      const history = (await t.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs;
      expect(history[0].planOutcome).toBe('APPROVED');
    });

    it('archives only idle tasks, idempotently, and a follow-up unarchives', async () => {
      const { task } = await create({ command: 'Archive me' });
      const busy = await t.request('POST', `/api/v1/tasks/${task.id}/archive`);
      expect(busy.statusCode).toBe(409);
      await runLatestJob(task.id, { status: 'COMPLETED' });
      const archived = await t.request('POST', `/api/v1/tasks/${task.id}/archive`);
      expect(archived.statusCode).toBe(200);
      expect(archived.json().task.archived).toBe(true);
      expect((await t.request('POST', `/api/v1/tasks/${task.id}/archive`)).json().task.archived).toBe(true);
      const listed = (await t.request('GET', '/api/v1/tasks?limit=100')).json().tasks.map((item: { id: string }) => item.id);
      expect(listed).not.toContain(task.id);
      const followUp = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'One more thing' });
      expect(followUp.json().task).toMatchObject({ archived: false, status: 'PENDING' });
    });

    it('finishing a job moves the task to the state its outcome implies', async () => {
      const asked = await create({ command: 'Ambiguous' });
      await runLatestJob(asked.task.id, { status: 'COMPLETED', finalAnswer: 'Which database?', awaitingInput: true });
      expect((await t.request('GET', `/api/v1/tasks/${asked.task.id}`)).json().task.status).toBe('AWAITING_INPUT');
      const reply = await t.request('POST', `/api/v1/tasks/${asked.task.id}/messages`, { message: 'PostgreSQL' });
      expect(reply.json().task.status).toBe('PENDING');

      const reviewed = await create({ command: 'With PR' });
      await upsertPullRequests(db(), reviewed.task.id, [
        { repoFullName: 'acme/api', prNumber: 1, prUrl: 'https://git.example/acme/api/pull/1', title: 'T', state: 'open' },
      ]);
      await runLatestJob(reviewed.task.id, { status: 'COMPLETED' });
      expect((await t.request('GET', `/api/v1/tasks/${reviewed.task.id}`)).json().task.status).toBe('IN_REVIEW');
    });
  });
});
