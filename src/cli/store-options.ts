import type { Command } from 'commander';
import { loadConfig, type Config, type ConfigKey } from '../config.js';

/** Options every command that opens the store takes. */
export function addStoreOptions(command: Command): Command {
  return command
    .option('--data-dir <dir>', 'embedded database directory (SVC_DATA_DIR, default .svc)')
    .option('--database-url <url>', 'PostgreSQL URL (DATABASE_URL); overrides --data-dir');
}

export function configFrom(options: Record<string, unknown>): Config {
  const flags: Partial<Record<ConfigKey, unknown>> = {};
  for (const [key, value] of Object.entries(options)) {
    if (value !== undefined) flags[key as ConfigKey] = value;
  }
  return loadConfig(flags);
}
