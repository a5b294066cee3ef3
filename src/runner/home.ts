/**
 * The runner's home: everything `svc runner` keeps on the computer, readable by the user only (0700).
 *
 *   connection.json   the server, runner id and credential (0600)
 *   projects.json     registered projects, with their absolute paths (which never leave this folder)
 *   models.json       optional, written by the user: model lists per harness (discovery.ts)
 *   daemon.lock       the daemon's exclusive lock (lock.ts)
 *   runs/<run id>/    a claimed run's phase, outbox and process groups (run-state.ts, outbox.ts)
 *   quarantine/       run folders whose state was damaged, moved aside as they were (run-state.ts)
 *   worktrees/<task>/ a task's folder: one git worktree per repository of its project (worktree.ts)
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, closeSync, fsyncSync, mkdirSync, openSync, readFileSync, renameSync, rmSync, writeSync } from 'node:fs';
import { homedir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { z } from 'zod';
import { HarnessId, ModelEntry, ProjectRepository, RunnerCredential } from '../protocol/runner.js';

export const DEFAULT_SERVER = 'http://127.0.0.1:8080/api/v1';

/** `--home` > SVC_RUNNER_HOME > ~/.svc-runner. */
export function resolveHome(flag: string | undefined, env: NodeJS.ProcessEnv = process.env): string {
  return resolve(flag || env.SVC_RUNNER_HOME || join(homedir(), '.svc-runner'));
}

/** `--server` > SERVICE_BASE_URL > the local default; the REST base URL, ending in /api/v1. */
export function resolveServer(flag: string | undefined, env: NodeJS.ProcessEnv = process.env): string {
  const value = (flag || env.SERVICE_BASE_URL || DEFAULT_SERVER).replace(/\/+$/, '');
  if (!/^https?:\/\//.test(value) || !URL.canParse(value)) throw new HomeError(`the server ${value} is not an http(s) URL`);
  return value;
}

export class HomeError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'HomeError';
  }
}

export const Connection = z.object({
  /** The REST base URL (ending in /api/v1). */
  server: z.string(),
  runnerId: z.uuid(),
  userId: z.uuid(),
  workspaceId: z.uuid(),
  name: z.string(),
  credential: RunnerCredential,
  heartbeatIntervalMs: z.number().int().min(1),
  enrolledAt: z.string(),
});
export type Connection = z.infer<typeof Connection>;

export const LocalRepository = ProjectRepository.extend({
  /** The repository's absolute path on this computer: never sent. */
  path: z.string(),
  /** Its folder name inside a task's folder. */
  dir: z.string().regex(/^[^/\\]+$/),
});
export type LocalRepository = z.infer<typeof LocalRepository>;

/** A registered project as the home keeps it; `registrationOf` is what the server sees. */
export const LocalProject = z.object({
  id: z.uuid(),
  name: z.string(),
  /** The absolute path that was added: never sent. */
  path: z.string(),
  /** Empty: the projectless environment. */
  repositories: z.array(LocalRepository),
});
export type LocalProject = z.infer<typeof LocalProject>;

const ProjectsFile = z.object({ projects: z.array(LocalProject) });

/** models.json: per harness, model ids or `{ id, name }`. */
const ModelsFile = z.record(HarnessId, z.array(z.union([z.string().min(1).max(200), ModelEntry])));

/** Writes a file whole or not at all: a crash leaves the old content or the new one. */
export function writeFileAtomic(path: string, content: string | Buffer, mode = 0o600): void {
  mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
  const temporary = `${path}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`;
  const fd = openSync(temporary, 'w', mode);
  try {
    writeSync(fd, typeof content === 'string' ? Buffer.from(content) : content);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  try {
    renameSync(temporary, path);
  } catch (error) {
    rmSync(temporary, { force: true });
    throw error;
  }
  syncDir(dirname(path));
}

/** Makes a rename or a new file in `dir` durable. */
export function syncDir(dir: string): void {
  const fd = openSync(dir, 'r');
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/**
 * A JSON file of the runner's home read and checked against `schema`: null when it does not exist; a
 * read that fails (too many open files, a failing disk) is thrown as it is; content that is not JSON or
 * not of the schema is damage, thrown as `damaged(problem)`.
 */
export function readJsonFile<T>(path: string, schema: z.ZodType<T>, damaged: (problem: string) => Error): T | null {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw error;
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch (error) {
    throw damaged(`not JSON: ${(error as Error).message}`);
  }
  const result = schema.safeParse(parsed);
  if (!result.success) throw damaged(result.error.issues.map((issue) => `${issue.path.join('.') || '(root)'} ${issue.message}`).join('; '));
  return result.data;
}

function readJson<T>(path: string, schema: z.ZodType<T>, what: string): T | null {
  return readJsonFile(path, schema, (problem) => new HomeError(`${path} is not a valid ${what}: ${problem}`));
}

export class RunnerHome {
  readonly dir: string;

  constructor(dir: string) {
    this.dir = resolve(dir);
  }

  /** Creates the home (0700), or tightens an existing one. */
  ensure(): this {
    mkdirSync(this.dir, { recursive: true, mode: 0o700 });
    chmodSync(this.dir, 0o700);
    return this;
  }

  get connectionFile(): string {
    return join(this.dir, 'connection.json');
  }

  get projectsFile(): string {
    return join(this.dir, 'projects.json');
  }

  get modelsFile(): string {
    return join(this.dir, 'models.json');
  }

  get lockFile(): string {
    return join(this.dir, 'daemon.lock');
  }

  get runsDir(): string {
    return join(this.dir, 'runs');
  }

  get quarantineDir(): string {
    return join(this.dir, 'quarantine');
  }

  runDir(runId: string): string {
    return join(this.runsDir, z.uuid().parse(runId));
  }

  get worktreesDir(): string {
    return join(this.dir, 'worktrees');
  }

  /** A task's folder: its worktrees, or its plain folder in the projectless environment. */
  taskDir(taskId: string): string {
    return join(this.worktreesDir, z.uuid().parse(taskId));
  }

  readConnection(): Connection | null {
    return readJson(this.connectionFile, Connection, 'runner connection');
  }

  /** The connection, or a one-line reason to pair first. */
  requireConnection(): Connection {
    const connection = this.readConnection();
    if (!connection) throw new HomeError(`this computer is not paired (no connection in ${this.dir}); run: svc runner pair`);
    return connection;
  }

  writeConnection(connection: Connection): void {
    this.ensure();
    writeFileAtomic(this.connectionFile, `${JSON.stringify(Connection.parse(connection), null, 2)}\n`, 0o600);
  }

  readProjects(): LocalProject[] {
    return readJson(this.projectsFile, ProjectsFile, 'project list')?.projects ?? [];
  }

  writeProjects(projects: LocalProject[]): void {
    this.ensure();
    writeFileAtomic(this.projectsFile, `${JSON.stringify({ projects }, null, 2)}\n`, 0o600);
  }

  /** The user's model lists per harness, or null without a models.json. */
  readModelsConfig(): Record<string, Model[]> | null {
    const file = readJson(this.modelsFile, ModelsFile, 'model list (models.json)');
    if (!file) return null;
    return Object.fromEntries(
      Object.entries(file).map(([harness, models]) => [harness, models.map((model) => (typeof model === 'string' ? { id: model, name: model } : model))]),
    );
  }
}

type Model = z.infer<typeof ModelEntry>;
