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
import { Environments } from './engine/environments.js';
import { Executor } from './engine/executor.js';
import { ForkLifecycle } from './engine/fork-lifecycle.js';
import { Scheduler } from './engine/scheduler.js';
import { expireWorkspaceShells } from './engine/runners/workspace-shell.js';
import { startDevServers } from './sandbox/dev-servers.js';
import type { SandboxPolicy } from './sandbox/fork.js';
import { describeOutsideNetwork, slirp4netnsAvailable } from './sandbox/outside-network.js';
import { hostname } from 'node:os';
import { join } from 'node:path';

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

/** Like `withStore`, with the workspace environments too (operator commands that change them). */
export async function withEnvironments<T>(config: Config, fn: (database: Database, environments: Environments) => Promise<T>): Promise<T> {
  return withStore(config, async (database) => {
    const environments = environmentsFor(config, database, pino({ level: 'warn' }, pino.destination(2)));
    try {
      return await fn(database, environments);
    } finally {
      await environments.close();
    }
  });
}

/** What every sandboxed process of this service may do (fork commands, environment setup). */
export function sandboxPolicyOf(config: Config): SandboxPolicy {
  return {
    hiddenPaths: [config.dataDir],
    allowUnsandboxed: config.allowUnsandboxed,
    allowHostNetwork: config.allowHostNetwork,
    memoryMiB: config.sandboxMemoryMib,
    cpuSeconds: config.sandboxCpuSeconds,
  };
}

/**
 * The fork lifecycle of this host's task forks (`dataDir/forks`). One per process: the executor acquires
 * and releases forks through it, and the scheduler ticks it.
 */
export function forkLifecycleFor(config: Config, database: Database, logger: Logger): ForkLifecycle {
  return new ForkLifecycle({
    database,
    // Per host: a data dir shared by several hosts keeps each host's forks apart.
    forksRoot: join(config.dataDir, 'forks', hostname()),
    host: hostname(),
    environmentsRoot: join(config.dataDir, 'environments'),
    policy: sandboxPolicyOf(config),
    durations: { idleStopMs: config.forkIdleStopMs, archiveMs: config.forkArchiveMs, deleteMs: config.forkDeleteMs },
    logger: logger.child({ component: 'forks' }),
  });
}

/** The workspace environments of this data dir, as every part of one process shares them. */
export function environmentsFor(config: Config, database: Database, logger: Logger): Environments {
  return new Environments({ db: database.db, dataDir: config.dataDir, policy: sandboxPolicyOf(config), logger: logger.child({ component: 'environments' }) });
}

/**
 * The scheduler of this process, started: the fork lifecycle's moves, environments catching up with
 * merges and dropping versions no fork uses, forks of ended workspace shell grants (and, later, automations).
 * The first two can take long (archives, setups): they run detached, so the rest never waits for them.
 */
function startScheduler(config: Config, database: Database, forks: ForkLifecycle, environments: Environments, logger: Logger): Scheduler {
  const scheduler = new Scheduler({
    tickMs: config.schedulerTickMs,
    work: [
      { name: 'fork-lifecycle', detached: true, run: () => forks.tick() },
      { name: 'environments', detached: true, run: () => environments.sweep() },
      { name: 'workspace-shells', run: () => expireWorkspaceShells({ db: database.db, dataDir: config.dataDir }) },
    ],
    logger: logger.child({ component: 'scheduler' }),
  });
  scheduler.start();
  return scheduler;
}

/**
 * Shutdown's first step: the long work of the environments (setups) and of the fork lifecycle stops, so
 * that stopping the scheduler, which waits for its work, does not wait for an install to finish.
 */
function abortBackgroundWork(forks: ForkLifecycle, environments: Environments): void {
  environments.abort();
  forks.abort();
}

/** Where people reach the service: SVC_PUBLIC_URL, or the address it listens on. */
export function publicUrlOf(config: Config, port: number = config.port): string {
  return (config.publicUrl ?? `http://${config.host.includes(':') ? `[${config.host}]` : config.host}:${port}`).replace(/\/+$/, '');
}

