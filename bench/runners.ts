/**
 * `npm run bench -- runners`: the local runner protocol on PostgreSQL, against a server in a child
 * process (bench/servers.ts `runners`) driven over HTTP as runners and their owner drive it.
 *
 * - Control delivery: a runner's signals long poll waits; its owner answers a permission (POST
 *   …/permissions/{id}); the time from sending the answer until the poll's answer arrives, p50/p99.
 *   Baseline: an INSERT + NOTIFY committed on one connection until a LISTEN connection hears it.
 *   Target: p99 under 10 ms.
 * - Event ingest: events per second through POST /runners/events (batches of BATCH events, RUNS runs at
 *   once), against a plain multi-row INSERT of the same rows into job_events in the same run. Target: at
 *   least 0.5 of the plain INSERT.
 * - Long polls: POLLS concurrent signals requests held by the one server process; its RSS while they are
 *   held, against its RSS before. Target: under 300 MB.
 *
 * Every load is bounded in count and time; the server listens on 127.0.0.1 only.
 */
import { createHash, randomBytes, randomUUID } from 'node:crypto';
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import http from 'node:http';
import { createInterface } from 'node:readline';
import pg from 'pg';
import { challengeOf, generateRunnerCredential } from '../src/domain/runners.js';
import { benchSchema, latencyOf, latencyRow, postgresUrl, since, verdict } from './support.js';

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 200);
const WARMUP = 10;
const BATCH = 200;
const BATCHES = Number(process.env.BENCH_BATCHES ?? 100);
const RUNS = 4;
const POLLS = Number(process.env.BENCH_POLLS ?? 1000);
const RUNNERS_FOR_POLLS = 100;
const AGENT = 'openai-compatible/fake';

interface Server {
  child: ChildProcess;
  base: string;
  pid: number;
  signInToken: string;
}

async function startServer(env: NodeJS.ProcessEnv): Promise<Server> {
  const child = spawn(process.execPath, [...(process.env.BENCH_SERVER_PROFILE ? ['--cpu-prof', `--cpu-prof-dir=${process.env.BENCH_SERVER_PROFILE}`] : []), '--import', 'tsx', 'bench/servers.ts', 'runners'], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] });
  const line = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('the runner server did not start')), 60_000);
    createInterface({ input: child.stdout! }).once('line', (text) => {
      clearTimeout(timer);
      resolve(text);
    });
    child.once('exit', (code) => reject(new Error(`the runner server exited with ${code}`)));
  });
  const started = JSON.parse(line) as { port: number; pid: number; signInToken: string };
  return { child, base: `http://127.0.0.1:${started.port}/api/v1`, pid: started.pid, signInToken: started.signInToken };
}

async function stop(server: Server): Promise<void> {
  if (server.child.exitCode !== null) return;
  const exited = new Promise((resolve) => server.child.once('exit', resolve));
  server.child.kill('SIGTERM');
  const timer = setTimeout(() => server.child.kill('SIGKILL'), 15_000);
  await exited;
  clearTimeout(timer);
}

function rssMiB(pid: number): number {
  const line = readFileSync(`/proc/${pid}/status`, 'utf8').split('\n').find((entry) => entry.startsWith('VmRSS:'));
  return Number(/(\d+)/.exec(line ?? '')?.[1] ?? 0) / 1024;
}

// eslint-disable-next-line @typescript-eslint/no-explicit-any -- answers of many shapes, checked where used
async function call(url: string, init: { method?: string; headers?: Record<string, string>; body?: unknown } = {}): Promise<{ status: number; json: any }> {
  const response = await fetch(url, {
    method: init.method ?? 'GET',
    headers: { ...(init.body === undefined ? {} : { 'content-type': 'application/json' }), ...init.headers },
    ...(init.body === undefined ? {} : { body: typeof init.body === 'string' ? init.body : JSON.stringify(init.body) }),
  });
  const text = await response.text();
  return { status: response.status, json: text ? JSON.parse(text) : null };
}

function expectStatus(result: { status: number; json: unknown }, status: number, what: string): void {
  if (result.status !== status) throw new Error(`${what} answered ${result.status}: ${JSON.stringify(result.json)}`);
}

interface Owner {
  headers: Record<string, string>;
}

interface Runner {
  id: string;
  projectId: string;
  headers: Record<string, string>;
}

async function signIn(server: Server): Promise<Owner> {
  const response = await fetch(`${server.base}/auth/sign-in-link`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ token: server.signInToken }) });
  if (response.status !== 200) throw new Error(`sign-in answered ${response.status}`);
  const cookie = response.headers.getSetCookie().find((line) => line.startsWith('svc_session='))!.split(';')[0]!;
  const { csrfToken } = (await response.json()) as { csrfToken: string };
  return { headers: { cookie, 'x-csrf-token': csrfToken } };
}

