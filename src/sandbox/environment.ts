/**
 * The workspace environment (SPEC.md's long-lived development VM): one directory per workspace holding
 * the working copy of every connected repository, with its installed dependencies, and the environment
 * config at `.svc/environment.json`. The config lives inside the environment on purpose: the agent reads
 * it, and a `dev_env` run repairs it like any other file (its change is reviewed before it applies).
 *
 * ```json
 * { "network": false,
 *   "repositories": [{ "name": "acme/web", "dir": "web",
 *     "setup": ["npm ci"],
 *     "checks": [{ "name": "test", "command": "npm test" }],
 *     "devServers": [{ "name": "web", "command": "npm run dev -- --port $PORT", "healthPath": "/" }] }] }
 * ```
 */
import { join } from 'node:path';
import { z } from 'zod';

export const CONFIG_DIR = '.svc';
export const CONFIG_FILE = join(CONFIG_DIR, 'environment.json');

export const CheckSpec = z.object({
  /** `test`, `lint`, `typecheck`, `build`, or any name. */
  name: z.string().min(1).max(100),
  /** A shell command run in the repository's directory. */
  command: z.string().min(1),
  timeoutSeconds: z.number().int().min(1).max(3600).default(600),
});
export type CheckSpec = z.infer<typeof CheckSpec>;

export const DevServerSpec = z.object({
  name: z.string().regex(/^[A-Za-z0-9_-]{1,64}$/, 'letters, digits, - and _'),
  /** A shell command run in the repository's directory; it must listen on `$PORT`. */
  command: z.string().min(1),
  /** The port the server prefers; a free one is chosen where it is taken. */
  port: z.number().int().min(1).max(65535).optional(),
  /** Polled with GET until it answers below 500. */
  healthPath: z.string().startsWith('/').default('/'),
  startTimeoutSeconds: z.number().int().min(1).max(600).default(60),
});
export type DevServerSpec = z.infer<typeof DevServerSpec>;

export const RepositorySpec = z.object({
  /** `owner/repo`, as connected with `svc admin repo add`. */
  name: z.string().regex(/^[A-Za-z0-9_.-]+\/[A-Za-z0-9_.-]+$/, 'must be owner/repo'),
  /** Its directory in the environment (one path segment). */
  dir: z.string().regex(/^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$/, 'one path segment of letters, digits, _ . -'),
  /** Commands that install its dependencies, run once when it is connected and by `dev_env` repairs. */
  setup: z.array(z.string().min(1)).default([]),
  checks: z.array(CheckSpec).default([]),
  devServers: z.array(DevServerSpec).default([]),
});
export type RepositorySpec = z.infer<typeof RepositorySpec>;

export const EnvironmentConfig = z.object({
  /** Whether the agent's commands may reach the network (off by default). */
  network: z.boolean().default(false),
  repositories: z.array(RepositorySpec).default([]),
});
export type EnvironmentConfig = z.infer<typeof EnvironmentConfig>;

export class EnvironmentConfigError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'EnvironmentConfigError';
  }
}

/** Where a workspace's environment lives in the data dir. */
export function environmentDir(dataDir: string, workspaceId: string): string {
  return join(dataDir, 'environments', workspaceId);
}

/** Parses config text (from the environment or a fork); a bad file is an error that names what is wrong. */
export function parseEnvironmentConfig(text: string | null): EnvironmentConfig {
  if (text === null) return EnvironmentConfig.parse({});
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (error) {
    throw new EnvironmentConfigError(`${CONFIG_FILE} is not valid JSON: ${(error as Error).message}`);
  }
  const parsed = EnvironmentConfig.safeParse(json);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    throw new EnvironmentConfigError(`${CONFIG_FILE}: ${issue.path.join('.') || '(root)'} ${issue.message}`);
  }
  const dirs = new Set<string>();
  for (const repository of parsed.data.repositories) {
    if (dirs.has(repository.dir)) throw new EnvironmentConfigError(`${CONFIG_FILE}: two repositories use the directory ${repository.dir}`);
    dirs.add(repository.dir);
  }
  return parsed.data;
}

