/**
 * `npm run bench -- task-start`: how long from POST /api/v1/tasks until the agent's first event is in
 * the job journal (its job_events row committed and its NOTIFY delivered), on PGlite and on PostgreSQL.
 * The service runs in this process (startService, executor concurrency 2) against a fake
 * OpenAI-compatible model that answers `finish` at once. Baseline, on the same database in the same run:
 * an INSERT + NOTIFY in one transaction until a LISTEN connection hears it — the wake-up every task
 * start rides on. Target: task start under 100 ms p50 on PostgreSQL.
 *
 * Tasks are started one at a time, each after the previous one settled, so the figure is the latency of
 * an idle service. Where the time goes is read from marks this process can see: the POST's answer, the
 * jobs channel's NOTIFY, the fork operations (ForkManager and Fork wrapped to time them) and the model's
 * request.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { desc, eq, sql } from 'drizzle-orm';
import { loadConfig } from '../src/config.js';
import { JOBS_CHANNEL } from '../src/engine/queue.js';
import { startService, type RunningService } from '../src/main.js';
import { Fork, ForkManager } from '../src/sandbox/fork.js';
import { notify, type Database } from '../src/store/db.js';
import { EVENTS_CHANNEL } from '../src/store/journal.js';
import { jobEvents, jobs, tasks } from '../src/store/schema.js';
import { benchSchema, latencyOf, latencyRow, postgresUrl, since, verdict, type Latency } from './support.js';

const TASKS = Number(process.env.BENCH_TASKS ?? 50);
const WARMUP_TASKS = 3;
const BASELINE_ROUNDS = 100;
const TARGET_MS = 100;
/** Bounds on one task: its first event, then settling (finish, checks, fork release). */
const FIRST_EVENT_TIMEOUT_MS = 30_000;
const SETTLE_TIMEOUT_MS = 60_000;
const AGENT = 'openai-compatible/fake';

// --- a model that finishes at once -------------------------------------------------------------------

interface FinishingModel {
  baseUrl: string;
  /** performance.now() of each chat request's arrival. */
  requests: number[];
  close(): Promise<void>;
}