async function enroll(server: Server, owner: Owner): Promise<Runner> {
  const verifier = randomBytes(32).toString('base64url');
  const paired = await call(`${server.base}/runner-pairings`, { method: 'POST', headers: owner.headers, body: { challenge: challengeOf(verifier), name: 'bench' } });
  expectStatus(paired, 201, 'pairing');
  const credential = generateRunnerCredential();
  const projectId = randomUUID();
  const enrolled = await call(`${server.base}/runners/enroll`, {
    method: 'POST',
    body: {
      pairingCode: paired.json.pairingCode,
      verifier,
      credential,
      name: 'bench',
      capabilities: { models: { 'openai-compatible': [{ id: 'fake', name: 'Fake' }] } },
      projects: [{ id: projectId, name: 'bench', repositories: [] }],
    },
  });
  expectStatus(enrolled, 200, 'enrollment');
  return { id: enrolled.json.runnerId, projectId, headers: { authorization: `Bearer ${credential}` } };
}

/** A local task of the runner, its run claimed: answers the run id and generation. */
async function claimedRun(server: Server, owner: Owner, runner: Runner): Promise<{ taskId: string; runId: string; generation: number }> {
  const created = await call(`${server.base}/tasks`, {
    method: 'POST',
    headers: owner.headers,
    body: { command: 'Benchmark', agent: AGENT, local: { runnerId: runner.id, projectId: runner.projectId, permissionMode: 'ask' } },
  });
  expectStatus(created, 201, 'local task');
  const claimed = await call(`${server.base}/runners/runs/${created.json.job.id}/claim`, { method: 'POST', headers: runner.headers, body: {} });
  expectStatus(claimed, 200, 'claim');
  return { taskId: created.json.task.id, runId: created.json.job.id, generation: claimed.json.run.generation };
}

/** The baseline wake-up: INSERT + NOTIFY committed on one connection until another hears it. */
async function notifyBaseline(url: string, schema: string, rounds: number): Promise<number[]> {
  const listener = new pg.Client({ connectionString: url });
  const sender = new pg.Client({ connectionString: url });
  await listener.connect();
  await sender.connect();
  await sender.query(`create table ${schema}.bench_wake (id serial primary key, at timestamptz default now())`);
  await listener.query('listen svc_bench_wake');
  const samples: number[] = [];
  try {
    for (let round = 0; round < rounds + WARMUP; round++) {
      const heard = new Promise<void>((resolve) => listener.once('notification', () => resolve()));
      const start = performance.now();
      await sender.query('begin');
      await sender.query(`insert into ${schema}.bench_wake default values`);
      await sender.query(`select pg_notify('svc_bench_wake', '')`);
      await sender.query('commit');
      await heard;
      if (round >= WARMUP) samples.push(since(start));
    }
  } finally {
    await listener.end();
    await sender.end();
  }
  return samples;
}

/**
 * Control delivery. `direct`: the control is posted as the owner's answer posts it — its row and the
 * runner's NOTIFY committed in one transaction (here on a connection of the benchmark's own) — and the
 * clock runs until the waiting poll's answer arrives. `answer`: the owner's whole request (POST
 * …/permissions/{id}: session, checks, the same transaction) until the poll's answer arrives.
 */
