/**
 * Configuration: one zod schema, read once at start. Precedence: command-line flag > environment
 * variable > default. Every variable is listed here with what it does; docs/operations.md repeats them.
 */
import { isIP } from 'node:net';
import { resolve } from 'node:path';
import { z } from 'zod';
import { parseAgentId } from './domain/agents.js';

const LogLevel = z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']);

/** An IPv4 or IPv6 address, optionally with a prefix length that fits it (`10.0.0.0/8`, `fd00::/64`). */
function isAddressOrRange(entry: string): boolean {
  const [address = '', prefix, ...rest] = entry.split('/');
  const version = isIP(address);
  if (version === 0 || rest.length > 0) return false;
  if (prefix === undefined) return true;
  return /^\d{1,3}$/.test(prefix) && Number(prefix) <= (version === 4 ? 32 : 128);
}

export const ConfigSchema = z.object({
  /** SVC_PORT: the HTTP port (0 picks a free one). */
  port: z.coerce.number().int().min(0).max(65535).default(8080),
  /** SVC_HOST: the address to listen on. */
  host: z.string().min(1).default('127.0.0.1'),
  /** SVC_DATA_DIR: where the embedded database (PGlite) lives when no DATABASE_URL is set. */
  dataDir: z.string().min(1).default('.svc'),
  /** DATABASE_URL: a postgres:// URL; when set, PostgreSQL is used instead of the embedded database. */
  databaseUrl: z
    .string()
    .regex(/^postgres(ql)?:\/\//, 'must be a postgres:// or postgresql:// URL')
    .optional(),
  /** SVC_PUBLIC_URL: the address people reach the service at; task URLs are built from it. */
  publicUrl: z.url().optional(),
  /** SVC_LOG_LEVEL */
  logLevel: LogLevel.default('info'),
  /** SVC_DEFAULT_AGENT: the agent of the `default` routing config of new workspaces. */
  defaultAgent: z
    .string()
    .default('anthropic/claude-sonnet-4-5')
    .superRefine((value, context) => {
      const parsed = parseAgentId(value);
      if ('error' in parsed) context.addIssue({ code: 'custom', message: parsed.error });
    }),
  /** SVC_RATE_LIMIT_PER_MINUTE, SVC_RATE_LIMIT_PER_HOUR: per API key (SPEC.md "Limits"). */
  rateLimitPerMinute: z.coerce.number().int().min(1).default(100),
  rateLimitPerHour: z.coerce.number().int().min(1).default(1000),
  /** SVC_RUNNER_RATE_LIMIT_PER_MINUTE, SVC_RUNNER_RATE_LIMIT_PER_HOUR: per desktop runner connection. */
  runnerRateLimitPerMinute: z.coerce.number().int().min(1).default(1200),
  runnerRateLimitPerHour: z.coerce.number().int().min(1).default(36_000),
  /** SVC_DB_POOL_SIZE: connections per process to PostgreSQL. */
  dbPoolSize: z.coerce.number().int().min(1).max(200).default(10),
  /** SVC_EXECUTOR_CONCURRENCY: jobs this process runs at once (`svc server` and `svc worker`); 0: none. */
  executorConcurrency: z.coerce.number().int().min(0).max(64).default(2),
  /** SVC_JOB_LEASE_MS: how long a claimed job stays an executor's without renewal. */
  jobLeaseMs: z.coerce.number().int().min(1000).default(60_000),
  /** SVC_ALLOW_UNSANDBOXED: run agent commands without bubblewrap where it is missing (not recommended). */
  allowUnsandboxed: z
    .enum(['true', 'false', '1', '0'])
    .default('false')
    .transform((value) => value === 'true' || value === '1'),
  /**
   * SVC_ALLOW_HOST_NETWORK: where slirp4netns is missing, let sandboxed commands with network access share
   * the host's network (and so reach whatever listens on its loopback, this service's database included)
   * instead of failing. Not recommended.
   */
  allowHostNetwork: z
    .enum(['true', 'false', '1', '0'])
    .default('false')
    .transform((value) => value === 'true' || value === '1'),
  /** SVC_SANDBOX_MEMORY_MIB: address space of each sandboxed process (ulimit -v); 0: unlimited. */
  sandboxMemoryMib: z.coerce.number().int().min(0).default(4096),
  /** SVC_SANDBOX_CPU_SECONDS: CPU time of each sandboxed process (ulimit -t); 0: unlimited. */
  sandboxCpuSeconds: z.coerce.number().int().min(0).default(3600),
  /** SVC_FORK_IDLE_STOP_MS: an idle task fork's dev servers are stopped this long after its last use (SPEC.md "Limits"). */
  forkIdleStopMs: z.coerce.number().int().min(0).default(30 * 60_000),
  /** SVC_FORK_ARCHIVE_MS: a stopped fork is archived (a compressed tar of its changes) this long after it stopped. */
  forkArchiveMs: z.coerce.number().int().min(0).default(24 * 60 * 60_000),
  /** SVC_FORK_DELETE_MS: an archived fork is deleted this long after its last use. */
  forkDeleteMs: z.coerce.number().int().min(0).default(7 * 24 * 60 * 60_000),
  /** SVC_SCHEDULER_TICK_MS: how often the scheduler moves forks along their lifecycle. */
  schedulerTickMs: z.coerce.number().int().min(100).default(60_000),
  /**
   * SVC_REPO_PATHS: directories (comma-separated, absolute) under which `POST /api/v1/repos` may connect a
   * repository by its path on the server; none by default, since a workspace key must not read the
   * server's files. `svc admin repo add` takes any path.
   */
  repoPaths: z
    .string()
    .default('')
    .transform((value) => value.split(',').map((part) => part.trim()).filter(Boolean))
    .refine((paths) => paths.every((path) => path.startsWith('/')), 'must be absolute paths separated by commas'),
  /**
   * SVC_TRUST_PROXY: which proxies in front of the service may say who the client is (X-Forwarded-For,
   * -Proto, -Host). Empty (the default): none, the client is the TCP peer. `true`: any (only when nothing
   * but the proxy can reach the port); a number: that many proxy hops; otherwise addresses or CIDR ranges,
   * comma-separated. Sign-in throttling per network and the request logs use the client's address: behind
   * a load balancer without this, every client is the balancer.
   */
  trustProxy: z
    .string()
    .default('')
    .transform((value, context): boolean | number | string[] => {
      const text = value.trim();
      if (text === '' || text === 'false') return false;
      if (text === 'true') return true;
      if (/^\d+$/.test(text)) return Number(text);
      const entries = text.split(',').map((part) => part.trim()).filter(Boolean);
      const bad = entries.find((entry) => !isAddressOrRange(entry));
      if (bad !== undefined) {
        context.addIssue({ code: 'custom', message: `must be true, false, a hop count or IP addresses/CIDR ranges (not ${JSON.stringify(bad)})` });
        return z.NEVER;
      }
      return entries;
    }),
  /** SVC_SHUTDOWN_TIMEOUT_MS: how long SIGTERM waits for requests in flight. */
  shutdownTimeoutMs: z.coerce.number().int().min(0).default(10_000),
});
export type Config = z.infer<typeof ConfigSchema>;
export type ConfigKey = keyof Config;

const ENV: Record<ConfigKey, string> = {
  port: 'SVC_PORT',
  host: 'SVC_HOST',
  dataDir: 'SVC_DATA_DIR',
  databaseUrl: 'DATABASE_URL',
  publicUrl: 'SVC_PUBLIC_URL',
  logLevel: 'SVC_LOG_LEVEL',
  defaultAgent: 'SVC_DEFAULT_AGENT',
  rateLimitPerMinute: 'SVC_RATE_LIMIT_PER_MINUTE',
  rateLimitPerHour: 'SVC_RATE_LIMIT_PER_HOUR',
  runnerRateLimitPerMinute: 'SVC_RUNNER_RATE_LIMIT_PER_MINUTE',
  runnerRateLimitPerHour: 'SVC_RUNNER_RATE_LIMIT_PER_HOUR',
  dbPoolSize: 'SVC_DB_POOL_SIZE',
  shutdownTimeoutMs: 'SVC_SHUTDOWN_TIMEOUT_MS',
  trustProxy: 'SVC_TRUST_PROXY',
  repoPaths: 'SVC_REPO_PATHS',
  executorConcurrency: 'SVC_EXECUTOR_CONCURRENCY',
  jobLeaseMs: 'SVC_JOB_LEASE_MS',
  allowUnsandboxed: 'SVC_ALLOW_UNSANDBOXED',
  allowHostNetwork: 'SVC_ALLOW_HOST_NETWORK',
  sandboxMemoryMib: 'SVC_SANDBOX_MEMORY_MIB',
  sandboxCpuSeconds: 'SVC_SANDBOX_CPU_SECONDS',
  forkIdleStopMs: 'SVC_FORK_IDLE_STOP_MS',
  forkArchiveMs: 'SVC_FORK_ARCHIVE_MS',
  forkDeleteMs: 'SVC_FORK_DELETE_MS',
  schedulerTickMs: 'SVC_SCHEDULER_TICK_MS',
};

export class ConfigError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ConfigError';
  }
}

export function loadConfig(
  flags: Partial<Record<ConfigKey, unknown>> = {},
  env: NodeJS.ProcessEnv = process.env,
): Config {
  const raw: Record<string, unknown> = {};
  for (const key of Object.keys(ENV) as ConfigKey[]) {
    const fromEnv = env[ENV[key]];
    const value = flags[key] ?? (fromEnv === '' ? undefined : fromEnv);
    if (value !== undefined) raw[key] = value;
  }
  const parsed = ConfigSchema.safeParse(raw);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    const key = String(issue?.path[0] ?? '') as ConfigKey;
    const where = ENV[key] ? `${key} (--${kebab(key)} or ${ENV[key]})` : key;
    throw new ConfigError(`invalid configuration: ${where} ${issue?.message ?? 'is invalid'}`);
  }
  return { ...parsed.data, dataDir: resolve(parsed.data.dataDir) };
}

function kebab(key: string): string {
  return key.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`);
}

export function envVarOf(key: ConfigKey): string {
  return ENV[key];
}
