/**
 * Temporary workspace shell access on both databases, through the real routes: a local run asks for a
 * grant (POST /runners/runs/{runId}/workspace-ssh), and its token runs commands in a sandboxed fork of the
 * workspace environment kept for the grant (POST /api/v1/workspace-shell), until it expires and the
 * scheduler's sweep removes the fork.
 */
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { AppError } from '../src/domain/errors.js';
import { challengeOf, generateRunnerCredential } from '../src/domain/runners.js';
import { hashSecret } from '../src/domain/secrets.js';
import { ForkLifecycle } from '../src/engine/fork-lifecycle.js';
import {
  CommandLanes,
  expireWorkspaceShells,
  SHELL_BUSY_RETRY_AFTER_SECONDS,
  SHELL_GRANTS_PER_RUN,
  SHELL_QUEUED_COMMANDS,
  shellForksRoot,
  WorkspaceShells,
} from '../src/engine/runners/workspace-shell.js';
import { addRepository } from '../src/engine/repositories.js';
import { RUNNER_LIMITS } from '../src/protocol/runner.js';
import { readSnapshot } from '../src/sandbox/fork.js';
import { findActiveSshGrant } from '../src/store/delegations.js';
import { addMembership } from '../src/store/users.js';
import type { Workspace } from '../src/store/workspaces.js';
import { TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { sampleRepository } from './support/repos.js';
import { enrolledRunner, signedInUser, type SignedIn, type TestRunner } from './support/runners.js';

interface LocalRun {
  owner: SignedIn;
  runner: TestRunner;
  taskId: string;
  runId: string;
  generation: number;
}

describe.each(testDrivers)('workspace shell on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  /** A person with a runner whose project has `repositories`, running a local task. */
  async function localRun(repositories: string[] = ['acme/web']): Promise<LocalRun> {
    const owner = await signedInUser(api);
    const projectId = crypto.randomUUID();
    const runner = await enrolledRunner(api, owner, { projects: [{ id: projectId, name: 'web', repositories: repositories.map((name) => ({ name })) }] });
    const created = await owner.request('POST', '/api/v1/tasks', {
      command: 'Look at the cloud workspace',
      agent: 'openai-compatible/fake',
      local: { runnerId: runner.id, projectId, permissionMode: 'full' },
    });
    expect(created.statusCode, created.body).toBe(201);
    const { task, job } = created.json() as { task: { id: string }; job: { id: string } };
    const claimed = await runner.request('POST', `/api/v1/runners/runs/${job.id}/claim`, {});
    expect(claimed.statusCode, claimed.body).toBe(200);
    return { owner, runner, taskId: task.id, runId: job.id, generation: claimed.json().run.generation };
  }

  /** A workspace of the person's with the repositories connected. */
  async function sharedWorkspace(run: LocalRun, repositories: string[]): Promise<Workspace> {
    const workspace = (await api.newTenant()).workspace;
    await addMembership(api.db.database.db, { workspaceId: workspace.id, userId: run.owner.userId, role: 'member' });
    for (const fullName of repositories) {
      await addRepository(api.db.database.db, api.environments, { workspace, source: sampleRepository(fullName.split('/')[1]!), fullName, setup: false });
    }
    return workspace;
  }

  const ask = (run: LocalRun, input: Record<string, unknown> = {}, generation = run.generation) =>
    run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/workspace-ssh`, { generation, input });
  const shell = (token: string, body: Record<string, unknown>) =>
    api.app.inject({ method: 'POST', url: '/api/v1/workspace-shell', headers: { authorization: `Bearer ${token}` }, payload: body });

  it('grants a token that runs commands in a fork kept for the grant, sandboxed, with outputs capped', async () => {
    const run = await localRun();
    const workspace = await sharedWorkspace(run, ['acme/web']);
    const granted = await ask(run);
    expect(granted.statusCode, granted.body).toBe(200);
    const grant = granted.json();
    expect(grant).toMatchObject({ ok: true, workspaceId: workspace.id, ssh: { url: `${TEST_PUBLIC_URL}/api/v1/workspace-shell`, token: expect.stringMatching(/^service_ssh_[A-Za-z0-9_-]{43}$/) } });
    expect(grant.markdown.endsWith(`[[CLOUD_WORKSPACE]]\nworkspaceId: ${workspace.id}\n[[/CLOUD_WORKSPACE]]`)).toBe(true);
    expect(grant.markdown).not.toContain(grant.ssh.token);
    // Valid 60 minutes from its making; only the token's hash is kept.
    const stored = await rows<{ token_hash: string; ttl_ms: string | number; expires_at: string | Date }>(
      sql`select token_hash, extract(epoch from expires_at - created_at) * 1000 as ttl_ms, expires_at from workspace_ssh_grants where workspace_id = ${workspace.id}`,
    );
    expect(stored).toHaveLength(1);
    expect(stored[0]!.token_hash).toBe(hashSecret(grant.ssh.token));
    expect(Number(stored[0]!.ttl_ms)).toBe(RUNNER_LIMITS.sshAccessTtlMs);
    expect(new Date(stored[0]!.expires_at).toISOString()).toBe(grant.expiresAt);

    const token: string = grant.ssh.token;
    expect((await shell(token, { command: 'echo hi' })).json()).toEqual({ exitCode: 0, stdout: 'hi\n', stderr: '', timedOut: false, stdoutTruncated: false, stderrTruncated: false });
    expect((await shell(token, { command: 'cat', stdin: 'from the laptop\n' })).json()).toMatchObject({ exitCode: 0, stdout: 'from the laptop\n' });
    expect((await shell(token, { command: 'echo oops >&2; exit 3' })).json()).toMatchObject({ exitCode: 3, stdout: '', stderr: 'oops\n' });
    // The workspace's repositories are there, and what one command writes the next one reads.
    expect((await shell(token, { command: 'cat web/greeting.txt' })).json().stdout).toBe('hi\n');
    expect((await shell(token, { command: 'echo kept > notes.txt' })).json().exitCode).toBe(0);
    expect((await shell(token, { command: 'cat /workspace/notes.txt' })).json().stdout).toBe('kept\n');
    // The service's data dir is not in the sandbox.
    expect((await shell(token, { command: `test -e ${api.dataDir} || echo absent` })).json().stdout).toBe('absent\n');
    // An output past the cap is cut and says so; the command still ran to its end.
    const flood = (await shell(token, { command: `head -c ${RUNNER_LIMITS.shellOutputBytes + 10} /dev/zero | tr '\\0' a; echo done >&2` })).json();
    expect(flood).toMatchObject({ exitCode: 0, stdoutTruncated: true, stderrTruncated: false, stderr: 'done\n' });
    expect(flood.stdout).toHaveLength(RUNNER_LIMITS.shellOutputBytes);
    // A bad body is refused.
    expect((await shell(token, { command: '' })).statusCode).toBe(400);
    expect((await shell(token, { command: 'true', timeoutSeconds: RUNNER_LIMITS.shellTimeoutSeconds + 1 })).statusCode).toBe(400);

    // The fork records its environment version, which environment garbage collection therefore keeps.
    const grantId = (await rows<{ id: string }>(sql`select id from workspace_ssh_grants where workspace_id = ${workspace.id}`))[0]!.id;
    const snapshot = readSnapshot(join(shellForksRoot(api.dataDir), workspace.id, `${grantId}.lower`));
    expect(snapshot).not.toBeNull();
    expect(ForkLifecycle.versionsInUse(join(api.dataDir, 'forks'), workspace.id).has(snapshot!.version)).toBe(true);
  });

  it('takes only its own token: API keys, sessions, runner credentials and ended grants get 401, and the sweep removes ended grants\' forks', async () => {
    const run = await localRun();
    const workspace = await sharedWorkspace(run, ['acme/web']);
    const first = (await ask(run)).json();
    const second = (await ask(run)).json();
    expect((await shell(first.ssh.token, { command: 'touch mine' })).json().exitCode).toBe(0);
    expect((await shell(second.ssh.token, { command: 'test -e mine || echo separate' })).json().stdout).toBe('separate\n');

    const unauthorized = async (headers: Record<string, string>) => {
      const response = await api.app.inject({ method: 'POST', url: '/api/v1/workspace-shell', headers, payload: { command: 'echo hi' } });
      expect(response.statusCode, JSON.stringify(headers)).toBe(401);
      expect(response.json().error.code).toBe('unauthorized');
    };
    await unauthorized({});
    await unauthorized(tenant.headers);
    await unauthorized({ cookie: run.owner.cookie, 'x-csrf-token': run.owner.csrfToken });
    await unauthorized({ authorization: `Bearer ${run.runner.credential}` });
    await unauthorized({ authorization: `Bearer service_ssh_${'a'.repeat(43)}` });
    // The token is no key anywhere else.
    expect((await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `Bearer ${first.ssh.token}` } })).statusCode).toBe(401);
    expect((await api.app.inject({ method: 'GET', url: '/api/v1/runners/runs', headers: { authorization: `Bearer ${first.ssh.token}` } })).statusCode).toBe(401);

    // The first grant ended a while ago (longer than a command may run); the second is live.
    const idOf = async (token: string) => (await rows<{ id: string }>(sql`select id from workspace_ssh_grants where token_hash = ${hashSecret(token)}`))[0]!.id;
    const ended = await idOf(first.ssh.token);
    const live = await idOf(second.ssh.token);
    await api.db.database.db.execute(
      sql`update workspace_ssh_grants set expires_at = now() - ${(RUNNER_LIMITS.shellTimeoutSeconds + 60) * 1000}::double precision * interval '1 millisecond' where id = ${ended}`,
    );
    await unauthorized({ authorization: `Bearer ${first.ssh.token}` });
    const forks = join(shellForksRoot(api.dataDir), workspace.id);
    expect(existsSync(join(forks, ended))).toBe(true);
    expect(await expireWorkspaceShells({ db: api.db.database.db, dataDir: api.dataDir })).toEqual({ removed: 1 });
    expect(existsSync(join(forks, ended))).toBe(false);
    expect(existsSync(join(forks, `${ended}.lower`))).toBe(false);
    expect(existsSync(join(forks, live))).toBe(true);
    expect((await shell(second.ssh.token, { command: 'echo still here' })).json().stdout).toBe('still here\n');

    // A grant that only just expired keeps its fork: a command started before the end may still run.
    await api.db.database.db.execute(sql`update workspace_ssh_grants set expires_at = now() - interval '1 second' where id = ${live}`);
    await unauthorized({ authorization: `Bearer ${second.ssh.token}` });
    expect(await expireWorkspaceShells({ db: api.db.database.db, dataDir: api.dataDir })).toEqual({ removed: 0 });
    expect(existsSync(join(forks, live))).toBe(true);
  });

  it('offers the workspaces when several have the project, and gives setup guidance when none has all of it', async () => {
    const run = await localRun(['acme/web', 'acme/api']);
    const none = (await ask(run)).json();
    expect(none).toMatchObject({ ok: false, message: expect.stringContaining('acme/web, acme/api') });
    expect(none.markdown).toContain(`[[CLOUD_SETUP]]\ntaskId: ${run.taskId}\nrepositories: acme/web, acme/api\n[[/CLOUD_SETUP]]`);

    // One workspace has only part of the project: still guidance, naming what it lacks.
    const partial = await sharedWorkspace(run, ['acme/web']);
    expect((await ask(run)).json()).toMatchObject({ ok: false, markdown: expect.stringContaining('[[CLOUD_SETUP]]') });
    const picked = (await ask(run, { workspaceId: partial.id })).json();
    expect(picked).toMatchObject({ ok: false, message: expect.stringContaining('acme/api'), markdown: expect.stringContaining('repositories: acme/api\n') });

    const one = await sharedWorkspace(run, ['acme/web', 'acme/api']);
    expect((await ask(run)).json()).toMatchObject({ ok: true, workspaceId: one.id });
    const two = await sharedWorkspace(run, ['acme/api', 'acme/web']);
    const several = (await ask(run)).json();
    expect(several).toMatchObject({ ok: false, message: expect.stringContaining('workspaceId') });
    expect(several.choices.map((choice: { id: string }) => choice.id).sort()).toEqual([one.id, two.id].sort());
    expect((await ask(run, { workspaceId: two.id })).json()).toMatchObject({ ok: true, workspaceId: two.id });
    // A workspace that is not the person's is refused, whatever it has.
    const stranger = await api.newTenant();
    expect((await ask(run, { workspaceId: stranger.workspace.id })).json()).toEqual({ ok: false, message: expect.stringContaining('not one of yours') });
  });

  it('needs the current generation of an executing run of the calling runner', async () => {
    const run = await localRun();
    await sharedWorkspace(run, ['acme/web']);
    const stale = await ask(run, {}, run.generation + 1);
    expect(stale.statusCode).toBe(409);
    expect(stale.json().error.details).toEqual({ generation: run.generation });
    const other = await enrolledRunner(api, run.owner);
    expect((await other.request('POST', `/api/v1/runners/runs/${run.runId}/workspace-ssh`, { generation: run.generation, input: {} })).statusCode).toBe(404);
    await run.runner.request('POST', `/api/v1/runners/runs/${run.runId}/syncing`, { generation: run.generation });
    expect((await ask(run)).statusCode).toBe(409);
  });

  it('ends the grants of a revoked connection at once, on reconnecting too, and never takes a token of a revoked connection', async () => {
    const run = await localRun();
    const workspace = await sharedWorkspace(run, ['acme/web']);
    const { token } = (await ask(run)).json().ssh as { token: string };
    expect((await shell(token, { command: 'echo before' })).json().stdout).toBe('before\n');
    const grantId = (await rows<{ id: string }>(sql`select id from workspace_ssh_grants where token_hash = ${hashSecret(token)}`))[0]!.id;

    expect((await run.owner.request('POST', `/api/v1/runners/${run.runner.id}/revoke`)).statusCode).toBe(200);
    const refused = await shell(token, { command: 'echo after' });
    expect(refused.statusCode).toBe(401);
    expect(refused.json().error.code).toBe('unauthorized');
    const [revoked] = await rows<{ revoked: boolean }>(sql`select revoked_at is not null as revoked from workspace_ssh_grants where id = ${grantId}`);
    expect(revoked!.revoked).toBe(true);
    // A command already queued when the grant ended does not start.
    const shells = new WorkspaceShells({ db: api.db.database.db, environments: api.environments, dataDir: api.dataDir, policy: { hiddenPaths: [api.dataDir], allowUnsandboxed: false } });
    const [row] = await rows<{ id: string; user_id: string; workspace_id: string }>(sql`select id, user_id, workspace_id from workspace_ssh_grants where id = ${grantId}`);
    const grant = { id: row!.id, userId: row!.user_id, workspaceId: row!.workspace_id } as Parameters<WorkspaceShells['run']>[0];
    await expect(shells.run(grant, { command: 'echo queued', timeoutSeconds: 60 })).rejects.toMatchObject({ code: 'unauthorized' });

    // A grant a server before this rule left unrevoked still works nowhere while its connection is revoked...
    await api.db.database.db.execute(sql`update workspace_ssh_grants set revoked_at = null where id = ${grantId}`);
    expect(await findActiveSshGrant(api.db.database.db, hashSecret(token))).toBeNull();
    expect((await shell(token, { command: 'echo after' })).statusCode).toBe(401);
    // ...and reconnecting the connection ends it rather than bringing it back.
    const verifier = randomBytes(32).toString('base64url');
    const paired = await run.owner.request('POST', '/api/v1/runner-pairings', { challenge: challengeOf(verifier) });
    const reconnected = await api.app.inject({
      method: 'POST',
      url: '/api/v1/runners/enroll',
      payload: {
        pairingCode: paired.json().pairingCode,
        verifier,
        credential: generateRunnerCredential(),
        name: 'laptop',
        reconnect: { runnerId: run.runner.id, credential: run.runner.credential, stopped: true },
      },
    });
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    expect((await shell(token, { command: 'echo after' })).statusCode).toBe(401);

    // Its fork goes with the sweep once a command started before the end would have finished.
    await api.db.database.db.execute(
      sql`update workspace_ssh_grants set revoked_at = now() - ${(RUNNER_LIMITS.shellTimeoutSeconds + 60) * 1000}::double precision * interval '1 millisecond' where id = ${grantId}`,
    );
    expect(existsSync(join(shellForksRoot(api.dataDir), workspace.id, grantId))).toBe(true);
    expect(await expireWorkspaceShells({ db: api.db.database.db, dataDir: api.dataDir })).toEqual({ removed: 1 });
    expect(existsSync(join(shellForksRoot(api.dataDir), workspace.id, grantId))).toBe(false);
  });

  it(`grants a run at most ${SHELL_GRANTS_PER_RUN} live grants, and another once one has ended`, async () => {
    const run = await localRun();
    await sharedWorkspace(run, ['acme/web']);
    const tokens: string[] = [];
    for (let i = 0; i < SHELL_GRANTS_PER_RUN; i++) {
      const granted = (await ask(run)).json();
      expect(granted.ok).toBe(true);
      tokens.push(granted.ssh.token);
    }
    const refused = await ask(run);
    expect(refused.statusCode).toBe(200);
    expect(refused.json()).toEqual({ ok: false, message: expect.stringContaining(`already holds ${SHELL_GRANTS_PER_RUN} workspace shell grants`) });
    expect(await rows(sql`select id from workspace_ssh_grants where job_id = ${run.runId}`)).toHaveLength(SHELL_GRANTS_PER_RUN);

    await api.db.database.db.execute(sql`update workspace_ssh_grants set expires_at = now() - interval '1 second' where token_hash = ${hashSecret(tokens[0]!)}`);
    expect((await ask(run)).json().ok).toBe(true);
  });

  it(`runs one command of a grant at a time with at most ${SHELL_QUEUED_COMMANDS} waiting, and refuses more with 429 and Retry-After`, async () => {
    const run = await localRun();
    await sharedWorkspace(run, ['acme/web']);
    const { token } = (await ask(run)).json().ssh as { token: string };
    expect((await shell(token, { command: 'true' })).json().exitCode).toBe(0);

    // Each takes a second, far longer than the requests take to arrive: one of them finds no room.
    const answers = await Promise.all(Array.from({ length: SHELL_QUEUED_COMMANDS + 2 }, () => shell(token, { command: 'sleep 1; echo done' })));
    const refused = answers.filter((answer) => answer.statusCode === 429);
    expect(refused).toHaveLength(1);
    expect(refused[0]!.headers['retry-after']).toBe(String(SHELL_BUSY_RETRY_AFTER_SECONDS));
    expect(refused[0]!.json()).toEqual({
      error: { code: 'rate_limited', message: expect.stringContaining('already runs a command'), details: { retryAfterSeconds: SHELL_BUSY_RETRY_AFTER_SECONDS } },
    });
    for (const answer of answers.filter((candidate) => candidate.statusCode !== 429)) expect(answer.json()).toMatchObject({ exitCode: 0, stdout: 'done\n' });
    // Once they ended, the grant has room again.
    expect((await shell(token, { command: 'echo again' })).json().stdout).toBe('again\n');
  });

  async function rows<T>(query: ReturnType<typeof sql>): Promise<T[]> {
    const result = await api.db.database.db.execute(query);
    return (Array.isArray(result) ? result : (result as unknown as { rows: T[] }).rows) as T[];
  }
});

describe('command lanes', () => {
  /** Work that ends when the test says so, and records that it started. */
  function gate(started: string[], name: string) {
    let open!: () => void;
    let fail!: (error: Error) => void;
    const done = new Promise<string>((resolve, reject) => {
      open = () => resolve(name);
      fail = reject;
    });
    return { work: () => (started.push(name), done), open, fail };
  }
  const settle = () => new Promise((resolve) => setImmediate(resolve));

  it('runs one piece of work of a key at a time, in order, and refuses what finds no room', async () => {
    const lanes = new CommandLanes(2);
    const started: string[] = [];
    const [a, b, c, d] = ['a', 'b', 'c', 'd'].map((name) => gate(started, name));
    const running = [lanes.run('grant', a!.work), lanes.run('grant', b!.work), lanes.run('grant', c!.work)];
    expect(lanes.full('grant')).toBe(true);
    const refused = lanes.run('grant', d!.work);
    await expect(refused).rejects.toBeInstanceOf(AppError);
    await expect(refused).rejects.toMatchObject({ code: 'rate_limited', status: 429, headers: { 'retry-after': String(SHELL_BUSY_RETRY_AFTER_SECONDS) } });
    // Another key has a lane of its own.
    const other = gate(started, 'other');
    const elsewhere = lanes.run('another grant', other.work);
    await settle();
    expect(started).toEqual(['a', 'other']);

    // A failure ends its own work only; the next goes on, and room comes back as work ends.
    a!.fail(new Error('boom'));
    await expect(running[0]).rejects.toThrow('boom');
    await settle();
    expect(started).toEqual(['a', 'other', 'b']);
    expect(lanes.full('grant')).toBe(false);
    const e = gate(started, 'e');
    const later = lanes.run('grant', e.work);
    b!.open();
    c!.open();
    e.open();
    other.open();
    expect(await Promise.all([running[1], running[2], later, elsewhere])).toEqual(['b', 'c', 'e', 'other']);
    expect(started).toEqual(['a', 'other', 'b', 'c', 'e']);
    expect(lanes.full('grant')).toBe(false);
  });
});
