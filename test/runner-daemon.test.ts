/**
 * The runner daemon end to end against a protocol peer written here (a small real HTTP server that
 * keeps runs, controls and journals the way docs/runner-protocol.md describes them; not the svc
 * server), with the real built-in loop against the fake model, real git worktrees and real files:
 * claim → execute (asking permissions) → syncing → events → receipt; a stop mid-run and the restart
 * that reports it; cancelled and deleted runs; a revoked connection.
 */
import { execFileSync, spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, renameSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import type { CompleteBody, Control, ControlMessage, RunManifest } from '../src/protocol/runner.js';
import { RunnerRevokedError } from '../src/runner/client.js';
import { DAMAGED_STATE, RunnerDaemon, STOPPED_WHILE_EXECUTING } from '../src/runner/daemon.js';
import { RunnerHome } from '../src/runner/home.js';
import { RunOutbox } from '../src/runner/outbox.js';
import { lockHolder } from '../src/runner/lock.js';
import type { Log } from '../src/runner/log.js';
import { addProject } from '../src/runner/projects.js';
import { RunRecords, groupExists, type GroupControl, type SignalGroup } from '../src/runner/run-state.js';
import { runnerStatus } from '../src/runner/status.js';
import { startFakeModel, type FakeModel, type ScriptedAnswer } from './support/fake-model.js';

interface PeerRun {
  manifest: RunManifest;
  journal: unknown[];
  controls: Control[];
  claims: number;
  receipt: CompleteBody | null;
  deleted: boolean;
}

interface PeerRequest {
  method: string;
  path: string;
  body: unknown;
}

/** The server side of the runner protocol, kept in memory. */
class ProtocolPeer {
  readonly runnerId = randomUUID();
  readonly workspaceId = randomUUID();
  readonly userId = randomUUID();
  readonly runs = new Map<string, PeerRun>();
  readonly requests: PeerRequest[] = [];
  readonly reviewAnswers = new Map<string, unknown>();
  readonly reviewRequests: Array<{ id: string; runId: string | null; taskId: string; path: string; createdAt: string }> = [];
  revoked = false;
  /** POST /events answers 503 while set. */
  eventsUnavailable = false;
  /** POST /events refuses every batch (409, nothing to resync) while set: no request waits to be retried. */
  eventsRefused = false;
  private version = 1;
  private listeners: Array<() => void> = [];
  private server: Server | null = null;
  baseUrl = '';

  addRun(fields: Partial<RunManifest> & Pick<RunManifest, 'projectId'>): RunManifest {
    const runId = randomUUID();
    const manifest: RunManifest = {
      runId,
      taskId: randomUUID(),
      taskSlug: `task-${runId.slice(0, 8)}`,
      title: 'Change the greeting',
      state: 'queued',
      generation: 0,
      type: 'SWE',
      mode: 'agent',
      harness: 'openai-compatible',
      model: 'fake-coder',
      effort: 'low',
      permissionMode: 'ask',
      nativeMode: null,
      input: 'Change the greeting',
      metadata: null,
      history: [],
      sessionId: null,
      resumeParked: false,
      eventsStored: 0,
      createdAt: new Date().toISOString(),
      ...fields,
    };
    this.runs.set(runId, { manifest, journal: [], controls: [], claims: 0, receipt: null, deleted: false });
    this.changed(true);
    return manifest;
  }

  control(runId: string, message: ControlMessage): void {
    const run = this.runs.get(runId)!;
    run.controls.push({ runId, sequence: run.controls.length + 1, message });
    this.changed(false);
  }

  cancel(runId: string): void {
    this.runs.get(runId)!.manifest.state = 'cancelled';
    this.changed(true);
  }

  delete(runId: string): void {
    this.runs.get(runId)!.deleted = true;
    this.changed(true);
  }

  askForFile(taskId: string, path: string): string {
    const id = randomUUID();
    this.reviewRequests.push({ id, runId: null, taskId, path, createdAt: new Date().toISOString() });
    this.changed(false);
    return id;
  }

  /** The journal's `permission` events of a run. */
  permissions(runId: string): Array<{ requestId: string; tool?: string; input?: unknown }> {
    return this.runs
      .get(runId)!
      .journal.filter((event) => (event as { kind: string }).kind === 'permission')
      .map((event) => (event as { data: { requestId: string; tool?: string; input?: unknown } }).data);
  }

  calls(runId: string): string[] {
    return this.requests.filter((request) => request.path.includes(runId)).map((request) => request.path.replace(`/runs/${runId}/`, ''));
  }

  private changed(work: boolean): void {
    if (work) this.version += 1;
    for (const listener of this.listeners.splice(0)) listener();
  }

  async start(): Promise<void> {
    this.server = createServer(async (request, response) => {
      let text = '';
      for await (const chunk of request) text += chunk;
      const path = (request.url ?? '').replace(/^\/api\/v1\/runners/, '');
      const body = text ? (JSON.parse(text) as unknown) : undefined;
      this.requests.push({ method: request.method ?? '', path, body });
      const answer = (status: number, payload: unknown) => response.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(payload));
      const refuse = (status: number, message: string, details?: unknown) => answer(status, { error: { code: status === 404 ? 'not_found' : 'conflict', message, ...(details ? { details } : {}) } });
      if (path === '/identity') return answer(200, { runnerId: this.runnerId, workspaceId: this.workspaceId, userId: this.userId, revoked: this.revoked });
      if (this.revoked) return answer(401, { error: { code: 'unauthorized', message: 'This runner connection was revoked; pair the computer again' } });
      if (path === '/heartbeat') {
        return answer(200, { runnerId: this.runnerId, workspaceId: this.workspaceId, version: String(this.version), heartbeatIntervalMs: 30_000, serverTime: new Date().toISOString() });
      }
      if (path === '/runs') return answer(200, { runs: this.listed(), version: String(this.version) });
      if (path === '/signals') return this.signals(body as { runs: Array<{ runId: string; after: number }>; version: string | null; waitMs: number }, answer);
      if (path === '/events' && this.eventsUnavailable) return answer(503, { error: { code: 'service_unavailable', message: 'Busy' } });
      if (path === '/events') return answer(200, { results: (body as { batches: Array<{ runId: string; generation: number; firstSequence: number; events: unknown[] }> }).batches.map((batch) => this.accept(batch)) });
      const review = /^\/review-requests\/([^/]+)$/.exec(path);
      if (review) {
        this.reviewAnswers.set(review[1]!, body);
        this.reviewRequests.splice(this.reviewRequests.findIndex((entry) => entry.id === review[1]), 1);
        return answer(200, { ok: true });
      }
      const match = /^\/runs\/([^/]+)\/(claim|syncing|complete)$/.exec(path);
      const run = match ? this.runs.get(match[1]!) : undefined;
      if (!match || !run || run.deleted) return refuse(404, 'Run not found');
      const { manifest } = run;
      const status = () => ({ runId: manifest.runId, state: manifest.state, status: manifest.state === 'completed' ? 'COMPLETED' : manifest.state === 'failed' ? 'FAILED' : manifest.state === 'cancelled' ? 'CANCELLED' : 'IN_PROGRESS', generation: manifest.generation });
      if (match[2] === 'claim') {
        if (manifest.state !== 'queued' && manifest.state !== 'executing') return refuse(409, `run is ${manifest.state}`);
        run.claims += 1;
        manifest.generation += 1;
        manifest.state = 'executing';
        manifest.eventsStored = run.journal.length;
        return answer(200, { run: manifest });
      }
      const named = (body as { generation: number }).generation;
      if (named !== manifest.generation) return refuse(409, 'generation is not current', { generation: manifest.generation });
      if (match[2] === 'syncing') {
        if (manifest.state === 'executing') manifest.state = 'syncing';
        return answer(200, status());
      }
      const receipt = body as CompleteBody;
      if (run.receipt) return answer(200, status());
      if (receipt.lastSequence !== run.journal.length) return refuse(409, 'events are missing', { expectedSequence: run.journal.length + 1 });
      run.receipt = receipt;
      if (manifest.state !== 'cancelled') manifest.state = receipt.outcome.status === 'failed' ? 'failed' : 'completed';
      this.changed(false);
      return answer(200, status());
    });
    await new Promise<void>((resolve) => this.server!.listen(0, '127.0.0.1', resolve));
    this.baseUrl = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}/api/v1`;
  }

  private listed(): RunManifest[] {
    return [...this.runs.values()]
      .filter((run) => !run.deleted && (['queued', 'executing', 'syncing'].includes(run.manifest.state) || (run.manifest.state === 'cancelled' && !run.receipt)))
      .map((run) => run.manifest);
  }

  private signals(body: { runs: Array<{ runId: string; after: number }>; version: string | null; waitMs: number }, answer: (status: number, payload: unknown) => void): void {
    const compute = (force: boolean) => {
      const controls = body.runs.flatMap(({ runId, after }) => this.runs.get(runId)?.controls.filter((control) => control.sequence > after) ?? []);
      const missing = body.runs.filter(({ runId }) => !this.runs.get(runId) || this.runs.get(runId)!.deleted).map(({ runId }) => runId);
      const changed = body.version !== String(this.version);
      if (!force && controls.length === 0 && missing.length === 0 && this.reviewRequests.length === 0 && !changed) return null;
      return { controls, missing, reviewRequests: [...this.reviewRequests], version: String(this.version) };
    };
    const now = compute(false);
    if (now) return answer(200, now);
    const timer = setTimeout(() => finish(), body.waitMs);
    const finish = () => {
      clearTimeout(timer);
      this.listeners = this.listeners.filter((listener) => listener !== finish);
      answer(200, compute(true));
    };
    this.listeners.push(finish);
  }

  private accept(batch: { runId: string; generation: number; firstSequence: number; events: unknown[] }) {
    const run = this.runs.get(batch.runId);
    if (!run || run.deleted) return { runId: batch.runId, error: { status: 404, message: 'Run not found' } };
    if (this.eventsRefused) return { runId: batch.runId, error: { status: 409, message: 'not now' } };
    if (batch.generation !== run.manifest.generation || !['executing', 'syncing', 'cancelled'].includes(run.manifest.state)) {
      return { runId: batch.runId, error: { status: 409, message: `run is ${run.manifest.state}` } };
    }
    if (batch.firstSequence !== run.journal.length + 1) {
      return { runId: batch.runId, error: { status: 409, message: 'sequence conflict', details: { expectedSequence: run.journal.length + 1 } } };
    }
    run.journal.push(...batch.events);
    this.changed(false);
    return { runId: batch.runId, acknowledgedSequence: run.journal.length };
  }

  close(): Promise<void> {
    for (const listener of this.listeners.splice(0)) listener();
    this.server?.closeAllConnections();
    return new Promise((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }
}

const cleanups: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
});

async function waitFor<T>(what: string, check: () => T | null | undefined | false, timeoutMs = 20_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/** A repository in a folder named `widgets` (its worktrees get that name too), with a GitHub origin. */
function gitRepository(): string {
  const dir = join(mkdtempSync(join(tmpdir(), 'svc-repo-')), 'widgets');
  mkdirSync(dir);
  const git = (...args: string[]) => execFileSync('git', args, { cwd: dir, encoding: 'utf8' });
  git('init', '--quiet', '-b', 'main');
  git('config', 'user.email', 'dev@example.com');
  git('config', 'user.name', 'Dev');
  writeFileSync(join(dir, 'greeting.txt'), 'hello\n');
  git('add', '.');
  git('commit', '--quiet', '-m', 'first');
  git('remote', 'add', 'origin', 'git@github.com:acme/widgets.git');
  return dir;
}

interface Setup {
  peer: ProtocolPeer;
  model: FakeModel;
  home: RunnerHome;
  repository: string;
  projectId: string;
  env: NodeJS.ProcessEnv;
  logs: string[];
  start(concurrency?: number, log?: Log): { daemon: RunnerDaemon; running: Promise<void> };
}

async function setup(script: ScriptedAnswer[], options: { groups?: GroupControl } = {}): Promise<Setup> {
  const peer = new ProtocolPeer();
  await peer.start();
  cleanups.push(() => peer.close());
  const model = await startFakeModel(script);
  cleanups.push(() => model.close());
  const home = new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-runner-home-'))).ensure();
  home.writeConnection({
    server: peer.baseUrl,
    runnerId: peer.runnerId,
    userId: peer.userId,
    workspaceId: peer.workspaceId,
    name: 'laptop',
    credential: `service_runner_${'c'.repeat(43)}`,
    heartbeatIntervalMs: 30_000,
    enrolledAt: new Date().toISOString(),
  });
  const repository = gitRepository();
  const project = await addProject(home, repository, { name: 'widgets' });
  const env = {
    PATH: process.env.PATH,
    HOME: process.env.HOME,
    OPENAI_COMPATIBLE_BASE_URL: model.baseUrl,
    OPENAI_COMPATIBLE_API_KEY: 'test',
    SVC_CLAUDE_CODE_COMMAND: '/nonexistent/claude',
    SVC_CODEX_COMMAND: '/nonexistent/codex',
  };
  const logs: string[] = [];
  return {
    peer,
    model,
    home,
    repository,
    projectId: project.id,
    env,
    logs,
    start(concurrency = 2, log: Log = (line) => logs.push(line)) {
      // Backoff waits stay short (a tenth of each ceiling) so that retries happen within the test.
      const daemon = new RunnerDaemon({ home, concurrency, env, log, client: { random: () => 0.1 }, ...(options.groups ? { groups: options.groups } : {}) });
      const running = daemon.run();
      cleanups.push(async () => {
        daemon.stop();
        await running.catch(() => undefined);
      });
      return { daemon, running };
    },
  };
}

describe('the runner daemon against a protocol peer', () => {
  it('claims a run, executes it in a worktree asking for permissions, delivers its events and completes it', async () => {
    const s = await setup([
      { toolCalls: [{ name: 'write_file', arguments: { path: 'widgets/greeting.txt', content: 'hello, world\n' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'touch ran.txt' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Greeting changed.' } }] },
    ]);
    const run = s.peer.addRun({ projectId: s.projectId });
    const { daemon, running } = s.start();

    const write = await waitFor('the write permission', () => s.peer.permissions(run.runId)[0]);
    expect(write).toMatchObject({ tool: 'write_file', input: { path: 'widgets/greeting.txt', content: 'hello, world\n' } });
    s.peer.control(run.runId, { type: 'permission', requestId: write.requestId, decision: 'allow' });
    const command = await waitFor('the command permission', () => s.peer.permissions(run.runId)[1]);
    expect(command).toMatchObject({ tool: 'run_command', input: { command: 'touch ran.txt' } });
    s.peer.control(run.runId, { type: 'permission', requestId: command.requestId, decision: 'deny' });
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);

    const peerRun = s.peer.runs.get(run.runId)!;
    expect(receipt).toEqual({ generation: 1, lastSequence: peerRun.journal.length, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Greeting changed.' } });
    expect(peerRun.claims).toBe(1);
    const calls = s.peer.calls(run.runId);
    expect(calls.filter((call) => ['claim', 'syncing', 'complete'].includes(call))).toEqual(['claim', 'syncing', 'complete']);
    const kinds = peerRun.journal.map((event) => (event as { kind: string }).kind);
    expect(kinds.filter((kind) => kind === 'permission')).toHaveLength(2);
    expect(kinds).toContain('final');
    const results = peerRun.journal.filter((event) => (event as { kind: string }).kind === 'tool_result').map((event) => (event as { data: { name: string; output: string } }).data);
    expect(results.map((result) => [result.name, result.output])).toEqual([
      ['write_file', 'wrote 13 bytes to widgets/greeting.txt'],
      ['run_command', 'denied by the user'],
      ['finish', 'Done.'],
    ]);

    // The run worked in its own worktree on its own branch; the user's checkout is untouched.
    const worktree = join(s.home.taskDir(run.taskId), 'widgets');
    expect(readFileSync(join(worktree, 'greeting.txt'), 'utf8')).toBe('hello, world\n');
    expect(execFileSync('git', ['branch', '--show-current'], { cwd: worktree, encoding: 'utf8' }).trim()).toBe(`svc/${run.taskSlug}`);
    expect(readFileSync(join(s.repository, 'greeting.txt'), 'utf8')).toBe('hello\n');
    expect(existsSync(join(s.home.taskDir(run.taskId), 'ran.txt'))).toBe(false);
    // Delivered and reported: nothing of the run is left but its folder.
    await waitFor('the run to be forgotten', () => !existsSync(s.home.runDir(run.runId)));

    // The registration carried discovered models and no path of this computer.
    const heartbeat = s.peer.requests.find((request) => request.path === '/heartbeat')!.body as { capabilities: { models: Record<string, unknown>; modelSource: string; nativeControls: Record<string, unknown> }; projects: unknown[] };
    expect(heartbeat.capabilities.models).toEqual({ 'openai-compatible': [{ id: 'fake-coder', name: 'fake-coder' }] });
    expect(heartbeat.capabilities.modelSource).toBe('discovered');
    expect(heartbeat.capabilities.nativeControls['openai-compatible']).toEqual({ commands: ['permission'], fullAccess: true, questions: true });
    expect(heartbeat.projects).toEqual([{ id: s.projectId, name: 'widgets', repositories: [{ name: 'acme/widgets', remoteUrl: 'git@github.com:acme/widgets.git', defaultBranch: 'main' }] }]);
    expect(JSON.stringify(heartbeat)).not.toContain(s.repository);
    expect(JSON.stringify(heartbeat)).not.toContain(tmpdir());

    // A browser asks to see a file of the task: the daemon answers from the worktree.
    const review = s.peer.askForFile(run.taskId, 'widgets/greeting.txt');
    const answered = await waitFor('the review answer', () => s.peer.reviewAnswers.get(review));
    expect(answered).toEqual({ status: 'ok', content: Buffer.from('hello, world\n').toString('base64') });

    daemon.stop();
    await running;
    expect(lockHolder(s.home.lockFile)).toBeNull();
  });

  it('after a stop mid-run, the next start stops what was left, delivers the events and reports the run failed, without running it again', async () => {
    const s = await setup([{ toolCalls: [{ name: 'run_command', arguments: { command: 'echo never' } }] }]);
    const run = s.peer.addRun({ projectId: s.projectId });
    const first = s.start();
    await waitFor('the permission', () => s.peer.permissions(run.runId)[0]);
    first.daemon.stop();
    await first.running;
    const records = new RunRecords(s.home);
    expect(records.read(run.runId)?.phase).toBe('executing');
    expect(s.peer.runs.get(run.runId)!.manifest.state).toBe('executing');

    // A process group the run left running (as a daemon that crashed would leave it).
    const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    cleanups.push(() => groupExists(leftover.pid!) && process.kill(-leftover.pid!, 'SIGKILL'));
    mkdirSync(records.groupsDirOf(run.runId), { recursive: true });
    writeFileSync(join(records.groupsDirOf(run.runId), 'left.pid'), `${leftover.pid}\n`);
    const modelCalls = s.model.requests.length;

    s.start();
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'failed', error: STOPPED_WHILE_EXECUTING });
    const journal = s.peer.runs.get(run.runId)!.journal;
    expect(receipt.lastSequence).toBe(journal.length);
    expect(journal.at(-1)).toEqual({ kind: 'error', data: { message: STOPPED_WHILE_EXECUTING } });
    expect(s.peer.runs.get(run.runId)!.claims).toBe(1);
    expect(s.model.requests.length).toBe(modelCalls);
    expect(groupExists(leftover.pid!)).toBe(false);
  });

  it('keeps a finished run whose events cannot be delivered across a stop, and reports it once the server takes them', async () => {
    const s = await setup([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Nothing to change.' } }] }]);
    s.peer.eventsUnavailable = true;
    const run = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    const first = s.start();
    const records = new RunRecords(s.home);
    await waitFor('the run to be syncing', () => records.read(run.runId)?.phase === 'synced' && s.peer.requests.filter((request) => request.path === '/events').length >= 2);
    first.daemon.stop();
    await first.running;
    expect(records.read(run.runId)).toMatchObject({ phase: 'synced', outcome: { status: 'completed', finalAnswer: 'Nothing to change.' } });
    const backlog = RunOutbox.inspect(records.dirOf(run.runId));
    expect(backlog.entries).toBeGreaterThan(0);
    expect(s.peer.runs.get(run.runId)!.receipt).toBeNull();

    s.peer.eventsUnavailable = false;
    s.start();
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);
    expect(receipt).toMatchObject({ lastSequence: backlog.lastSequence, outcome: { status: 'completed', finalAnswer: 'Nothing to change.' } });
    expect(s.peer.runs.get(run.runId)!.journal).toHaveLength(backlog.lastSequence);
    expect(s.peer.runs.get(run.runId)!.claims).toBe(1);
    expect(s.model.requests).toHaveLength(1);
  });

  it('moves a run whose state here is damaged aside, reports it failed without running it, and goes on with the others', async () => {
    const s = await setup([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] }]);
    const records = new RunRecords(s.home);
    /** A run this runner claimed in an earlier life. */
    const claimed = () => {
      const manifest = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
      Object.assign(s.peer.runs.get(manifest.runId)!, { claims: 1 });
      Object.assign(s.peer.runs.get(manifest.runId)!.manifest, { state: 'executing', generation: 1 });
      return s.peer.runs.get(manifest.runId)!.manifest;
    };
    // Its record is cut short, and a process it started still runs.
    const brokenRecord = claimed();
    mkdirSync(records.dirOf(brokenRecord.runId), { recursive: true });
    writeFileSync(join(records.dirOf(brokenRecord.runId), 'run.json'), '{"manifest":{"runId":');
    const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    cleanups.push(() => groupExists(leftover.pid!) && process.kill(-leftover.pid!, 'SIGKILL'));
    mkdirSync(records.groupsDirOf(brokenRecord.runId), { recursive: true });
    writeFileSync(join(records.groupsDirOf(brokenRecord.runId), 'left.pid'), `${leftover.pid}\n`);
    // Its record is whole but its outbox has a damaged line before others.
    const brokenOutbox = claimed();
    records.write({ manifest: brokenOutbox, phase: 'finished', outcome: { status: 'completed', finalAnswer: 'Done.' } });
    writeFileSync(join(records.dirOf(brokenOutbox.runId), 'events.jsonl'), `not an entry\n${JSON.stringify({ sequence: 2, event: { kind: 'message', data: { text: 'x' } } })}\n`);
    const queued = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });

    // `svc runner status` shows both as they are, and does not fail.
    const before = await runnerStatus(s.home, { timeoutMs: 1_000 });
    expect(before.runs.filter((run) => run.problem).map((run) => run.runId).sort()).toEqual([brokenRecord.runId, brokenOutbox.runId].sort());

    s.start();
    for (const run of [brokenRecord, brokenOutbox]) {
      const receipt = await waitFor(`the receipt of ${run.runId}`, () => s.peer.runs.get(run.runId)!.receipt);
      expect(receipt.outcome).toEqual({ status: 'failed', error: expect.stringMatching(/^the runner's state of this run was damaged/) });
      expect(s.peer.runs.get(run.runId)!.claims).toBe(1);
      expect(s.peer.runs.get(run.runId)!.journal.at(-1)).toEqual({ kind: 'error', data: { message: receipt.outcome.error } });
    }
    expect(await waitFor('the queued run to complete', () => s.peer.runs.get(queued.runId)!.receipt)).toMatchObject({ outcome: { status: 'completed' } });
    expect(s.model.requests).toHaveLength(1);
    expect(groupExists(leftover.pid!)).toBe(false);

    // Moved aside as they were, for the user to look at; the log says where.
    const quarantined = join(s.home.dir, 'quarantine');
    expect(readFileSync(join(quarantined, brokenRecord.runId, 'run.json'), 'utf8')).toBe('{"manifest":{"runId":');
    expect(readFileSync(join(quarantined, brokenOutbox.runId, 'events.jsonl'), 'utf8')).toMatch(/^not an entry\n/);
    for (const run of [brokenRecord, brokenOutbox]) {
      expect(s.logs.some((line) => line.includes(run.runId) && line.includes(join(quarantined, run.runId)))).toBe(true);
    }
    await waitFor('the runs to be forgotten', () => !existsSync(records.dirOf(brokenRecord.runId)) && !existsSync(records.dirOf(brokenOutbox.runId)));
    const after = await runnerStatus(s.home, { timeoutMs: 1_000 });
    expect(after.quarantined.map((entry) => entry.runId).sort()).toEqual([brokenRecord.runId, brokenOutbox.runId].sort());
  });

  it('reports a run quarantined after its execution from its fresh outbox, not the one it moved aside', async () => {
    const s = await setup([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] }]);
    // The end of the execution cannot be handled (a fault injected once): the run is quarantined while its
    // outbox is open and uploading; the server refuses its events meanwhile.
    const afterExecution = vi.spyOn(RunnerDaemon.prototype as unknown as { afterExecution: () => void }, 'afterExecution').mockImplementationOnce(() => {
      throw new Error('injected: the end of the run cannot be handled');
    });
    cleanups.push(() => afterExecution.mockRestore());
    s.peer.eventsRefused = true;
    const run = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    s.start();
    const moved = join(s.home.dir, 'quarantine', run.runId);
    await waitFor('the run to be moved aside', () => existsSync(moved) && s.logs.some((line) => line.includes(`run ${run.runId}: its end could not be handled`)));
    expect(RunOutbox.inspect(moved).entries).toBeGreaterThan(0);

    s.peer.eventsRefused = false;
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'failed', error: DAMAGED_STATE });
    // Only the fresh outbox was uploaded: its error event, and the receipt names its last sequence.
    expect(s.peer.runs.get(run.runId)!.journal).toEqual([{ kind: 'error', data: { message: DAMAGED_STATE } }]);
    expect(receipt.lastSequence).toBe(1);
    expect(s.peer.runs.get(run.runId)!.claims).toBe(1);
    // The events it moved aside stay there, untouched by the upload.
    expect(RunOutbox.inspect(moved).entries).toBeGreaterThan(0);
  });

  it('reports no run whose process groups could not be stopped, and reports it once a later pass stops them', async () => {
    const s = await setup([]);
    const records = new RunRecords(s.home);
    const scratch = mkdtempSync(join(tmpdir(), 'svc-groups-'));
    writeFileSync(join(scratch, 'not-a-folder'), '');
    const claimed = () => {
      const manifest = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
      Object.assign(s.peer.runs.get(manifest.runId)!, { claims: 1 });
      Object.assign(s.peer.runs.get(manifest.runId)!.manifest, { state: 'executing', generation: 1 });
      return s.peer.runs.get(manifest.runId)!.manifest;
    };
    /** A process the run left running, recorded where the stop cannot read it (its groups/ is no folder). */
    const unstoppable = (runId: string) => {
      const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
      cleanups.push(() => groupExists(leftover.pid!) && process.kill(-leftover.pid!, 'SIGKILL'));
      symlinkSync(join(scratch, 'not-a-folder'), records.groupsDirOf(runId));
      return leftover;
    };
    /** The record becomes readable: swapped in at once, so no pass sees an empty folder. */
    const readable = (runId: string, pid: number) => {
      const groups = join(scratch, runId);
      mkdirSync(groups);
      writeFileSync(join(groups, 'left.pid'), `${pid}\n`);
      symlinkSync(groups, `${records.groupsDirOf(runId)}.next`);
      renameSync(`${records.groupsDirOf(runId)}.next`, records.groupsDirOf(runId));
    };
    const executing = claimed();
    records.write({ manifest: executing, phase: 'executing' });
    const executingLeftover = unstoppable(executing.runId);
    const damaged = claimed();
    mkdirSync(records.dirOf(damaged.runId), { recursive: true });
    writeFileSync(join(records.dirOf(damaged.runId), 'run.json'), '{"manifest":');
    const damagedLeftover = unstoppable(damaged.runId);

    s.start();
    for (const run of [executing, damaged]) {
      await waitFor(`the log about ${run.runId}`, () => s.logs.find((line) => line.startsWith(`run ${run.runId}: not taken over: its process groups could not be stopped`)));
    }
    // Left as they are while what they started runs: not reported, not moved aside, not claimed again.
    for (const run of [executing, damaged]) {
      expect(s.peer.runs.get(run.runId)!.receipt).toBeNull();
      expect(s.peer.calls(run.runId)).toEqual([]);
      expect(existsSync(records.dirOf(run.runId))).toBe(true);
    }
    expect(existsSync(join(s.home.dir, 'quarantine'))).toBe(false);
    expect(groupExists(executingLeftover.pid!) && groupExists(damagedLeftover.pid!)).toBe(true);

    readable(executing.runId, executingLeftover.pid!);
    readable(damaged.runId, damagedLeftover.pid!);
    const executingReceipt = await waitFor('the receipt of the executing run', () => s.peer.runs.get(executing.runId)!.receipt);
    expect(executingReceipt.outcome).toEqual({ status: 'failed', error: STOPPED_WHILE_EXECUTING });
    const damagedReceipt = await waitFor('the receipt of the damaged run', () => s.peer.runs.get(damaged.runId)!.receipt);
    expect(damagedReceipt.outcome).toEqual({ status: 'failed', error: DAMAGED_STATE });
    expect(groupExists(executingLeftover.pid!)).toBe(false);
    expect(groupExists(damagedLeftover.pid!)).toBe(false);
    expect(s.peer.runs.get(executing.runId)!.claims).toBe(1);
    expect(s.peer.runs.get(damaged.runId)!.claims).toBe(1);
  });

  it('reports no run while a process group it left survives its stop, keeps that group\'s record, and reports the run once the group is gone', async () => {
    const leftover = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    cleanups.push(() => groupExists(leftover.pid!) && process.kill(-leftover.pid!, 'SIGKILL'));
    // A member of the group that changed user: every signal to the group answers EPERM, so it cannot be
    // killed and still exists.
    let survives = true;
    const signal: SignalGroup = (pgid, sig) => {
      if (survives && pgid === leftover.pid) throw Object.assign(new Error('kill EPERM'), { code: 'EPERM' });
      process.kill(-pgid, sig);
    };
    const s = await setup([], { groups: { signal, stopTimeoutMs: 100 } });
    const records = new RunRecords(s.home);
    const manifest = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    Object.assign(s.peer.runs.get(manifest.runId)!, { claims: 1 });
    Object.assign(s.peer.runs.get(manifest.runId)!.manifest, { state: 'executing', generation: 1 });
    const run = s.peer.runs.get(manifest.runId)!.manifest;
    records.write({ manifest: run, phase: 'executing' });
    mkdirSync(records.groupsDirOf(run.runId), { recursive: true });
    const groupFile = join(records.groupsDirOf(run.runId), 'left.pid');
    writeFileSync(groupFile, `${leftover.pid}\n`);

    s.start();
    await waitFor('a second pass over the run', () => s.logs.filter((line) => line.includes(`run ${run.runId}`) && line.includes('still run after SIGKILL')).length >= 1 && s.peer.requests.filter((request) => request.path === '/runs').length >= 2);
    expect(s.logs.find((line) => line.startsWith(`run ${run.runId}: not taken over: its process groups could not be stopped`))).toBeDefined();
    expect(s.peer.runs.get(run.runId)!.receipt).toBeNull();
    expect(s.peer.calls(run.runId)).toEqual([]);
    expect(records.read(run.runId)?.phase).toBe('executing');
    expect(readFileSync(groupFile, 'utf8')).toBe(`${leftover.pid}\n`);
    expect(existsSync(join(s.home.dir, 'quarantine'))).toBe(false);

    survives = false;
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'failed', error: STOPPED_WHILE_EXECUTING });
    expect(groupExists(leftover.pid!)).toBe(false);
    expect(s.peer.runs.get(run.runId)!.claims).toBe(1);
  });

  it('quarantines no freshly claimed run whose outbox cannot be opened for a reason other than damage: it is claimed again later', async () => {
    const s = await setup([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] }]);
    const run = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    // Opening its outbox fails (EISDIR), as a full disk or too many open files would.
    mkdirSync(join(s.home.runDir(run.runId), 'events.jsonl'), { recursive: true });
    s.start();
    await waitFor('the log', () => s.logs.find((line) => line.startsWith(`run ${run.runId}: its state here could not be set up`)));
    expect(s.peer.runs.get(run.runId)!.receipt).toBeNull();
    expect(existsSync(join(s.home.dir, 'quarantine'))).toBe(false);

    rmSync(join(s.home.runDir(run.runId), 'events.jsonl'), { recursive: true });
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(run.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'completed', finalAnswer: 'Done.' });
    expect(s.peer.runs.get(run.runId)!.claims).toBeGreaterThanOrEqual(2);
    expect(s.model.requests).toHaveLength(1);
    expect(existsSync(join(s.home.dir, 'quarantine'))).toBe(false);
  });

  it('goes on with the listing when a run\'s record cannot be written (a full disk), and sets that run up on a later pass', async () => {
    const done = { toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] };
    const s = await setup([done, done]);
    // Claimed here in an earlier life, its record lost: adopted to report it.
    const lost = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    Object.assign(s.peer.runs.get(lost.runId)!, { claims: 1 });
    Object.assign(s.peer.runs.get(lost.runId)!.manifest, { state: 'syncing', generation: 1 });
    const queued = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    const later = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    // The first write of each run's record fails as a full disk would.
    const failing = new Set([lost.runId, queued.runId]);
    const write = RunRecords.prototype.write;
    const spy = vi.spyOn(RunRecords.prototype, 'write').mockImplementation(function (this: RunRecords, record) {
      if (failing.delete(record.manifest.runId)) throw Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });
      return write.call(this, record);
    });
    cleanups.push(() => spy.mockRestore());

    s.start(3);
    await waitFor('the logs', () =>
      s.logs.find((line) => line.startsWith(`run ${lost.runId}: its state here could not be set up to report it: ENOSPC`)) &&
      s.logs.find((line) => line.startsWith(`run ${queued.runId}: its state here could not be set up: ENOSPC`)),
    );
    // The listing went on past both: nothing failed the whole pass.
    expect(s.logs.filter((line) => line.startsWith('signals:'))).toEqual([]);
    expect(await waitFor('the later run\'s receipt', () => s.peer.runs.get(later.runId)!.receipt)).toMatchObject({ outcome: { status: 'completed' } });
    expect(await waitFor('the queued run\'s receipt', () => s.peer.runs.get(queued.runId)!.receipt)).toMatchObject({ outcome: { status: 'completed' } });
    expect(await waitFor('the lost run\'s receipt', () => s.peer.runs.get(lost.runId)!.receipt)).toMatchObject({ outcome: { status: 'failed', error: 'the runner lost the state of this run' } });
    expect(s.logs.filter((line) => line.startsWith('signals:'))).toEqual([]);
  });

  it('never moves a run aside twice: one whose fresh state is damaged too is left alone', async () => {
    const s = await setup([{ toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] }]);
    const manifest = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    Object.assign(s.peer.runs.get(manifest.runId)!, { claims: 1 });
    Object.assign(s.peer.runs.get(manifest.runId)!.manifest, { state: 'executing', generation: 1 });
    // Moved aside in an earlier life; what stands where its fresh outbox goes is damaged.
    const quarantine = join(s.home.dir, 'quarantine');
    mkdirSync(join(quarantine, manifest.runId), { recursive: true });
    mkdirSync(s.home.runDir(manifest.runId), { recursive: true });
    writeFileSync(join(s.home.runDir(manifest.runId), 'events.jsonl'), `not an entry\n${JSON.stringify({ sequence: 2, event: { kind: 'message', data: { text: 'x' } } })}\n`);
    s.start();
    await waitFor('the log', () => s.logs.find((line) => line.startsWith(`run ${manifest.runId}: the outbox`) && line.includes('it was moved aside before')));

    // Later listings leave it alone: the next run is claimed and reported, and nothing more was moved.
    const next = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    await waitFor('the next receipt', () => s.peer.runs.get(next.runId)!.receipt);
    expect(readdirSync(quarantine)).toEqual([manifest.runId]);
    expect(readFileSync(join(s.home.runDir(manifest.runId), 'events.jsonl'), 'utf8')).toMatch(/^not an entry\n/);
    expect(s.peer.runs.get(manifest.runId)!.receipt).toBeNull();
  });

  it('goes on when its log fails: a run is still delivered and reported, a deleted one still dropped, and nothing is left unhandled', async () => {
    const s = await setup([
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo two' } }] },
    ]);
    const unhandled: unknown[] = [];
    const onUnhandled = (reason: unknown) => unhandled.push(reason);
    process.on('unhandledRejection', onUnhandled);
    cleanups.push(() => process.off('unhandledRejection', onUnhandled));
    const failingLog: Log = (line) => {
      s.logs.push(line);
      throw new Error('EPIPE: the log is gone');
    };
    const finished = s.peer.addRun({ projectId: s.projectId, permissionMode: 'full' });
    s.start(2, failingLog);
    const receipt = await waitFor('the completion receipt', () => s.peer.runs.get(finished.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'completed', finalAnswer: 'Done.' });

    const deleted = s.peer.addRun({ projectId: s.projectId });
    await waitFor('the permission', () => s.peer.permissions(deleted.runId)[0]);
    s.peer.delete(deleted.runId);
    await waitFor('the deleted run to be forgotten', () => !existsSync(s.home.runDir(deleted.runId)) && !existsSync(s.home.runDir(finished.runId)));
    expect(s.peer.runs.get(finished.runId)!.claims).toBe(1);
    expect(s.logs.some((line) => line.includes(`run ${finished.runId}: completed; delivering`))).toBe(true);
    expect(unhandled).toEqual([]);
  });

  it('stops a cancelled run and reports it cancelled; drops a deleted one without a receipt', async () => {
    const s = await setup([
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo one' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo two' } }] },
    ]);
    const cancelled = s.peer.addRun({ projectId: s.projectId });
    const deleted = s.peer.addRun({ projectId: s.projectId });
    s.start(2);
    await waitFor('both permissions', () => s.peer.permissions(cancelled.runId)[0] && s.peer.permissions(deleted.runId)[0]);

    s.peer.cancel(cancelled.runId);
    const receipt = await waitFor('the cancelled receipt', () => s.peer.runs.get(cancelled.runId)!.receipt);
    expect(receipt.outcome).toEqual({ status: 'cancelled' });
    expect(s.peer.calls(cancelled.runId)).toContain('syncing');

    s.peer.delete(deleted.runId);
    await waitFor('the deleted run to be forgotten', () => !existsSync(s.home.runDir(deleted.runId)));
    expect(s.peer.calls(deleted.runId).filter((call) => call === 'complete')).toEqual([]);
  });

  it('runs one run of a task at a time and at most --concurrency runs', async () => {
    const s = await setup([
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo a' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo b' } }] },
    ]);
    const first = s.peer.addRun({ projectId: s.projectId });
    const sameTask = s.peer.addRun({ projectId: s.projectId, taskId: first.taskId, taskSlug: first.taskSlug });
    const other = s.peer.addRun({ projectId: s.projectId });
    const third = s.peer.addRun({ projectId: s.projectId });
    s.start(2);
    await waitFor('two permissions', () => s.peer.permissions(first.runId)[0] && s.peer.permissions(other.runId)[0]);
    expect(s.peer.runs.get(sameTask.runId)!.claims).toBe(0);
    expect(s.peer.runs.get(third.runId)!.claims).toBe(0);
  });

  it('stops its runs and ends with a message to pair again when the connection is revoked', async () => {
    const s = await setup([{ toolCalls: [{ name: 'run_command', arguments: { command: 'echo x' } }] }]);
    const run = s.peer.addRun({ projectId: s.projectId });
    const { running } = s.start();
    await waitFor('the permission', () => s.peer.permissions(run.runId)[0]);
    s.peer.revoked = true;
    // Anything the daemon sends now gets 401: the next heartbeat or signals request finds out.
    s.peer.control(run.runId, { type: 'permission', requestId: 'nothing-waits-for-this', decision: 'deny' });
    const error = await running.catch((caught: unknown) => caught);
    expect(error).toBeInstanceOf(RunnerRevokedError);
    expect((error as Error).message).toBe('this runner connection was revoked; its runs were stopped. Pair this computer again: svc runner pair');
    expect(lockHolder(s.home.lockFile)).toBeNull();
    // Its outbox is kept for the reconnect to settle.
    expect(new RunRecords(s.home).read(run.runId)?.phase).toBe('executing');
  });
});
