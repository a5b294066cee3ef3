/**
 * `svc runner` as a user runs it (the real CLI in child processes) and the pairing flow against a small
 * enrollment peer written here: projects registered without paths or credentials, one daemon per home,
 * one-line errors, status, pairing and reconnecting after a revocation.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { createHash, randomUUID } from 'node:crypto';
import { mkdirSync, mkdtempSync, statSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import type { EnrollBody, RunManifest } from '../src/protocol/runner.js';
import { RunnerHome } from '../src/runner/home.js';
import { RunnerLockedError, acquireRunnerLock, lockHolder } from '../src/runner/lock.js';
import { RunOutbox } from '../src/runner/outbox.js';
import { PairingError, pair } from '../src/runner/pair.js';
import { registrationOf } from '../src/runner/projects.js';
import { RunRecords, groupExists, type SignalGroup } from '../src/runner/run-state.js';
import { freePort, runSvc } from './support/processes.js';

const SPAWN_TIMEOUT_MS = 120_000;

const servers: Server[] = [];
afterEach(async () => {
  await Promise.all(servers.splice(0).map((server) => new Promise((resolve) => server.close(resolve))));
});

function tempDir(prefix: string): string {
  return mkdtempSync(join(tmpdir(), prefix));
}

function repository(dir: string, origin: string | null): string {
  mkdirSync(dir, { recursive: true });
  const git = (...args: string[]) => execFileSync('git', args, { cwd: dir, encoding: 'utf8' });
  git('init', '--quiet', '-b', 'trunk');
  git('config', 'user.email', 'dev@example.com');
  git('config', 'user.name', 'Dev');
  writeFileSync(join(dir, 'README.md'), '# hi\n');
  git('add', '.');
  git('commit', '--quiet', '-m', 'first');
  if (origin) git('remote', 'add', 'origin', origin);
  return dir;
}

const connection = (server: string) => ({
  server,
  runnerId: randomUUID(),
  userId: randomUUID(),
  workspaceId: randomUUID(),
  name: 'laptop',
  credential: `service_runner_${'d'.repeat(43)}`,
  heartbeatIntervalMs: 30_000,
  enrolledAt: new Date().toISOString(),
});

describe('svc runner project', () => {
  it('registers repositories by owner/repo and remote URL, never by path or credential, and keeps ids', async () => {
    const home = tempDir('svc-cli-home-');
    const folder = tempDir('svc-cli-projects-');
    repository(join(folder, 'widgets'), 'https://alice:ghp_secret@github.com/acme/widgets.git');
    repository(join(folder, 'scratch'), null);
    mkdirSync(join(folder, 'not-a-repo'));

    const added = await runSvc(['runner', 'project', 'add', folder, '--name', 'acme', '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect(added.stderr).toBe('');
    expect(added.code).toBe(0);
    expect(added.stdout).toMatch(/^Added project "acme" \([0-9a-f-]{36}\): local\/scratch \(trunk\), acme\/widgets \(trunk\)\.\n/);
    expect(statSync(home).mode & 0o777).toBe(0o700);
    expect(statSync(join(home, 'projects.json')).mode & 0o777).toBe(0o600);

    const projects = new RunnerHome(home).readProjects();
    const sent = projects.map(registrationOf);
    expect(sent).toEqual([
      {
        id: projects[0]!.id,
        name: 'acme',
        repositories: [
          { name: 'local/scratch', defaultBranch: 'trunk' },
          { name: 'acme/widgets', remoteUrl: 'https://github.com/acme/widgets.git', defaultBranch: 'trunk' },
        ],
      },
    ]);
    const text = JSON.stringify(sent);
    expect(text).not.toContain(folder);
    expect(text).not.toContain(tmpdir());
    expect(text).not.toContain('ghp_secret');
    expect(text).not.toContain('alice');

    const again = await runSvc(['runner', 'project', 'add', folder, '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect(again.code).toBe(0);
    expect(new RunnerHome(home).readProjects().map((project) => project.id)).toEqual([projects[0]!.id]);

    const listed = await runSvc(['runner', 'project', 'list', '--json', '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect((JSON.parse(listed.stdout) as Array<{ id: string }>).map((project) => project.id)).toEqual([projects[0]!.id]);
  });

  it('makes a folder without a repository the projectless environment only when asked, and says so in one line', async () => {
    const home = tempDir('svc-cli-home-');
    const empty = tempDir('svc-cli-empty-');
    const refused = await runSvc(['runner', 'project', 'add', empty, '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect(refused.code).toBe(1);
    expect(refused.stderr).toMatch(/^svc: .* holds no git repository .*; add --projectless to make it the projectless environment\n$/);
    const missing = await runSvc(['runner', 'project', 'add', join(empty, 'nope'), '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect([missing.code, missing.stderr]).toEqual([1, `svc: ${join(empty, 'nope')} does not exist\n`]);

    const made = await runSvc(['runner', 'project', 'add', empty, '--projectless', '--name', 'scratchpad', '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect(made.code).toBe(0);
    expect(new RunnerHome(home).readProjects().map(registrationOf)).toEqual([{ id: expect.any(String), name: 'scratchpad', repositories: [] }]);
  });
});

/** A run as the server hands it out; the fields that matter are set by each test. */
const manifestOf = (runId: string): RunManifest => ({
  runId, taskId: randomUUID(), taskSlug: 't', title: 't', state: 'queued', generation: 0, type: 'SWE', mode: 'agent', projectId: randomUUID(),
  harness: 'openai', model: 'gpt-5', effort: 'low', permissionMode: 'ask', nativeMode: null, input: 'x', metadata: null, history: [], sessionId: null,
  resumeParked: false, eventsStored: 0, createdAt: new Date().toISOString(),
});

