/**
 * The runner routes that reach beyond the local run, on both databases, through the real routes:
 * pull-request reports, and cloud delegation (destinations, branches, the cloud task and its handoff,
 * retries, continuations, a dispatch that failed) down to the cloud job that checks out exactly the
 * handed-off commits, run by the real executor against the fake model.
 */
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { delegate, type DelegationDeps } from '../src/engine/runners/delegation.js';
import { addRepository } from '../src/engine/repositories.js';
import { RUNNER_LIMITS } from '../src/protocol/runner.js';
import { findRunner } from '../src/store/runners.js';
import { addMembership } from '../src/store/users.js';
import type { Workspace } from '../src/store/workspaces.js';
import { TEST_PUBLIC_URL, useTestApi, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { FAKE_AGENT, journal, useTestEngine, type TestEngine } from './support/engine.js';
import { gitIn, sampleRepository } from './support/repos.js';
import { enrolledRunner, signedInUser, type SignedIn, type TestRunner } from './support/runners.js';

const LOCAL_AGENT = 'openai-compatible/fake';

/** A commit on `branch` of a code-host repository, pushed as a person's `git push` would. */
function pushBranch(api: TestApi, workspaceId: string, fullName: string, branch: string, content: string): string {
  const bare = join(api.dataDir, 'codehost', workspaceId, `${fullName}.git`);
  const parent = mkdtempSync(join(tmpdir(), 'svc-push-'));
  const work = join(parent, 'work');
  try {
    gitIn(parent, 'clone', '--quiet', bare, work);
    const exists = gitIn(work, 'ls-remote', '--heads', 'origin', branch).trim() !== '';
    gitIn(work, 'checkout', '--quiet', '-B', branch, exists ? `origin/${branch}` : 'HEAD');
    writeFileSync(join(work, 'greeting.txt'), `${content}\n`);
    gitIn(work, 'commit', '--quiet', '-am', `greeting: ${content}`);
    gitIn(work, 'push', '--quiet', 'origin', `HEAD:refs/heads/${branch}`);
    return gitIn(work, 'rev-parse', 'HEAD').trim();
  } finally {
    rmSync(parent, { recursive: true, force: true });
  }
}

interface LocalRun {
  owner: SignedIn;
  runner: TestRunner;
  taskId: string;
  runId: string;
  generation: number;
}

async function claimedLocalRun(api: TestApi, owner: SignedIn, runner: TestRunner): Promise<LocalRun> {
  const created = await owner.request('POST', '/api/v1/tasks', {
    command: 'Fix the greeting',
    agent: LOCAL_AGENT,
    local: { runnerId: runner.id, projectId: runner.projectId, permissionMode: 'full' },
  });
  expect(created.statusCode, created.body).toBe(201);
  const { task, job } = created.json() as { task: { id: string }; job: { id: string } };
  const claimed = await runner.request('POST', `/api/v1/runners/runs/${job.id}/claim`, {});
  expect(claimed.statusCode, claimed.body).toBe(200);
  return { owner, runner, taskId: task.id, runId: job.id, generation: claimed.json().run.generation };
}

/** Rows the routes do not show, read straight from the database. */
async function rows<T>(api: TestApi, query: ReturnType<typeof sql>): Promise<T[]> {
  const result = await api.db.database.db.execute(query);
  return (Array.isArray(result) ? result : (result as unknown as { rows: T[] }).rows) as T[];
}

describe.each(testDrivers)('runner delegation on %s', (driver) => {
  describe('reports and handoffs', () => {
    let api: TestApi;
    useTestApi(driver, (ready) => ({ api } = ready));

    /** A person with a runner, and a shared workspace of theirs with `acme/web` connected. */
    async function setup(options: { connect?: boolean } = {}): Promise<{ run: LocalRun; shared: Workspace }> {
      const owner = await signedInUser(api);
      const runner = await enrolledRunner(api, owner);
      const shared = (await api.newTenant()).workspace;
      await addMembership(api.db.database.db, { workspaceId: shared.id, userId: owner.userId, role: 'member' });
      if (options.connect !== false) {
        await addRepository(api.db.database.db, api.environments, { workspace: shared, source: sampleRepository('web'), fullName: 'acme/web', setup: false });
      }
      return { run: await claimedLocalRun(api, owner, runner), shared };
    }

    const report = (run: LocalRun, pullRequests: unknown[]) => run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/pull-requests`, { pullRequests });
    const handOff = (run: LocalRun, invocationId: string, input: Record<string, unknown>, generation = run.generation) =>
      run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/delegate`, { generation, invocationId, input });
    const input = (extra: Record<string, unknown> = {}) => ({
      title: 'Finish the greeting',
      instructions: 'Make the greeting say hello and make the test pass.',
      repositories: [{ repository: 'acme/web', branch: 'feature' }],
      ...extra,
    });
    const cloudTasksOf = (workspaceId: string) => rows<{ id: string }>(api, sql`select id from tasks where workspace_id = ${workspaceId}`);
    const jobsOf = (taskId: string) => rows<{ id: string; status: string; message_id: string | null }>(api, sql`select id, status, message_id from jobs where task_id = ${taskId} order by seq`);
    const handoffsOf = (taskId: string) =>
      rows<{ id: string; body: string; handoff: { invocationId: string; sourceTaskId: string; branches: Array<{ repository: string; branch: string; commit: string }> } }>(
        api,
        sql`select id, body, metadata->'handoff' as handoff from messages where task_id = ${taskId} order by seq`,
      );

    it('upserts reported pull requests by their URL, refuses bad reports, and keeps them after the run completed', async () => {
      const { run } = await setup({ connect: false });
      const github = { prUrl: 'https://github.com/acme/web/pull/12', title: 'Fix the greeting', state: 'open' };
      const gitlab = { prUrl: 'https://gitlab.example.com/acme/platform/api/-/merge_requests/3', title: 'API side', state: 'open' };
      const first = await report(run, [github, gitlab]);
      expect(first.statusCode, first.body).toBe(200);
      const byUrl = <T extends { prUrl: string }>(list: T[]): T[] => [...list].sort((a, b) => a.prUrl.localeCompare(b.prUrl));
      expect(byUrl(first.json().pullRequests)).toEqual([
        { repoFullName: 'acme/web', prNumber: 12, prUrl: github.prUrl, title: 'Fix the greeting', state: 'open' },
        { repoFullName: 'acme/platform/api', prNumber: 3, prUrl: gitlab.prUrl, title: 'API side', state: 'open' },
      ]);
      // The same pull request again updates its record; the code host's own form adds one.
      const own = { prUrl: `${TEST_PUBLIC_URL}/repos/acme/web/pulls/4`, title: 'Built-in', state: 'closed' };
      const second = await report(run, [{ ...github, title: 'Fix the greeting for good', state: 'merged' }, own]);
      expect(byUrl(second.json().pullRequests as Array<{ prUrl: string; repoFullName: string; prNumber: number; title: string; state: string }>).map((pr) => [pr.repoFullName, pr.prNumber, pr.title, pr.state])).toEqual([
        ['acme/web', 4, 'Built-in', 'closed'],
        ['acme/web', 12, 'Fix the greeting for good', 'merged'],
        ['acme/platform/api', 3, 'API side', 'open'],
      ]);

      // Too many, or a URL that names no pull request: refused, naming it; nothing changes.
      const tooMany = Array.from({ length: RUNNER_LIMITS.pullRequestsPerReport + 1 }, (_, index) => ({ ...github, prUrl: `https://github.com/acme/web/pull/${index + 1}` }));
      expect((await report(run, tooMany)).statusCode).toBe(400);
      const bad = await report(run, [{ ...github, prUrl: 'https://github.com/acme/web/issues/12' }]);
      expect(bad.statusCode).toBe(400);
      expect(bad.json().error.details.issues).toEqual([{ field: 'pullRequests.0.prUrl', message: expect.stringContaining('https://github.com/acme/web/issues/12') }]);
      // An empty report removes nothing.
      expect((await report(run, [])).json().pullRequests).toHaveLength(3);

      // The run completes; a refresh afterwards is still taken, and the owner sees the records on the task.
      const done = await run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/complete`, { generation: run.generation, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Opened.' } });
      expect(done.json().state).toBe('completed');
      expect((await report(run, [{ ...gitlab, state: 'merged' }])).statusCode).toBe(200);
      const task = (await run.owner.request('GET', `/api/v1/tasks/${run.taskId}`)).json().task;
      expect(task.prs).toEqual(expect.arrayContaining([expect.objectContaining({ repoFullName: 'acme/platform/api', prNumber: 3, state: 'merged' })]));
      expect(task.prs).toHaveLength(3);

      // Another runner of the same person does not report for this run.
      const other = await enrolledRunner(api, run.owner);
      expect((await other.request('POST', `/api/v1/runners/runs/${run.runId}/pull-requests`, { pullRequests: [github] })).statusCode).toBe(404);
    });

    it('hands off to the one matching workspace: a cloud task with the commits recorded, linked, and a [[TASK]] block; a retry repeats the answer', async () => {
      const { run, shared } = await setup();
      const commit = pushBranch(api, shared.id, 'acme/web', 'feature', 'hello');
      const answer = await handOff(run, 'call-1', input());
      expect(answer.statusCode, answer.body).toBe(200);
      const body = answer.json();
      expect(body).toMatchObject({ ok: true, taskId: expect.any(String), url: expect.stringMatching(/^http:\/\/svc\.test\/tasks\/finish-the-greeting-/) });
      expect(body.markdown).toContain(`[[TASK]]\nid: ${body.taskId}\n`);
      expect(body.markdown).toContain('title: Finish the greeting\n');
      expect(body.markdown).toContain(`url: ${body.url}\n[[/TASK]]`);

      // The cloud task lives in the shared workspace, made by the runner's user, with one queued job.
      const [cloud] = await rows<{ id: string; workspace_id: string; title: string; agent: string; created_by_user_id: string; status: string }>(
        api,
        sql`select id, workspace_id, title, agent, created_by_user_id, status from tasks where id = ${body.taskId}`,
      );
      expect(cloud).toMatchObject({ workspace_id: shared.id, title: 'Finish the greeting', created_by_user_id: run.owner.userId, status: 'PENDING' });
      const [message] = await handoffsOf(body.taskId);
      expect(message!.body).toContain('Make the greeting say hello');
      expect(message!.handoff).toEqual({ invocationId: 'call-1', sourceTaskId: run.taskId, branches: [{ repository: 'acme/web', branch: 'feature', commit }] });
      const [job] = await jobsOf(body.taskId);
      expect(job).toMatchObject({ status: 'PENDING' });
      const [local] = await rows<{ linked_task_id: string }>(api, sql`select linked_task_id from tasks where id = ${run.taskId}`);
      expect(local!.linked_task_id).toBe(body.taskId);
      const [delegation] = await rows<{ cloud_task_id: string; dispatched_job_id: string; input_digest: string }>(api, sql`select * from delegations where local_task_id = ${run.taskId}`);
      expect(delegation).toMatchObject({ cloud_task_id: body.taskId, dispatched_job_id: job!.id, input_digest: expect.stringMatching(/^[0-9a-f]{64}$/) });

      // A transport retry gets the same answer and makes nothing more; the same id with other input is a conflict.
      const retried = await handOff(run, 'call-1', input());
      expect(retried.json()).toEqual(body);
      expect(await cloudTasksOf(shared.id)).toHaveLength(1);
      expect(await jobsOf(body.taskId)).toHaveLength(1);
      const conflict = await handOff(run, 'call-1', input({ instructions: 'Something else.' }));
      expect(conflict.statusCode).toBe(409);
      expect(await jobsOf(body.taskId)).toHaveLength(1);
    });

    it('continues the linked cloud task with later handoffs: a new message and job at the latest commits, first title, workspace and agent kept', async () => {
      const { run, shared } = await setup();
      pushBranch(api, shared.id, 'acme/web', 'feature', 'hello');
      const first = (await handOff(run, 'call-1', input())).json();
      expect(first.ok).toBe(true);
      const [before] = await rows<{ agent: string }>(api, sql`select agent from tasks where id = ${first.taskId}`);

      // More local work pushed; another workspace of the user has the repository too, and is named.
      const later = pushBranch(api, shared.id, 'acme/web', 'feature', 'hello there');
      const other = (await api.newTenant()).workspace;
      await addMembership(api.db.database.db, { workspaceId: other.id, userId: run.owner.userId, role: 'member' });
      await addRepository(api.db.database.db, api.environments, { workspace: other, source: sampleRepository('web'), fullName: 'acme/web', setup: false });
      const second = await handOff(run, 'call-2', input({ title: 'Another title', agent: 'openai/gpt-5', workspaceId: other.id, instructions: 'Now also greet there.' }));
      expect(second.json()).toMatchObject({ ok: true, taskId: first.taskId, url: first.url });

      const [cloud] = await rows<{ title: string; agent: string; workspace_id: string }>(api, sql`select title, agent, workspace_id from tasks where id = ${first.taskId}`);
      expect(cloud).toEqual({ title: 'Finish the greeting', agent: before!.agent, workspace_id: shared.id });
      expect(await cloudTasksOf(other.id)).toHaveLength(0);
      // The first job has not run yet: the handoff queues behind it.
      const jobs = await jobsOf(first.taskId);
      expect(jobs.map((job) => job.status)).toEqual(['PENDING', 'PENDING']);
      const messages = await handoffsOf(first.taskId);
      expect(messages).toHaveLength(2);
      expect(messages[1]!.body).toContain('Now also greet there.');
      expect(messages[1]!.handoff.branches).toEqual([{ repository: 'acme/web', branch: 'feature', commit: later }]);
      // Each job carries its own handoff message.
      expect(jobs.map((job) => job.message_id)).toEqual(messages.map((message) => message.id));
      // Retrying the second call changes nothing.
      expect((await handOff(run, 'call-2', input({ title: 'Another title', agent: 'openai/gpt-5', workspaceId: other.id, instructions: 'Now also greet there.' }))).json()).toEqual(second.json());
      expect(await jobsOf(first.taskId)).toHaveLength(2);
    });

    it('offers the workspaces when several match, takes the one chosen, and refuses one that is not the user\'s', async () => {
      const { run, shared } = await setup();
      const other = (await api.newTenant()).workspace;
      await addMembership(api.db.database.db, { workspaceId: other.id, userId: run.owner.userId, role: 'member' });
      await addRepository(api.db.database.db, api.environments, { workspace: other, source: sampleRepository('web'), fullName: 'acme/web', setup: false });
      pushBranch(api, other.id, 'acme/web', 'feature', 'hello');

      const several = (await handOff(run, 'call-1', input())).json();
      expect(several).toMatchObject({ ok: false, message: expect.stringContaining('workspaceId') });
      expect(several.workspaces.map((workspace: { id: string }) => workspace.id).sort()).toEqual([shared.id, other.id].sort());
      expect(several.workspaces).toEqual(expect.arrayContaining([{ id: other.id, name: other.name }]));
      expect(await cloudTasksOf(shared.id)).toHaveLength(0);

      const stranger = (await api.newTenant()).workspace;
      const foreign = (await handOff(run, 'call-1', input({ workspaceId: stranger.id }))).json();
      expect(foreign).toEqual({ ok: false, message: expect.stringContaining('not one of yours') });

      const chosen = (await handOff(run, 'call-1', input({ workspaceId: other.id }))).json();
      expect(chosen.ok).toBe(true);
      expect((await cloudTasksOf(other.id)).map((task) => task.id)).toEqual([chosen.taskId]);
      expect(await cloudTasksOf(shared.id)).toHaveLength(0);
    });

    it('answers setup guidance with a [[CLOUD_SETUP]] block when no workspace has the repositories, and makes no task for an unpushed branch', async () => {
      const { run, shared } = await setup({ connect: false });
      const none = (await handOff(run, 'call-1', input())).json();
      expect(none).toMatchObject({ ok: false, message: expect.stringContaining('acme/web') });
      expect(none.markdown).toContain(`[[CLOUD_SETUP]]\ntaskId: ${run.taskId}\nrepositories: acme/web\n[[/CLOUD_SETUP]]`);

      await addRepository(api.db.database.db, api.environments, { workspace: shared, source: sampleRepository('web'), fullName: 'acme/web', setup: false });
      const unpushed = (await handOff(run, 'call-1', input({ repositories: [{ repository: 'acme/web', branch: 'not-pushed' }] }))).json();
      expect(unpushed).toEqual({ ok: false, message: expect.stringContaining('not-pushed') });
      const invalid = (await handOff(run, 'call-1', input({ repositories: [{ repository: 'acme/web', branch: 'bad..name' }] }))).json();
      expect(invalid).toEqual({ ok: false, message: expect.stringContaining('bad..name') });
      // Every repository of the project must be handed off.
      const partial = (await handOff(run, 'call-1', input({ repositories: [] }))).json();
      expect(partial).toEqual({ ok: false, message: expect.stringContaining('acme/web') });
      expect(await cloudTasksOf(shared.id)).toHaveLength(0);
      expect(await rows(api, sql`select id from delegations where local_task_id = ${run.taskId}`)).toEqual([]);
    });

    it('refuses a long title, a large body, an incomplete agent, a stale generation and another runner', async () => {
      const { run, shared } = await setup();
      pushBranch(api, shared.id, 'acme/web', 'feature', 'hello');
      const long = await handOff(run, 'call-1', input({ title: `  ${'t'.repeat(RUNNER_LIMITS.delegationTitle + 1)}  ` }));
      expect(long.statusCode).toBe(400);
      expect(long.json().error.details.issues).toEqual([{ field: 'input.title', message: expect.stringContaining('100') }]);
      // Exactly 100 characters once trimmed is fine.
      const exact = await handOff(run, 'call-exact', input({ title: `  ${'t'.repeat(RUNNER_LIMITS.delegationTitle)}  ` }));
      expect(exact.json().ok).toBe(true);
      const [titled] = await rows<{ title: string }>(api, sql`select title from tasks where id = ${exact.json().taskId}`);
      expect(titled!.title).toBe('t'.repeat(RUNNER_LIMITS.delegationTitle));

      const large = await handOff(run, 'call-2', input({ instructions: 'x'.repeat(RUNNER_LIMITS.delegateBytes) }));
      expect(large.statusCode).toBe(413);
      expect((await handOff(run, 'call-3', input({ agent: 'anthropic' }))).statusCode).toBe(400);

      const stale = await handOff(run, 'call-4', input(), run.generation + 1);
      expect(stale.statusCode).toBe(409);
      expect(stale.json().error.details).toEqual({ generation: run.generation });
      const other = await enrolledRunner(api, run.owner);
      const foreign = await other.request('POST', `/api/v1/runners/runs/${run.runId}/delegate`, { generation: run.generation, invocationId: 'call-5', input: input() });
      expect(foreign.statusCode).toBe(404);
      // A run that is not executing hands nothing off.
      await run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/syncing`, { generation: run.generation });
      expect((await handOff(run, 'call-6', input())).statusCode).toBe(409);
    });

    it('answers a dispatch that failed with the cloud task, and the same request retried queues its job once', async () => {
      const { run, shared } = await setup();
      pushBranch(api, shared.id, 'acme/web', 'feature', 'hello');
      const runner = (await findRunner(api.db.database.db, run.runner.id))!;
      let failures = 1;
      const deps: DelegationDeps = {
        db: api.db.database.db,
        codeHost: api.environments.codeHost,
        publicUrl: TEST_PUBLIC_URL,
        beforeDispatch: async () => {
          if (failures-- > 0) throw new Error('the queue is down');
        },
      };
      const body = { generation: run.generation, invocationId: 'call-1', input: input() };
      const failed = await delegate(deps, runner, run.runId, body);
      expect(failed).toMatchObject({ ok: false, message: expect.stringContaining('send the same request again'), taskId: expect.any(String), url: expect.any(String) });
      if (failed.ok) throw new Error('expected a failed dispatch');
      expect(failed.markdown).toContain(`id: ${failed.taskId}`);
      expect(await jobsOf(failed.taskId!)).toEqual([]);

      const retried = await handOff(run, 'call-1', input());
      expect(retried.json()).toMatchObject({ ok: true, taskId: failed.taskId, url: failed.url, markdown: failed.markdown });
      expect(await jobsOf(failed.taskId!)).toHaveLength(1);
      expect((await handOff(run, 'call-1', input())).json()).toEqual(retried.json());
      expect(await jobsOf(failed.taskId!)).toHaveLength(1);
      expect(await cloudTasksOf(shared.id)).toHaveLength(1);
    });
  });

  describe('the cloud checkout', () => {
    let engine: TestEngine;
    useTestEngine(driver, (ready) => (engine = ready));

    async function handedOff(branch: string, hooks: Pick<DelegationDeps, 'beforeDispatch'> = {}): Promise<{ taskId: string; commit: string }> {
      const owner = await signedInUser(engine.api);
      await addMembership(engine.api.db.database.db, { workspaceId: engine.tenant.workspace.id, userId: owner.userId, role: 'member' });
      const runner = await enrolledRunner(engine.api, owner);
      const run = await claimedLocalRun(engine.api, owner, runner);
      const commit = pushBranch(engine.api, engine.tenant.workspace.id, 'acme/web', branch, 'hello');
      const deps: DelegationDeps = { db: engine.api.db.database.db, codeHost: engine.api.environments.codeHost, publicUrl: TEST_PUBLIC_URL, ...hooks };
      const answer = await delegate(deps, (await findRunner(engine.api.db.database.db, runner.id))!, run.runId, {
        generation: run.generation,
        invocationId: randomUUID(),
        input: { title: 'Say hello', instructions: 'Check what is checked out.', repositories: [{ repository: 'acme/web', branch }], agent: FAKE_AGENT },
      });
      if (!answer.ok) throw new Error(`the handoff failed: ${answer.message}`);
      return { taskId: answer.taskId, commit };
    }

    it('starts the cloud job from exactly the handed-off commit, and fails it naming a branch that moved after the handoff', async () => {
      await engine.connect(sampleRepository('web'), 'acme/web');
      engine.script.push(
        { toolCalls: [{ name: 'run_command', arguments: { command: 'cd web && git rev-parse HEAD && git rev-parse --abbrev-ref HEAD && cat greeting.txt' } }] },
        { toolCalls: [{ name: 'finish', arguments: { summary: 'Checked.' } }] },
      );
      const { taskId, commit } = await handedOff('feature');
      const done = await engine.settled(taskId);
      expect(done.latestJob, JSON.stringify(done.latestJob)).toMatchObject({ status: 'COMPLETED' });
      const events = journal((await engine.tenant.request('GET', `/api/v1/tasks/${taskId}/logs`)).body);
      const output = events.find((event) => event.kind === 'tool_result' && event.data.name === 'run_command')?.data.output as string;
      expect(output.split('\n').map((line) => line.trim())).toEqual(expect.arrayContaining(['exit code 0', commit, 'feature', 'hello']));

      // The branch moves between the handoff and its job: the job refuses to start on other code.
      const moved = await handedOff('feature-2', {
        beforeDispatch: async () => {
          pushBranch(engine.api, engine.tenant.workspace.id, 'acme/web', 'feature-2', 'hello again');
        },
      });
      const failed = await engine.settled(moved.taskId);
      expect(failed.task.status).toBe('FAILED');
      expect(failed.latestJob).toMatchObject({ status: 'FAILED', error: expect.stringContaining(`the branch feature-2 of acme/web moved since the handoff (handed off at ${moved.commit}`) });
    });
  });
});