async function controlLatency(server: Server, owner: Owner, runner: Runner, url: string, schema: string): Promise<{ direct: number[]; answer: number[] }> {
  const { taskId, runId, generation } = await claimedRun(server, owner, runner);
  const poster = new pg.Client({ connectionString: url });
  await poster.connect();
  await poster.query(`set search_path to ${schema}`);
  const direct: number[] = [];
  const answer: number[] = [];
  let version: string | null = (await call(`${server.base}/runners/runs`, { headers: runner.headers })).json.version;
  let sequence = 0;
  const waitingPoll = () => {
    const poll = leanPost(`${server.base}/runners/signals`, runner.headers, { runs: [{ runId, after: sequence }], version, waitMs: 10_000 });
    // Let the poll reach the server and park before the control is posted (wrapped: a promise resolved
    // with a promise would wait for it).
    return new Promise<{ poll: typeof poll }>((resolve) => setTimeout(() => resolve({ poll }), 20));
  };
  const delivered = async (poll: Promise<{ status: number; json: any }>, start: number): Promise<number> => { // eslint-disable-line @typescript-eslint/no-explicit-any
    const signals = await poll;
    const elapsed = since(start);
    if (signals.json.controls.length !== 1) throw new Error(`the poll answered without the control: ${JSON.stringify(signals.json)}`);
    version = signals.json.version;
    sequence += 1;
    return elapsed;
  };
  try {
    for (let round = 1; round <= ROUNDS + WARMUP; round++) {
      const { poll } = await waitingPoll();
      const start = performance.now();
      await poster.query('begin');
      await poster.query(`insert into run_controls (job_id, sequence, type, message) values ($1, $2, 'permission', $3)`, [
        runId,
        sequence + 1,
        JSON.stringify({ type: 'permission', requestId: `direct-${round}`, decision: 'allow' }),
      ]);
      await poster.query(`select pg_notify('svc_runner', $1)`, [runner.id]);
      await poster.query('commit');
      const elapsed = await delivered(poll, start);
      if (round > WARMUP) direct.push(elapsed);
    }
    for (let round = 1; round <= ROUNDS + WARMUP; round++) {
      const requestId = `p${round}`;
      const uploaded = await call(`${server.base}/runners/events`, {
        method: 'POST',
        headers: runner.headers,
        body: { batches: [{ runId, generation, firstSequence: round, events: [{ kind: 'permission', data: { requestId, tool: 'run_command', input: { command: 'true' } } }] }] },
      });
      if (uploaded.json.results[0].acknowledgedSequence !== round) throw new Error(`event upload: ${JSON.stringify(uploaded.json)}`);
      const { poll } = await waitingPoll();
      const start = performance.now();
      const answered = await call(`${server.base}/tasks/${taskId}/permissions/${requestId}`, { method: 'POST', headers: owner.headers, body: { decision: 'allow' } });
      expectStatus(answered, 200, 'answer');
      const elapsed = await delivered(poll, start);
      if (round > WARMUP) answer.push(elapsed);
    }
  } finally {
    await poster.end();
    leanAgent.destroy();
  }
  return { direct, answer };
}

/**
 * A POST on a kept-alive node:http connection: the control delivery figure is the server's, so the
 * client's own cost (fetch's stream machinery) stays small and steady.
 */
const leanAgent = new http.Agent({ keepAlive: true, maxSockets: 4 });
// eslint-disable-next-line @typescript-eslint/no-explicit-any -- answers of many shapes, checked where used
function leanPost(url: string, headers: Record<string, string>, body: unknown): Promise<{ status: number; json: any }> {
  const payload = JSON.stringify(body);
  return new Promise((resolve, reject) => {
    const request = http.request(url, { method: 'POST', agent: leanAgent, headers: { ...headers, 'content-type': 'application/json', 'content-length': Buffer.byteLength(payload) } }, (response) => {
      const chunks: Buffer[] = [];
      response.on('data', (chunk: Buffer) => chunks.push(chunk));
      response.on('end', () => resolve({ status: response.statusCode ?? 0, json: JSON.parse(Buffer.concat(chunks).toString('utf8')) }));
      response.on('error', reject);
    });
    request.on('error', reject);
    request.end(payload);
  });
}

function eventsOf(count: number): Array<{ kind: string; data: { text: string } }> {
  return Array.from({ length: count }, (_, index) => ({ kind: 'message', data: { text: `event ${index} ${'x'.repeat(180)}` } }));
}

async function ingestThroughApi(server: Server, owner: Owner, runner: Runner): Promise<number> {
  const runs = await Promise.all(Array.from({ length: RUNS }, () => claimedRun(server, owner, runner)));
  const batches = BATCHES / RUNS;
  const start = performance.now();
  await Promise.all(
    runs.map(async ({ runId, generation }) => {
      for (let index = 0; index < batches; index++) {
        const result = await call(`${server.base}/runners/events`, {
          method: 'POST',
          headers: runner.headers,
          body: { batches: [{ runId, generation, firstSequence: index * BATCH + 1, events: eventsOf(BATCH) }] },
        });
        if (result.json.results[0].acknowledgedSequence !== (index + 1) * BATCH) throw new Error(`ingest: ${JSON.stringify(result.json.results[0])}`);
      }
    }),
  );
  return (BATCHES * BATCH) / (since(start) / 1000);
}

