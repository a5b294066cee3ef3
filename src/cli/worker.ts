/** `svc worker`: runs job executors alone against the store (PostgreSQL in scaled deployments). */
import type { Command } from 'commander';
import pino from 'pino';
import { startWorker } from '../main.js';
import { addStoreOptions, configFrom } from './store-options.js';

export function registerWorker(program: Command): void {
  addStoreOptions(
    program
      .command('worker')
      .description('run job executors without the HTTP API (SVC_EXECUTOR_CONCURRENCY at once)')
      .option('--log-level <level>', 'fatal, error, warn, info, debug, trace or silent (SVC_LOG_LEVEL)'),
  ).action(async (options: Record<string, unknown>) => {
    const config = configFrom(options);
    const logger = pino({ level: config.logLevel });
    const worker = await startWorker(config, logger);
    logger.info({ concurrency: config.executorConcurrency }, 'svc worker is running');
    let stopping = false;
    const stop = (signal: string) => {
      if (stopping) return;
      stopping = true;
      logger.info({ signal }, 'shutting down');
      worker.close().then(
        () => process.exit(0),
        (error: unknown) => {
          logger.error({ err: error }, 'shutdown failed');
          process.exit(1);
        },
      );
    };
    process.on('SIGTERM', () => stop('SIGTERM'));
    process.on('SIGINT', () => stop('SIGINT'));
  });
}