describe('svc runner start and status', () => {
  it('refuses a second daemon for the same home in one line, and takes over a lock whose process is gone', async () => {
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    const unpaired = await runSvc(['runner', 'start', '--home', home.dir], {}, SPAWN_TIMEOUT_MS);
    expect([unpaired.code, unpaired.stderr]).toEqual([1, `svc: this computer is not paired (no connection in ${home.dir}); run: svc runner pair\n`]);

    home.writeConnection(connection(`http://127.0.0.1:${await freePort()}/api/v1`));
    const lock = acquireRunnerLock(home.lockFile, home.dir);
    try {
      const second = await runSvc(['runner', 'start', '--home', home.dir], {}, SPAWN_TIMEOUT_MS);
      expect(second.code).toBe(1);
      expect(second.stderr).toBe(`svc: another svc runner (pid ${process.pid}) is running for ${home.dir}; stop it first, or use another --home\n`);
      expect(() => acquireRunnerLock(home.lockFile, home.dir)).toThrow(RunnerLockedError);
    } finally {
      lock.release();
    }

    // A lock left by a process that is gone is taken over.
    const gone = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' });
    writeFileSync(home.lockFile, JSON.stringify({ pid: Number(gone.stdout), host: (await import('node:os')).hostname(), startedAt: new Date().toISOString() }));
    expect(lockHolder(home.lockFile)).toBeNull();
    const taken = acquireRunnerLock(home.lockFile, home.dir);
    expect(lockHolder(home.lockFile)).toBe(process.pid);
    taken.release();
  });

  it('shows the connection, an unreachable server, projects and the outbox backlog per run', async () => {
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    const paired = connection(`http://127.0.0.1:${await freePort()}/api/v1`);
    home.writeConnection(paired);
    const records = new RunRecords(home);
    const runId = randomUUID();
    const manifest: RunManifest = {
      runId, taskId: randomUUID(), taskSlug: 'fix-it', title: 'Fix it', state: 'executing', generation: 2, type: 'SWE', mode: 'agent',
      projectId: randomUUID(), harness: 'openai', model: 'gpt-5', effort: 'low', permissionMode: 'ask', nativeMode: null, input: 'Fix it',
      metadata: null, history: [], sessionId: null, resumeParked: false, eventsStored: 4, createdAt: new Date().toISOString(),
    };
    records.write({ manifest, phase: 'finished', outcome: { status: 'completed', finalAnswer: 'done' } });
    const outbox = await RunOutbox.open(records.dirOf(runId), 4);
    await outbox.append({ kind: 'message', data: { text: 'one' } });
    await outbox.append({ kind: 'final', data: { answer: 'done' } });
    await outbox.close();
    // A run folder the daemon moved aside because its state was damaged.
    const quarantined = join(home.quarantineDir, randomUUID());
    mkdirSync(quarantined, { recursive: true });

    const status = await runSvc(['runner', 'status', '--json', '--home', home.dir], {}, SPAWN_TIMEOUT_MS);
    expect(status.code).toBe(0);
    const parsed = JSON.parse(status.stdout) as Record<string, unknown>;
    expect(parsed).toMatchObject({
      connection: { server: paired.server, runnerId: paired.runnerId, workspaceId: paired.workspaceId, name: 'laptop' },
      identity: 'unreachable',
      daemonPid: null,
      runs: [{ runId, taskSlug: 'fix-it', generation: 2, phase: 'finished', outcome: 'completed', pendingEvents: 2 }],
    });
    expect(JSON.stringify(parsed)).not.toContain(paired.credential);
    const text = await runSvc(['runner', 'status', '--home', home.dir], {}, SPAWN_TIMEOUT_MS);
    expect(text.stdout).toContain('identity: unreachable');
    expect(text.stdout).toMatch(/fix-it\s+2\s+finished \(completed\)\s+2 event\(s\)/);
    expect(text.stdout).toContain(`Moved aside because their state was damaged (the runs were reported failed; remove them when done):\n  ${quarantined}\n`);
  });
});