async function startFinishingModel(): Promise<FinishingModel> {
  const requests: number[] = [];
  let calls = 0;
  const server: Server = createServer((request, response) => {
    requests.push(performance.now());
    request.resume();
    request.on('end', () => {
      calls += 1;
      const toolCall = { id: `call_${calls}`, type: 'function', function: { name: 'finish', arguments: JSON.stringify({ summary: 'Done.' }) } };
      response.writeHead(200, { 'content-type': 'application/json' }).end(
        JSON.stringify({
          id: `chatcmpl-${calls}`,
          object: 'chat.completion',
          created: Math.floor(Date.now() / 1000),
          model: 'fake',
          choices: [{ index: 0, message: { role: 'assistant', content: null, tool_calls: [toolCall] }, finish_reason: 'tool_calls' }],
          usage: { prompt_tokens: 10, completion_tokens: 5, total_tokens: 15 },
        }),
      );
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  return { baseUrl: `http://127.0.0.1:${port}/v1`, requests, close: () => new Promise((resolve) => server.close(() => resolve())) };
}

// --- marks along a task's start ---------------------------------------------------------------------

interface Span {
  what: string;
  start: number;
  end: number;
}

/** Every fork operation of this process, timed (ForkManager.create and Fork.run, wrapped in place). */
function traceForks(): { spans: Span[]; restore(): void } {
  const spans: Span[] = [];
  const create = ForkManager.prototype.create;
  const run = Fork.prototype.run;
  const timed = <T>(promise: Promise<T>, what: string, start: number) =>
    promise.finally(() => {
      spans.push({ what, start, end: performance.now() });
    });
  // The start is read before the call: spawning the sandbox happens synchronously inside it.
  ForkManager.prototype.create = function (this: ForkManager, ...args: Parameters<ForkManager['create']>) {
    const start = performance.now();
    return timed(create.apply(this, args), 'ForkManager.create', start);
  };
  Fork.prototype.run = function (this: Fork, ...args: Parameters<Fork['run']>) {
    const start = performance.now();
    return timed(run.apply(this, args), `Fork.run(${args[0][0]} …)`, start);
  };
  return {
    spans,
    restore() {
      ForkManager.prototype.create = create;
      Fork.prototype.run = run;
    },
  };
}

interface TaskMarks {
  posted: number;
  answered: number;
  jobNotified: number;
  firstFork: number;
  forkMs: number;
  /** The fork operations before the first event, in order. */
  forkOps: Span[];
  lastFork: number;
  modelRequest: number;
  firstEvent: number;
}

/** Resolves `wait(key)` when `hear(key)` is called (or was already), with the time it was heard. */
class Marks {
  private readonly heard = new Map<string, number>();
  private readonly failed = new Map<string, Error>();
  private readonly waiting = new Map<string, () => void>();

  hear(key: string, at = performance.now()): void {
    if (this.heard.has(key)) return;
    this.heard.set(key, at);
    this.waiting.get(key)?.();
  }

  /** What was awaited will not come: `wait(key)` rejects with `error`. */
  fail(key: string, error: Error): void {
    this.failed.set(key, error);
    this.waiting.get(key)?.();
  }

  at(key: string): number | undefined {
    return this.heard.get(key);
  }

  async wait(key: string, timeoutMs: number, what: string): Promise<number> {
    if (!this.heard.has(key) && !this.failed.has(key)) {
      let timer: NodeJS.Timeout | undefined;
      await new Promise<void>((resolve, reject) => {
        timer = setTimeout(() => reject(new Error(`${what}: nothing within ${timeoutMs} ms`)), timeoutMs);
        this.waiting.set(key, resolve);
      }).finally(() => {
        clearTimeout(timer);
        this.waiting.delete(key);
      });
    }
    const error = this.failed.get(key);
    if (error) throw error;
    return this.heard.get(key)!;
  }
}

// --- the baseline ---------------------------------------------------------------------------------------

/** INSERT + NOTIFY committed together, until this process's LISTEN hears it: the floor of any wake-up. */
async function wakeupBaseline(database: Database): Promise<Latency> {
  const channel = 'svc_bench_wakeup';
  const db = database.db;
  await db.execute(sql`create table if not exists bench_wakeup (id serial primary key, at timestamptz not null default now())`);
  const marks = new Marks();
  const unlisten = await database.listen(channel, (payload) => marks.hear(payload));
  const samples: number[] = [];
  try {
    for (let round = -5; round < BASELINE_ROUNDS; round++) {
      const start = performance.now();
      await db.transaction(async (tx) => {
        await tx.execute(sql`insert into bench_wakeup default values`);
        await notify(tx, channel, String(round));
      });
      await marks.wait(String(round), 10_000, 'the baseline NOTIFY');
      if (round >= 0) samples.push(marks.at(String(round))! - start);
    }
  } finally {
    await unlisten();
    await db.execute(sql`drop table bench_wakeup`);
  }
  return latencyOf(samples);
}

/**
 * How long child_process.spawn holds this process's event loop: libuv fork()s the whole process, so the
 * cost grows with its resident memory (nodejs/node#14917), and every Fork.run pays it.
 */
async function spawnBlocking(): Promise<{ latency: Latency; rssMiB: number }> {
  const samples: number[] = [];
  for (let i = 0; i < 30; i++) {
    const start = performance.now();
    const child = spawn('true', [], { stdio: 'ignore', detached: true });
    samples.push(since(start));
    await new Promise((resolve) => child.once('close', resolve));
  }
  return { latency: latencyOf(samples), rssMiB: process.memoryUsage().rss / 1024 / 1024 };
}

// --- task start -----------------------------------------------------------------------------------------

async function settle(service: RunningService, taskId: string): Promise<void> {
  const started = performance.now();
  while (since(started) < SETTLE_TIMEOUT_MS) {
    const [task] = await service.database.db.select({ status: tasks.status }).from(tasks).where(eq(tasks.id, taskId));
    if (task && !['PENDING', 'IN_PROGRESS'].includes(task.status)) return;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  throw new Error(`task ${taskId} did not settle within ${SETTLE_TIMEOUT_MS} ms`);
}

async function measureTaskStarts(service: RunningService, model: FinishingModel, spans: Span[]): Promise<TaskMarks[]> {
  const key = service.bootstrapKey;
  if (!key) throw new Error('the service did not bootstrap a key (was its database new?)');
  const db = service.database.db;
  const queued = new Marks();
  const events = new Marks();
  // A NOTIFY on the events channel also comes from cancels and finished jobs: count only a journal row,
  // and give up on a task whose job ended without one (say, the executor could not fork).
  const onEvent = (taskId: string) => {
    const heard = performance.now();
    const check = async () => {
      const rows = await db.select({ id: jobEvents.id }).from(jobEvents).where(eq(jobEvents.taskId, taskId)).limit(1);
      if (rows.length > 0) return events.hear(taskId, heard);
      const [job] = await db.select({ status: jobs.status, error: jobs.error }).from(jobs).where(eq(jobs.taskId, taskId)).orderBy(desc(jobs.seq)).limit(1);
      if (job && !['PENDING', 'IN_PROGRESS'].includes(job.status)) events.fail(taskId, new Error(`task ${taskId} ended ${job.status} before any agent event: ${job.error}`));
    };
    check().catch(() => undefined);
  };
  const unlisten = [await service.database.listen(JOBS_CHANNEL, (jobId) => queued.hear(jobId)), await service.database.listen(EVENTS_CHANNEL, onEvent)];
  const results: TaskMarks[] = [];
  try {
    for (let index = -WARMUP_TASKS; index < TASKS; index++) {
      const forksBefore = spans.length;
      const modelBefore = model.requests.length;
      const posted = performance.now();
      const response = await fetch(`${service.url}/api/v1/tasks`, {
        method: 'POST',
        headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
        body: JSON.stringify({ command: `Benchmark task ${index}: fix the flaky test`, agent: AGENT }),
      });
      const answered = performance.now();
      if (response.status !== 201) throw new Error(`POST /api/v1/tasks answered ${response.status}: ${await response.text()}`);
      const { task, job } = (await response.json()) as { task: { id: string }; job: { id: string } };
      const firstEvent = await events.wait(task.id, FIRST_EVENT_TIMEOUT_MS, `the first event of task ${task.id}`);
      const before = spans.slice(forksBefore).filter((span) => span.end <= firstEvent).sort((a, b) => a.start - b.start);
      const marks: TaskMarks = {
        posted,
        answered,
        jobNotified: queued.at(job.id) ?? Number.NaN,
        firstFork: Math.min(...before.map((span) => span.start)),
        lastFork: Math.max(...before.map((span) => span.end)),
        forkMs: before.reduce((sum, span) => sum + (span.end - span.start), 0),
        forkOps: before,
        modelRequest: model.requests[modelBefore] ?? Number.NaN,
        firstEvent,
      };
      await settle(service, task.id);
      if (index >= 0) results.push(marks);
    }
  } finally {
    await Promise.all(unlisten.map((stop) => stop()));
  }
  return results;
}

/** The p50 of each stretch between consecutive marks, and of the time inside fork operations. */
function breakdown(marks: TaskMarks[], baseline: Latency): string[] {
  // A stretch without samples (no fork operation, say, once forks are reused) is left out.
  const row = (name: string, of: (m: TaskMarks) => number) => {
    const samples = marks.map(of).filter(Number.isFinite);
    return samples.length > 0 ? [latencyRow(`  where: ${name}`, latencyOf(samples), baseline)] : [];
  };
  const stretches: Array<[string, (m: TaskMarks) => number]> = [
    ['POST answered', (m) => m.answered - m.posted],
    ['POST -> jobs NOTIFY heard', (m) => m.jobNotified - m.posted],
    ['jobs NOTIFY -> first fork operation', (m) => m.firstFork - m.jobNotified],
    ['first fork op start -> last one end', (m) => m.lastFork - m.firstFork],
    ['  of it inside fork operations', (m) => m.forkMs],
    ['last fork op -> model request', (m) => m.modelRequest - m.lastFork],
    ['model request -> first event NOTIFY', (m) => m.firstEvent - m.modelRequest],
  ];
  const ops = marks[0]?.forkOps ?? [];
  return [
    ...stretches.flatMap(([name, of]) => row(name, of)),
    ...ops.flatMap((op, index) => row(`  ${index + 1}. ${op.what}`, (m) => (m.forkOps[index] ? m.forkOps[index].end - m.forkOps[index].start : Number.NaN))),
  ];
}

interface Store {
  name: string;
  databaseUrl?: string;
  cleanup(): Promise<void>;
}

/** PostgreSQL first: PGlite's WebAssembly memory stays in the process and would slow every later spawn. */
async function stores(): Promise<Store[]> {
  const pglite: Store = { name: 'PGlite', cleanup: async () => undefined };
  const url = await postgresUrl();
  if (!url) {
    process.stdout.write('task-start: PostgreSQL skipped (no DATABASE_URL and nothing at 127.0.0.1:5432)\n');
    return [pglite];
  }
  // startService takes a URL only: the run's own schema travels in it as the session's search_path.
  const schema = await benchSchema(url);
  const databaseUrl = `${url}${url.includes('?') ? '&' : '?'}options=${encodeURIComponent(`-c search_path=${schema.name}`)}`;
  return [{ name: 'PostgreSQL', databaseUrl, cleanup: schema.drop }, pglite];
}

export async function taskStartBench(): Promise<void> {
  const out = (line: string) => process.stdout.write(`${line}\n`);
  const model = await startFinishingModel();
  const previousBaseUrl = process.env.OPENAI_COMPATIBLE_BASE_URL;
  // The executor reads model endpoints from process.env (startService passes no model env).
  process.env.OPENAI_COMPATIBLE_BASE_URL = model.baseUrl;
  const trace = traceForks();
  const rows: string[] = [];
  const verdicts: string[] = [];
  try {
    for (const store of await stores()) {
      const dataDir = mkdtempSync(join(tmpdir(), 'svc-bench-task-start-'));
      let service: RunningService | null = null;
      try {
        const config = loadConfig(
          {
            port: 0,
            host: '127.0.0.1',
            dataDir,
            logLevel: 'silent',
            executorConcurrency: 2,
            defaultAgent: AGENT,
            rateLimitPerMinute: 1e6,
            rateLimitPerHour: 1e6,
            ...(store.databaseUrl ? { databaseUrl: store.databaseUrl } : {}),
          },
          {},
        );
        service = await startService(config);
        const baseline = await wakeupBaseline(service.database);
        rows.push(latencyRow(`${store.name}: INSERT + NOTIFY wake-up (baseline)`, baseline, baseline));
        const marks = await measureTaskStarts(service, model, trace.spans);
        const start = latencyOf(marks.map((m) => m.firstEvent - m.posted));
        rows.push(latencyRow(`${store.name}: POST -> first agent event`, start, baseline));
        rows.push(...breakdown(marks, baseline));
        const blocking = await spawnBlocking();
        rows.push(latencyRow(`  where: spawn() blocks the loop (RSS ${blocking.rssMiB.toFixed(0)} MiB)`, blocking.latency, baseline));
        if (store.name === 'PostgreSQL') verdicts.push(verdict('task start p50 on PostgreSQL', start.p50, TARGET_MS));
      } finally {
        await service?.close();
        await store.cleanup();
        rmSync(dataDir, { recursive: true, force: true });
      }
    }
  } finally {
    trace.restore();
    await model.close();
    if (previousBaseUrl === undefined) delete process.env.OPENAI_COMPATIBLE_BASE_URL;
    else process.env.OPENAI_COMPATIBLE_BASE_URL = previousBaseUrl;
  }
  out(`task-start: ${TASKS} tasks per store after ${WARMUP_TASKS} unmeasured, one at a time; ratio = p50 / p50 of the wake-up baseline (INSERT + NOTIFY until LISTEN hears it)`);
  for (const row of rows) out(row);
  for (const line of verdicts) out(line);
}
