/** `svc server`: API, runner endpoints and (later) executor and scheduler in one process. */
import type { Command } from 'commander';
import pino from 'pino';
import { startService } from '../main.js';
import { addStoreOptions, configFrom } from './store-options.js';

export function registerServer(program: Command): void {
  addStoreOptions(
    program
      .command('server')
      .description('run the service: REST API on the embedded database or PostgreSQL')
      .option('--port <port>', 'port to listen on (SVC_PORT, default 8080)')
      .option('--host <host>', 'address to listen on (SVC_HOST, default 127.0.0.1)')
      .option('--public-url <url>', 'address people reach the service at (SVC_PUBLIC_URL)')
      .option('--trust-proxy <proxies>', 'proxies whose X-Forwarded-For names the client: true, a hop count, or addresses/CIDRs (SVC_TRUST_PROXY)')
      .option('--log-level <level>', 'fatal, error, warn, info, debug, trace or silent (SVC_LOG_LEVEL)'),
  ).action(async (options: Record<string, unknown>) => {
    const config = configFrom(options);
    const logger = pino({ level: config.logLevel });
    const service = await startService(config, logger);
    if (service.bootstrapKey) {
      process.stdout.write(
        `Created workspace "default" on a new database. Its API key is shown once, so store it now:\n${service.bootstrapKey}\n`,
      );
    }
    logger.info({ url: service.url, driver: service.database.driver, dataDir: config.databaseUrl ? undefined : config.dataDir }, 'svc is listening');

    let stopping = false;
    const stop = (signal: string) => {
      if (stopping) return;
      stopping = true;
      logger.info({ signal }, 'shutting down');
      const timer = setTimeout(() => {
        logger.error('shutdown timed out; exiting');
        process.exit(1);
      }, config.shutdownTimeoutMs);
      timer.unref();
      service.close().then(
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