/** The same rows as a plain multi-row INSERT per batch, on as many connections as the API used runs. */
async function ingestPlain(url: string, schema: string, jobIds: string[], taskIds: string[]): Promise<number> {
  const clients = await Promise.all(jobIds.map(async () => {
    const client = new pg.Client({ connectionString: url });
    await client.connect();
    await client.query(`set search_path to ${schema}`);
    return client;
  }));
  const batches = BATCHES / RUNS;
  const start = performance.now();
  try {
    await Promise.all(
      clients.map(async (client, run) => {
        for (let index = 0; index < batches; index++) {
          const values: unknown[] = [];
          const rows = eventsOf(BATCH).map((event, offset) => {
            const base = values.length;
            values.push(jobIds[run], taskIds[run], index * BATCH + offset + 1, event.kind, JSON.stringify(event.data), createHash('sha256').update(JSON.stringify(event)).digest('hex'));
            return `($${base + 1}, $${base + 2}, $${base + 3}, $${base + 4}, $${base + 5}, $${base + 6})`;
          });
          await client.query(`insert into job_events (job_id, task_id, sequence, kind, data, digest) values ${rows.join(', ')}`, values);
        }
      }),
    );
    return (BATCHES * BATCH) / (since(start) / 1000);
  } finally {
    await Promise.all(clients.map((client) => client.end()));
  }
}

async function longPolls(server: Server, owner: Owner): Promise<{ idle: number; held: number; answered: number }> {
  const runners: Runner[] = [];
  for (let index = 0; index < RUNNERS_FOR_POLLS; index++) runners.push(await enroll(server, owner));
  const versions = await Promise.all(runners.map(async (runner) => (await call(`${server.base}/runners/runs`, { headers: runner.headers })).json.version as string));
  await new Promise((resolve) => setTimeout(resolve, 500));
  const idle = rssMiB(server.pid);
  const polls = Array.from({ length: POLLS }, (_, index) => {
    const runner = runners[index % runners.length]!;
    return call(`${server.base}/runners/signals`, { method: 'POST', headers: runner.headers, body: { runs: [], version: versions[index % runners.length], waitMs: 10_000 } });
  });
  // While they are held (each waits 10 s), the server's memory.
  await new Promise((resolve) => setTimeout(resolve, 5_000));
  const held = rssMiB(server.pid);
  const answers = await Promise.all(polls);
  return { idle, held, answered: answers.filter((answer) => answer.status === 200).length };
}

export async function runnersBench(): Promise<void> {
  const url = await postgresUrl();
  if (!url) {
    process.stdout.write('runners: skipped (no DATABASE_URL and nothing at 127.0.0.1:5432)\n');
    return;
  }
  const schema = await benchSchema(url);
  const server = await startServer({ BENCH_DATABASE_URL: url, BENCH_SCHEMA: schema.name });
  try {
    const owner = await signIn(server);
    const runner = await enroll(server, owner);

    const baseline = latencyOf(await notifyBaseline(url, schema.name, ROUNDS));
    const controls = await controlLatency(server, owner, runner, url, schema.name);
    const control = latencyOf(controls.direct);
    process.stdout.write(`${latencyRow('INSERT + NOTIFY wake-up (baseline)', baseline, baseline)}\n`);
    process.stdout.write(`${latencyRow('control posted -> signals answer', control, baseline)}\n`);
    process.stdout.write(`${latencyRow('owner answer request -> signals answer', latencyOf(controls.answer), baseline, '(for information)')}\n`);
    process.stdout.write(`${verdict('control delivery p99', control.p99, 10)}\n`);

    const viaApi = await ingestThroughApi(server, owner, runner);
    // The plain INSERT writes the same rows for runs of their own, so that no sequence collides.
    const plainRuns = await Promise.all(Array.from({ length: RUNS }, () => claimedRun(server, owner, runner)));
    const plain = await ingestPlain(url, schema.name, plainRuns.map((run) => run.runId), plainRuns.map((run) => run.taskId));
    process.stdout.write(`event ingest: plain multi-row INSERT ${plain.toFixed(0)} events/s (baseline), POST /runners/events ${viaApi.toFixed(0)} events/s, ratio ${(viaApi / plain).toFixed(2)}\n`);
    process.stdout.write(`target: ingest >= 0.5 of the plain INSERT: ${viaApi / plain >= 0.5 ? 'PASS' : 'MISSED'} (${(viaApi / plain).toFixed(2)})\n`);

    const polls = await longPolls(server, owner);
    process.stdout.write(
      `long polls: ${POLLS} held (${polls.answered} answered 200 after their wait): server RSS ${polls.held.toFixed(0)} MiB, idle ${polls.idle.toFixed(0)} MiB (baseline), ratio ${(polls.held / polls.idle).toFixed(2)}\n`,
    );
    process.stdout.write(`target: ${POLLS} long polls under 300 MB RSS: ${polls.held * 1.048576 < 300 && polls.answered === POLLS ? 'PASS' : 'MISSED'} (${(polls.held * 1.048576).toFixed(0)} MB)\n`);
  } finally {
    await stop(server);
    await schema.drop();
  }
}
