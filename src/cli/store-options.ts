import type { Command } from 'commander';
import { loadConfig, type Config, type ConfigKey } from '../config.js';

/** Options every command that opens the store takes. */
export function addStoreOptions(command: Command): Command {
  return command
    .option('--data-dir <dir>', 'embedded database directory (SVC_DATA_DIR, default .svc)')
    .option('--database-url <url>', 'PostgreSQL URL (DATABASE_URL); an explicit --data-dir wins over the variable');
}

export function configFrom(options: Record<string, unknown>): Config {
  const flags: Partial<Record<ConfigKey, unknown>> = {};
  for (const [key, value] of Object.entries(options)) {
    if (value !== undefined) flags[key as ConfigKey] = value;
  }
  // An explicit --data-dir asks for the embedded database, even where DATABASE_URL is set around it.
  const env = flags.dataDir !== undefined && flags.databaseUrl === undefined ? { ...process.env, DATABASE_URL: undefined } : process.env;
  return loadConfig(flags, env);
}