function makeExecutor(config: Config, database: Database, forks: ForkLifecycle, environments: Environments, publicUrl: string, logger: Logger): Executor | null {
  if (config.executorConcurrency === 0) return null;
  // How the sandboxes' network access works here: the operator should know before a job needs it.
  const network = describeOutsideNetwork(sandboxPolicyOf(config));
  if (slirp4netnsAvailable()) logger.info(network);
  else logger.warn(network);
  return new Executor({
    database,
    environments,
    publicUrl,
    forks,
    startDevServers,
    owner: `${hostname()}:${process.pid}`,
    concurrency: config.executorConcurrency,
    leaseMs: config.jobLeaseMs,
    pollMs: 5_000,
    runDir: join(config.dataDir, 'run'),
    logger: logger.child({ component: 'executor' }),
  });
}

/** `svc worker`: executors only, no HTTP (scaled deployments run these against PostgreSQL). */
export async function startWorker(config: Config, logger: Logger = pino({ level: config.logLevel })): Promise<{ close(): Promise<void> }> {
  const database = await openDatabase(storeLocation(config));
  const forks = forkLifecycleFor(config, database, logger);
  const environments = environmentsFor(config, database, logger);
  const executor = makeExecutor(config, database, forks, environments, publicUrlOf(config), logger);
  if (!executor) {
    await database.close();
    throw new Error('SVC_EXECUTOR_CONCURRENCY is 0: a worker with no executors has nothing to do');
  }
  await executor.start();
  const scheduler = startScheduler(config, database, forks, environments, logger);
  return {
    async close() {
      try {
        abortBackgroundWork(forks, environments);
        await scheduler.stop();
        await executor.stop();
        await environments.close();
      } finally {
        await database.close();
      }
    },
  };
}

export interface RunningService {
  app: FastifyInstance;
  database: Database;
  environments: Environments;
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
  let scheduler: Scheduler | null = null;
  try {
    const created = await admin.bootstrap(database.db, config.defaultAgent);
    const environments = environmentsFor(config, database, logger);
    app = await buildServer({
      database,
      publicUrl: publicUrlOf(config),
      dataDir: config.dataDir,
      environments,
      repoPaths: config.repoPaths,
      runnerRateLimits: { perMinute: config.runnerRateLimitPerMinute, perHour: config.runnerRateLimitPerHour },
      rateLimits: { perMinute: config.rateLimitPerMinute, perHour: config.rateLimitPerHour },
      logger,
      sandboxPolicy: sandboxPolicyOf(config),
      trustProxy: config.trustProxy,
    });
    await app.listen({ port: config.port, host: config.host });
    const address = app.server.address();
    const port = typeof address === 'object' && address ? address.port : config.port;
    const forks = forkLifecycleFor(config, database, logger);
    executor = makeExecutor(config, database, forks, environments, publicUrlOf(config, port), logger);
    await executor?.start();
    const runningExecutor = executor;
    const runningScheduler = startScheduler(config, database, forks, environments, logger);
    scheduler = runningScheduler;
    pruneTimer = setInterval(() => {
      pruneRateLimitBuckets(database.db).catch((error: unknown) => logger.warn({ err: error }, 'pruning rate limit buckets failed'));
    }, 5 * 60_000);
    pruneTimer.unref();
    const running = app;
    return {
      app: running,
      database,
      environments,
      url: `http://${config.host.includes(':') ? `[${config.host}]` : config.host}:${port}`,
      bootstrapKey: created?.key ?? null,
      async close() {
        if (pruneTimer) clearInterval(pruneTimer);
        try {
          abortBackgroundWork(forks, environments);
          await runningScheduler.stop();
          await runningExecutor?.stop();
          await running.close();
          await environments.close();
        } finally {
          await database.close();
        }
      },
    };
  } catch (error) {
    if (pruneTimer) clearInterval(pruneTimer);
    await scheduler?.stop().catch(() => undefined);
    await executor?.stop().catch(() => undefined);
    await app?.close().catch(() => undefined);
    await database.close();
    throw error;
  }
}
