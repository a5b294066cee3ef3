/**
 * The composition root: reads config, opens the store, builds the HTTP server and wires shutdown.
 * `svc server` and `svc admin` call into here; nothing else builds these parts.
 */
import type { FastifyInstance } from 'fastify';
import pino, { type Logger } from 'pino';
import type { Config } from './config.js';
import * as admin from './engine/admin.js';
import { openDatabase, type Database, type StoreLocation } from './store/db.js';
import { pruneRateLimitBuckets } from './store/rate-limit.js';
import { buildServer } from './server/app.js';
import { Executor } from './engine/executor.js';
import { hostname } from 'node:os';

export { admin };
export type { Config };

export function storeLocation(config: Config): StoreLocation {
  return config.databaseUrl
    ? { driver: 'postgres', url: config.databaseUrl, poolSize: config.dbPoolSize }
    : { driver: 'pglite', dataDir: config.dataDir };
}

/** Opens the configured store (migrating it), runs `fn`, and closes it again. */
export async function withStore<T>(config: Config, fn: (database: Database) => Promise<T>): Promise<T> {
  const database = await openDatabase(storeLocation(config));
  try {
    return await fn(database);
  } finally {
    await database.close();
  }
}

function makeExecutor(config: Config, database: Database, logger: Logger): Executor | null {
  if (config.executorConcurrency === 0) return null;
  return new Executor({
    database,
    dataDir: config.dataDir,
    owner: `${hostname()}:${process.pid}`,
    concurrency: config.executorConcurrency,
    leaseMs: config.jobLeaseMs,
    pollMs: 5_000,
    allowUnsandboxed: config.allowUnsandboxed,
    logger: logger.child({ component: 'executor' }),
  });
}

/** `svc worker`: executors only, no HTTP (scaled deployments run these against PostgreSQL). */
export async function startWorker(config: Config, logger: Logger = pino({ level: config.logLevel })): Promise<{ close(): Promise<void> }> {
  const database = await openDatabase(storeLocation(config));
  const executor = makeExecutor(config, database, logger);
  if (!executor) {
    await database.close();
    throw new Error('SVC_EXECUTOR_CONCURRENCY is 0: a worker with no executors has nothing to do');
  }
  await executor.start();
  return {
    async close() {
      try {
        await executor.stop();
      } finally {
        await database.close();
      }
    },
  };
}

export interface RunningService {
  app: FastifyInstance;
  database: Database;
  url: string;
  /** The key created when the database was new; printed once by `svc server`. */
  bootstrapKey: string | null;
  close(): Promise<void>;
}

export async function startService(config: Config, logger: Logger = pino({ level: config.logLevel })): Promise<RunningService> {
  const database = await openDatabase(storeLocation(config));
  let app: FastifyInstance | null = null;
  let pruneTimer: NodeJS.Timeout | null = null;
  let executor: Executor | null = null;
  try {
    const created = await admin.bootstrap(database.db, config.defaultAgent);
    const publicUrl = (config.publicUrl ?? `http://${config.host}:${config.port}`).replace(/\/+$/, '');
    app = await buildServer({
      database,
      publicUrl,
      rateLimits: { perMinute: config.rateLimitPerMinute, perHour: config.rateLimitPerHour },
      logger,
    });
    await app.listen({ port: config.port, host: config.host });
    executor = makeExecutor(config, database, logger);
    await executor?.start();
    const runningExecutor = executor;
    const address = app.server.address();
    const port = typeof address === 'object' && address ? address.port : config.port;
    pruneTimer = setInterval(() => {
      pruneRateLimitBuckets(database.db).catch((error: unknown) => logger.warn({ err: error }, 'pruning rate limit buckets failed'));
    }, 5 * 60_000);
    pruneTimer.unref();
    const running = app;
    return {
      app: running,
      database,
      url: `http://${config.host.includes(':') ? `[${config.host}]` : config.host}:${port}`,
      bootstrapKey: created?.key ?? null,
      async close() {
        if (pruneTimer) clearInterval(pruneTimer);
        try {
          await runningExecutor?.stop();
          await running.close();
        } finally {
          await database.close();
        }
      },
    };
  } catch (error) {
    if (pruneTimer) clearInterval(pruneTimer);
    await executor?.stop().catch(() => undefined);
    await app?.close().catch(() => undefined);
    await database.close();
    throw error;
  }
}
