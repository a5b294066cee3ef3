/**
 * Helpers for tests that run the real runner (`RunnerDaemon`, or `svc runner start` in a child process)
 * against the real server over HTTP: a repository to register, the runner's environment for the fake
 * model, pairing through the signed-in owner, and the owner's view of a task, its requests and journal.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { expect } from 'vitest';
import type { RunnerHome } from '../../src/runner/home.js';
import { pair, type PairOptions } from '../../src/runner/pair.js';
import type { SignedIn } from './runners.js';

/** Polls `check` until it answers something truthy; bounded by `timeoutMs`. */
export async function waitFor<T>(what: string, check: () => Promise<T | null | undefined | false>, timeoutMs = 30_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** A repository in a folder named `widgets`, with a GitHub origin. */
export function widgetsRepository(): string {
  const repository = join(mkdtempSync(join(tmpdir(), 'svc-e2e-repo-')), 'widgets');
  mkdirSync(repository);
  const git = (...args: string[]) => execFileSync('git', args, { cwd: repository, encoding: 'utf8' });
  git('init', '--quiet', '-b', 'main');
  git('config', 'user.email', 'dev@example.com');
  git('config', 'user.name', 'Dev');
  writeFileSync(join(repository, 'greeting.txt'), 'hello\n');
  git('add', '.');
  git('commit', '--quiet', '-m', 'first');
  git('remote', 'add', 'origin', 'https://github.com/acme/widgets.git');
  return repository;
}

/** The runner's environment: the built-in loop against the fake model, no agent CLI found. */
export const runnerEnv = (modelBaseUrl: string) => ({
  PATH: process.env.PATH,
  HOME: process.env.HOME,
  OPENAI_COMPATIBLE_BASE_URL: modelBaseUrl,
  OPENAI_COMPATIBLE_API_KEY: 'test',
  SVC_CLAUDE_CODE_COMMAND: '/nonexistent/claude',
  SVC_CODEX_COMMAND: '/nonexistent/codex',
});

/** Pairs `home` with `server` for `owner`, who opens the link while signed in and hands its code back. */
export function pairFor(owner: SignedIn, home: RunnerHome, env: NodeJS.ProcessEnv, server: string, client?: PairOptions['client']) {
  let challenge = '';
  return pair({
    home,
    server,
    name: 'laptop',
    env,
    ...(client ? { client } : {}),
    show: (url) => (challenge = new URL(url).searchParams.get('challenge') ?? ''),
    readCode: async () => {
      const issued = await owner.request('POST', '/api/v1/runner-pairings', { challenge, name: 'laptop' });
      expect(issued.statusCode, issued.body).toBe(201);
      return issued.json().pairingCode as string;
    },
  });
}

export interface TaskView {
  task: { status: string };
  latestJob: { id: string; status: string; finalAnswer: string | null; error: string | null };
}

export async function taskView(owner: SignedIn, taskId: string): Promise<TaskView> {
  return (await owner.request('GET', `/api/v1/tasks/${taskId}`)).json() as TaskView;
}

export async function pendingRequests(owner: SignedIn, taskId: string) {
  const requests = (await owner.request('GET', `/api/v1/tasks/${taskId}/requests`)).json().requests as Array<{ requestId: string; status: string; tool: string | null }>;
  return requests.filter((request) => request.status === 'pending');
}

/** Starts a local task on `runnerId` and answers its id. */
export async function startLocalTask(
  owner: SignedIn,
  target: { runnerId: string; projectId: string; permissionMode: 'full' | 'auto' | 'ask' },
  command = 'Do the work',
): Promise<string> {
  const created = await owner.request('POST', '/api/v1/tasks', { command, agent: 'openai-compatible/fake-coder', local: target });
  expect(created.statusCode, created.body).toBe(201);
  return created.json().task.id as string;
}

/** Waits until the task's latest run has ended, allowing every permission it asks for on the way. */
export async function finishAllowing(owner: SignedIn, taskId: string, timeoutMs = 60_000): Promise<TaskView> {
  return waitFor(
    `task ${taskId} to finish`,
    async () => {
      for (const request of await pendingRequests(owner, taskId)) {
        const answered = await owner.request('POST', `/api/v1/tasks/${taskId}/permissions/${request.requestId}`, { decision: 'allow' });
        // Cleared meanwhile (the run went on syncing) is fine; anything else is not.
        if (answered.statusCode !== 409) expect(answered.statusCode, answered.body).toBe(200);
      }
      const view = await taskView(owner, taskId);
      return view.latestJob.status !== 'PENDING' && view.latestJob.status !== 'IN_PROGRESS' ? view : null;
    },
    timeoutMs,
  );
}

export interface JournalEntry {
  jobId: string;
  sequence: number;
  kind: string;
  data: unknown;
}

/** The task's journal as its owner reads it: `GET /tasks/{id}/logs`, Server-Sent Events. */
export async function journalOf(owner: SignedIn, taskId: string): Promise<JournalEntry[]> {
  const stream = await owner.request('GET', `/api/v1/tasks/${taskId}/logs`);
  expect(stream.statusCode, stream.body).toBe(200);
  return stream.body
    .split('\n\n')
    .flatMap((frame) => {
      const data = frame.split('\n').find((line) => line.startsWith('data: '));
      if (!data || !frame.split('\n').some((line) => line.startsWith('id: '))) return [];
      const entry = JSON.parse(data.slice('data: '.length)) as JournalEntry;
      return [{ jobId: entry.jobId, sequence: entry.sequence, kind: entry.kind, data: entry.data }];
    });
}

export interface RunnerProcess {
  child: ChildProcess;
  stderr(): string;
  /** Resolves with the exit code or signal once the process is gone. */
  exited: Promise<number | NodeJS.Signals | null>;
}

/** `svc runner start --home <home>` in a child process, once it has said which runner it is. */
export async function startRunnerProcess(home: string, env: NodeJS.ProcessEnv, timeoutMs = 60_000): Promise<RunnerProcess> {
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/svc.ts', 'runner', 'start', '--home', home], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  child.stdout!.resume();
  const exited = new Promise<number | NodeJS.Signals | null>((resolve) => child.once('exit', (code, signal) => resolve(code ?? signal)));
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`svc runner start did not start in ${timeoutMs} ms\n${stderr}`));
    }, timeoutMs);
    child.stderr!.on('data', (chunk: Buffer) => {
      stderr += chunk.toString('utf8');
      if (/ runner \S+ for \S+; harnesses/.test(stderr)) {
        clearTimeout(timer);
        resolve();
      }
    });
    void exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`svc runner start exited (${code})\n${stderr}`));
    });
  });
  return { child, stderr: () => stderr, exited };
}
