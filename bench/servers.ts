/**
 * A server under measurement, run in its own process so that it does not share an event loop with the
 * load generator. `bare`: Fastify hello-world (the baseline). `pglite` / `postgres`: the real svc HTTP
 * edge on that store, with one workspace, key and task. Prints one JSON line `{ port, keys, taskId }`.
 */
import { tmpdir } from 'node:os';
import Fastify from 'fastify';
import { buildServer } from '../src/server/app.js';
import { createApiKey } from '../src/store/api-keys.js';
import { openDatabase, type Database } from '../src/store/db.js';
import { createWorkspace } from '../src/store/workspaces.js';
import { findOrCreateAccount, issueSignInLink } from '../src/engine/users.js';

const kind = process.argv[2];
const KEYS = 256;

async function main(): Promise<void> {
  if (kind === 'bare') {
    const app = Fastify({ logger: false });
    app.get('/hello', async () => ({ hello: 'world' }));
    await app.listen({ port: 0, host: '127.0.0.1' });
    const address = app.server.address();
    process.stdout.write(`${JSON.stringify({ port: typeof address === 'object' && address ? address.port : 0 })}\n`);
    return;
  }
  if (kind === 'runners') return runnerServer();
  let database: Database;
  if (kind === 'pglite') database = await openDatabase({ driver: 'pglite', dataDir: null });
  else if (kind === 'postgres') {
    database = await openDatabase({ driver: 'postgres', url: process.env.BENCH_DATABASE_URL!, schema: process.env.BENCH_SCHEMA!, poolSize: 10 });
  } else throw new Error(`unknown server kind ${kind}`);
  const workspace = await createWorkspace(database.db, { name: 'bench', defaultAgent: 'anthropic/claude-sonnet-4-5' });
  // Many clients, as in real traffic: a single key's bucket row would serialise every request on it,
  // which the per-key limit of 100 a minute keeps from ever happening outside a benchmark.
  const keys: string[] = [];
  for (let i = 0; i < KEYS; i++) keys.push((await createApiKey(database.db, { workspaceId: workspace!.id, name: `bench ${i}` })).key);
  const key = keys[0]!;
  // Limits far above the load so that every request runs the whole rate-limit path and none is refused.
  const app = await buildServer({ database, publicUrl: 'http://bench', dataDir: tmpdir(), rateLimits: { perMinute: 1e9, perHour: 1e9 } });
  await app.listen({ port: 0, host: '127.0.0.1' });
  const created = await app.inject({
    method: 'POST',
    url: '/api/v1/tasks',
    headers: { authorization: `Bearer ${key}` },
    payload: { command: 'Benchmark task' },
  });
  const address = app.server.address();
  const port = typeof address === 'object' && address ? address.port : 0;
  process.stdout.write(`${JSON.stringify({ port, keys, taskId: created.json().task.id })}\n`);
  process.on('SIGTERM', () => {
    app.close().then(() => database.close()).finally(() => process.exit(0));
  });
}

/**
 * The svc HTTP edge on PostgreSQL for the runner protocol benchmark: one signed-in user's one-time link
 * token (the parent signs in, pairs and enrolls runners over HTTP), limits far above the load.
 */
async function runnerServer(): Promise<void> {
  const database = await openDatabase({ driver: 'postgres', url: process.env.BENCH_DATABASE_URL!, schema: process.env.BENCH_SCHEMA!, poolSize: 10 });
  const { user } = await database.db.transaction((tx) => findOrCreateAccount(tx, { email: 'bench@example.com', defaultAgent: 'openai-compatible/fake' }));
  const link = await issueSignInLink(database.db, user.id, 'http://127.0.0.1');
  const app = await buildServer({
    database,
    publicUrl: 'http://127.0.0.1',
    dataDir: tmpdir(),
    rateLimits: { perMinute: 1e9, perHour: 1e9 },
    runnerRateLimits: { perMinute: 1e9, perHour: 1e9 },
  });
  await app.listen({ port: 0, host: '127.0.0.1' });
  const address = app.server.address();
  const port = typeof address === 'object' && address ? address.port : 0;
  process.stdout.write(`${JSON.stringify({ port, pid: process.pid, signInToken: link.url.slice(link.url.lastIndexOf('/') + 1) })}\n`);
  process.on('SIGTERM', () => {
    app.close().then(() => database.close()).finally(() => process.exit(0));
  });
}

main().catch((error: unknown) => {
  process.stderr.write(`${String(error)}\n`);
  process.exit(1);
});
