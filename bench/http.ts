/**
 * `npm run bench -- http`: requests per second of the svc API, each as a ratio to a bare Fastify
 * hello-world measured in the same run on the same machine. Target: authenticated GET /tasks/{id} on
 * PostgreSQL at least 0.5 of bare Fastify. Every server runs in a child process; autocannon runs here.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import autocannon from 'autocannon';
import { benchSchema, postgresUrl } from './support.js';

const DURATION_S = Number(process.env.BENCH_DURATION ?? 6);
const WARMUP_S = 2;
const CONNECTIONS = Number(process.env.BENCH_CONNECTIONS ?? 32);
const TARGET = 0.5;

interface Started {
  child: ChildProcess;
  port: number;
  keys?: string[];
  taskId?: string;
}

async function startServer(kind: string, env: NodeJS.ProcessEnv = {}): Promise<Started> {
  const child = spawn(process.execPath, ['--import', 'tsx', 'bench/servers.ts', kind], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const line = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${kind} server did not start`)), 60_000);
    createInterface({ input: child.stdout! }).once('line', (text) => {
      clearTimeout(timer);
      resolve(text);
    });
    child.once('exit', (code) => reject(new Error(`${kind} server exited with ${code}`)));
  });
  return { child, ...(JSON.parse(line) as Omit<Started, 'child'>) };
}

async function stop(server: Started): Promise<void> {
  if (server.child.exitCode !== null) return;
  const exited = new Promise((resolve) => server.child.once('exit', resolve));
  server.child.kill('SIGTERM');
  const timer = setTimeout(() => server.child.kill('SIGKILL'), 10_000);
  await exited;
  clearTimeout(timer);
}

interface Measurement {
  rps: number;
  p50: number;
  p99: number;
  non2xx: number;
  errors: number;
}

async function measure(options: autocannon.Options): Promise<Measurement> {
  await autocannon({ ...options, duration: WARMUP_S, connections: CONNECTIONS });
  const result = await autocannon({ ...options, duration: DURATION_S, connections: CONNECTIONS });
  return {
    rps: result.requests.average,
    p50: result.latency.p50,
    p99: result.latency.p99,
    non2xx: result.non2xx,
    errors: result.errors + result.timeouts,
  };
}

export async function httpBench(): Promise<void> {
  const rows: Array<{ scenario: string; m: Measurement; ratio: number | null }> = [];
  process.stdout.write(`http: ${CONNECTIONS} connections, ${WARMUP_S} s warm-up + ${DURATION_S} s per scenario\n`);
  const bare = await startServer('bare');
  const baseline = await measure({ url: `http://127.0.0.1:${bare.port}/hello` });
  await stop(bare);
  rows.push({ scenario: 'bare Fastify GET /hello (baseline)', m: baseline, ratio: 1 });

  const url = await postgresUrl();
  const stores: Array<{ name: string; kind: string; env: NodeJS.ProcessEnv; cleanup?: () => Promise<void> }> = [{ name: 'PGlite', kind: 'pglite', env: {} }];
  if (url) {
    const schema = await benchSchema(url);
    stores.push({ name: 'PostgreSQL', kind: 'postgres', env: { BENCH_DATABASE_URL: url, BENCH_SCHEMA: schema.name }, cleanup: schema.drop });
  } else {
    process.stdout.write('PostgreSQL: skipped (no DATABASE_URL and nothing at 127.0.0.1:5432)\n');
  }

  for (const store of stores) {
    const server = await startServer(store.kind, store.env);
    try {
      // Each request carries the next of the server's keys, round robin.
      const keys = server.keys!;
      let next = 0;
      const rotate = (request: Record<string, unknown>) => ({
        ...request,
        headers: { ...(request.headers as Record<string, string>), authorization: `Bearer ${keys[next++ % keys.length]}` },
      });
      const headers = { 'content-type': 'application/json' };
      const requests = [{ setupRequest: rotate }] as unknown as autocannon.Request[];
      const get = await measure({ url: `http://127.0.0.1:${server.port}/api/v1/tasks/${server.taskId}`, headers, requests });
      rows.push({ scenario: `${store.name}: GET /api/v1/tasks/{id}`, m: get, ratio: get.rps / baseline.rps });
      const post = await measure({
        url: `http://127.0.0.1:${server.port}/api/v1/tasks`,
        method: 'POST',
        headers,
        body: JSON.stringify({ command: 'Benchmark: fix the flaky test' }),
        requests,
      });
      rows.push({ scenario: `${store.name}: POST /api/v1/tasks`, m: post, ratio: post.rps / baseline.rps });
    } finally {
      await stop(server);
      await store.cleanup?.();
    }
  }

  const lines = rows.map(({ scenario, m, ratio }) => {
    const invalid = m.non2xx + m.errors > 0 ? `  INVALID: ${m.non2xx} non-2xx, ${m.errors} errors` : '';
    return `${scenario.padEnd(38)} ${m.rps.toFixed(0).padStart(8)} req/s  p50 ${String(m.p50).padStart(3)} ms  p99 ${String(m.p99).padStart(4)} ms  ratio ${ratio === null ? '-' : ratio.toFixed(2)}${invalid}`;
  });
  process.stdout.write(`${lines.join('\n')}\n`);
  const target = rows.find((row) => row.scenario.startsWith('PostgreSQL: GET'));
  if (target?.ratio !== undefined && target.ratio !== null) {
    process.stdout.write(`target: GET on PostgreSQL >= ${TARGET} of bare Fastify: ${target.ratio >= TARGET ? 'PASS' : 'BELOW'} (${target.ratio.toFixed(2)})\n`);
  }
  if (rows.some((row) => row.m.non2xx + row.m.errors > 0)) process.exitCode = 1;
}