/** Answers /identity and /enroll as the server would, recording what it was sent. */
async function enrollmentPeer(identity: { revoked: boolean } | null) {
  const runnerId = randomUUID();
  const enrollments: EnrollBody[] = [];
  const server = createServer(async (request, response) => {
    let text = '';
    for await (const chunk of request) text += chunk;
    const answer = (status: number, payload: unknown) => response.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(payload));
    if (request.url === '/api/v1/runners/identity') {
      if (!identity) return answer(401, { error: { code: 'unauthorized', message: 'Invalid or missing runner credential' } });
      return answer(200, { runnerId, workspaceId: randomUUID(), userId: randomUUID(), revoked: identity.revoked });
    }
    if (request.url === '/api/v1/runners/enroll') {
      const body = JSON.parse(text) as EnrollBody;
      enrollments.push(body);
      return answer(200, {
        runnerId: body.reconnect?.runnerId ?? runnerId,
        userId: randomUUID(),
        workspaceId: randomUUID(),
        name: body.name,
        enrolledAt: new Date().toISOString(),
        reconnected: body.reconnect !== undefined,
        finalizedRuns: [],
        heartbeatIntervalMs: 30_000,
      });
    }
    answer(404, { error: { code: 'not_found', message: 'no' } });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  servers.push(server);
  return { baseUrl: `http://127.0.0.1:${(server.address() as AddressInfo).port}/api/v1`, enrollments, runnerId };
}

describe('svc runner pair', () => {
  it('shows the link with the challenge of its verifier, enrolls with a credential of its own and keeps it private', async () => {
    const peer = await enrollmentPeer(null);
    const home = tempDir('svc-cli-home-');
    const paired = await runSvc(['runner', 'pair', '--server', peer.baseUrl, '--name', 'work laptop', '--code', 'ACDE-FGHK', '--home', home], {}, SPAWN_TIMEOUT_MS);
    expect(paired.stderr).toBe('');
    const lines = paired.stdout.split('\n');
    expect(lines[0]).toBe('Open this while signed in:');
    const link = new URL(lines[1]!);
    expect(`${link.origin}${link.pathname}`).toBe(`${new URL(peer.baseUrl).origin}/pair-runner`);
    expect(link.searchParams.get('name')).toBe('work laptop');
    expect(lines[2]).toMatch(new RegExp(`^Paired as runner ${peer.runnerId} \\("work laptop", workspace [0-9a-f-]{36}\\)\\.$`));

    const [body] = peer.enrollments;
    expect(body).toMatchObject({ pairingCode: 'ACDE-FGHK', name: 'work laptop', credential: expect.stringMatching(/^service_runner_[A-Za-z0-9_-]{43}$/) });
    expect(body!.verifier).toMatch(/^[A-Za-z0-9_-]{43}$/);
    expect(link.searchParams.get('challenge')).toBe(createHash('sha256').update(body!.verifier).digest('base64url'));
    expect(body!.reconnect).toBeUndefined();
    const stored = new RunnerHome(home).readConnection()!;
    expect(stored).toMatchObject({ server: peer.baseUrl, runnerId: peer.runnerId, credential: body!.credential });
    expect(statSync(join(home, 'connection.json')).mode & 0o777).toBe(0o600);
  });

  it('reconnects a revoked connection under the daemon lock with the old credential, keeping the runner id', async () => {
    const peer = await enrollmentPeer({ revoked: true });
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    const old = { ...connection(peer.baseUrl), runnerId: peer.runnerId };
    home.writeConnection(old);
    const records = new RunRecords(home);
    const runId = randomUUID();
    records.write({ manifest: { ...manifestOf(runId), state: 'executing', generation: 1 }, phase: 'executing' });
    const shown: string[] = [];
    const options = { home, server: peer.baseUrl, name: 'laptop', env: {}, show: (line: string) => shown.push(line), readCode: async () => 'ACDE-FGHK' };

    const lock = acquireRunnerLock(home.lockFile, home.dir);
    await expect(pair(options)).rejects.toThrow(RunnerLockedError);
    lock.release();
    expect(peer.enrollments).toEqual([]);

    const result = await pair(options);
    expect(result.reconnected).toBe(true);
    expect(peer.enrollments[0]!.reconnect).toEqual({ runnerId: peer.runnerId, credential: old.credential, stopped: true });
    const stored = home.readConnection()!;
    expect(stored.runnerId).toBe(peer.runnerId);
    expect(stored.credential).not.toBe(old.credential);
    expect(records.list()).toEqual([]);
    expect(lockHolder(home.lockFile)).toBeNull();
  });

  it('replaces a connection the server does not know under the daemon lock, stopping and dropping its runs', async () => {
    const peer = await enrollmentPeer(null);
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    const old = connection(peer.baseUrl);
    home.writeConnection(old);
    const records = new RunRecords(home);
    const runId = randomUUID();
    records.write({ manifest: { ...manifestOf(runId), state: 'executing', generation: 1 }, phase: 'executing' });
    // What a crashed daemon left running for that run, and a run folder whose record is damaged.
    const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    try {
      mkdirSync(records.groupsDirOf(runId), { recursive: true });
      writeFileSync(join(records.groupsDirOf(runId), 'left.pid'), `${leftover.pid}\n`);
      const damaged = randomUUID();
      mkdirSync(records.dirOf(damaged), { recursive: true });
      writeFileSync(join(records.dirOf(damaged), 'run.json'), '{"manifest":');
      const options = { home, server: peer.baseUrl, name: 'laptop', env: {}, show: () => undefined, readCode: async () => 'ACDE-FGHK' };

      const lock = acquireRunnerLock(home.lockFile, home.dir);
      await expect(pair(options)).rejects.toThrow(RunnerLockedError);
      lock.release();
      expect(peer.enrollments).toEqual([]);
      expect(groupExists(leftover.pid!)).toBe(true);

      const result = await pair(options);
      expect(result.reconnected).toBe(false);
      expect(peer.enrollments[0]!.reconnect).toBeUndefined();
      expect(home.readConnection()!.runnerId).toBe(peer.runnerId);
      expect(home.readConnection()!.credential).not.toBe(old.credential);
      expect(groupExists(leftover.pid!)).toBe(false);
      expect(records.runIds()).toEqual([]);
      expect(lockHolder(home.lockFile)).toBeNull();
    } finally {
      if (groupExists(leftover.pid!)) process.kill(-leftover.pid!, 'SIGKILL');
    }
  });

  it('refuses to pair, in one line, while a process group of a run it would drop survives its stop', async () => {
    const peer = await enrollmentPeer(null);
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    home.writeConnection(connection(peer.baseUrl));
    const records = new RunRecords(home);
    const runId = randomUUID();
    records.write({ manifest: { ...manifestOf(runId), state: 'executing', generation: 1 }, phase: 'executing' });
    const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    try {
      mkdirSync(records.groupsDirOf(runId), { recursive: true });
      writeFileSync(join(records.groupsDirOf(runId), 'left.pid'), `${leftover.pid}\n`);
      // A member that changed user: every signal to the group answers EPERM.
      const signal: SignalGroup = (pgid, sig) => {
        if (pgid === leftover.pid) throw Object.assign(new Error('kill EPERM'), { code: 'EPERM' });
        process.kill(-pgid, sig);
      };
      const shown: string[] = [];
      const options = { home, server: peer.baseUrl, name: 'laptop', env: {}, show: (line: string) => shown.push(line), readCode: async () => 'ACDE-FGHK', groups: { signal, stopTimeoutMs: 100 } };
      const error = await pair(options).catch((failure: unknown) => failure);
      expect(error).toBeInstanceOf(PairingError);
      expect((error as Error).message).toMatch(new RegExp(`^process group\\(s\\) ${leftover.pid} of run ${runId} still run after SIGKILL; pairing again drops that run`));
      expect((error as Error).message).not.toContain('\n');
      expect([shown, peer.enrollments]).toEqual([[], []]);
      expect(records.read(runId)?.phase).toBe('executing');
      expect(records.recordedGroups(runId)).toEqual([leftover.pid]);
    } finally {
      if (groupExists(leftover.pid!)) process.kill(-leftover.pid!, 'SIGKILL');
    }
  });

  it('refuses to pair over a connection that is still active', async () => {
    const peer = await enrollmentPeer({ revoked: false });
    const home = new RunnerHome(tempDir('svc-cli-home-')).ensure();
    home.writeConnection(connection(peer.baseUrl));
    await expect(pair({ home, server: peer.baseUrl, env: {}, show: () => undefined, readCode: async () => 'ACDE-FGHK' })).rejects.toThrow(/is paired already/);
    expect(peer.enrollments).toEqual([]);
  });
});
