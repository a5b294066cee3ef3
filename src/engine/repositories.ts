/**
 * Connecting repositories to a workspace (`svc admin repo add`), and the workspace environment they live
 * in. The environment directory is itself a git repository, `svc/environment`, holding the environment
 * config (`.svc/environment.json`) and ignoring the working copies beside it: a `dev_env` run changes it
 * through a pull request like any other repository, and merging that pull request applies it.
 */
import { existsSync } from 'node:fs';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { basename, join, resolve } from 'node:path';
import { FULL_NAME, LocalCodeHost } from '../codehost/local.js';
import { git, revParse } from '../codehost/git.js';
import { TRANSFER_DIR } from './delivery.js';
import { ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import type { Db } from '../store/db.js';
import { findRepository, insertRepository, listRepositories, type RepositoryRow } from '../store/repositories.js';
import { findWorkspaceByName, type Workspace } from '../store/workspaces.js';
import { bumpEnvironmentVersion, directSandbox, type SandboxPolicy } from '../sandbox/fork.js';
import {
  environmentDir,
  readEnvironmentConfig,
  writeEnvironmentConfig,
  CONFIG_FILE,
  type CheckSpec,
  type RepositorySpec,
} from '../sandbox/environment.js';

/** The environment's own repository: its config, reviewed like code. */
export const ENVIRONMENT_REPOSITORY = 'svc/environment';
export const ENVIRONMENT_DIR = '.';

/** `owner/repo` from a git URL (`https://host/owner/repo.git`, `git@host:owner/repo`), or null. */
export function fullNameFromUrl(source: string): string | null {
  const match = /^(?:[a-z][a-z0-9+.-]*:\/\/[^/]+\/|[^@/:\s]+@[^:/\s]+:)(?:.*\/)?([^/]+)\/([^/]+?)(?:\.git)?\/?$/i.exec(source);
  if (!match) return null;
  const name = `${match[1]}/${match[2]}`;
  return FULL_NAME.test(name) ? name : null;
}

/** Checks a repository offers, read from its package.json scripts (the operator edits them later). */
async function detectChecks(dir: string): Promise<{ setup: string[]; checks: CheckSpec[] }> {
  const manifest = join(dir, 'package.json');
  if (!existsSync(manifest)) return { setup: [], checks: [] };
  let manifestJson: { scripts?: Record<string, unknown>; dependencies?: object; devDependencies?: object };
  try {
    manifestJson = JSON.parse(await readFile(manifest, 'utf8')) as typeof manifestJson;
  } catch {
    return { setup: [], checks: [] };
  }
  const scripts = manifestJson.scripts ?? {};
  const checks = ['lint', 'typecheck', 'test', 'build']
    .filter((name) => typeof scripts[name] === 'string')
    .map((name) => ({ name, command: name === 'test' ? 'npm test' : `npm run ${name}`, timeoutSeconds: 600 }));
  // Dependencies go in as the lock file says; without one, installing must not write one into the
  // working copy (every fork would then show it as a change).
  const hasDependencies = Object.keys({ ...(manifestJson.dependencies ?? {}), ...(manifestJson.devDependencies ?? {}) }).length > 0;
  const setup = existsSync(join(dir, 'package-lock.json')) ? ['npm ci'] : hasDependencies ? ['npm install --no-package-lock'] : [];
  return { setup, checks };
}

async function requireWorkspace(db: Db, name: string): Promise<Workspace> {
  const workspace = await findWorkspaceByName(db, name);
  if (!workspace) throw new NotFoundError(`workspace "${name}" does not exist`);
  return workspace;
}

/** Commits what changed in the environment repository and publishes it to the code host. */
async function publishEnvironment(environment: string, message: string): Promise<void> {
  await git(['add', '-A'], { cwd: environment });
  const staged = await git(['diff', '--cached', '--name-only'], { cwd: environment });
  if (!staged.trim()) return;
  await git(['commit', '--quiet', '-m', message], { cwd: environment });
  await git(['push', '--quiet', 'origin', 'HEAD:refs/heads/main'], { cwd: environment });
}

/**
 * Makes the workspace's environment (directory, config, its repository on the code host) if it is not
 * there yet; answers its directory.
 */
export async function ensureEnvironment(db: Db, dataDir: string, workspace: Workspace): Promise<string> {
  const environment = environmentDir(dataDir, workspace.id);
  if (await findRepository(db, workspace.id, ENVIRONMENT_REPOSITORY)) return environment;
  // Jobs of one workspace may start together on a new environment: one of them makes it.
  const key = `${dataDir}\0${workspace.id}`;
  let making = environmentsInTheMaking.get(key);
  if (!making) {
    making = makeEnvironment(db, environment, dataDir, workspace).finally(() => environmentsInTheMaking.delete(key));
    environmentsInTheMaking.set(key, making);
  }
  await making;
  return environment;
}

const environmentsInTheMaking = new Map<string, Promise<void>>();

async function makeEnvironment(db: Db, environment: string, dataDir: string, workspace: Workspace): Promise<void> {
  const host = new LocalCodeHost(dataDir);
  await mkdir(environment, { recursive: true });
  if (!existsSync(join(environment, '.git'))) await git(['init', '--quiet', '--initial-branch=main'], { cwd: environment });
  if (!existsSync(join(environment, CONFIG_FILE))) await writeEnvironmentConfig(environment, await readEnvironmentConfig(environment));
  if (!existsSync(join(environment, '.gitignore'))) {
    await writeFile(join(environment, '.gitignore'), `# svc's transfers, and the working copies of the connected repositories\n/${TRANSFER_DIR}/\n`);
  }
  await git(['add', '-A'], { cwd: environment });
  if (!(await revParse(environment, 'HEAD'))) await git(['commit', '--quiet', '-m', 'The workspace environment'], { cwd: environment });
  const path = host.repositoryPath(workspace.id, ENVIRONMENT_REPOSITORY);
  if (!existsSync(path)) await host.importRepository(workspace.id, ENVIRONMENT_REPOSITORY, environment);
  await git(['remote', 'remove', 'origin'], { cwd: environment }).catch(() => undefined);
  await git(['remote', 'add', 'origin', path], { cwd: environment });
  await insertRepository(db, { workspaceId: workspace.id, fullName: ENVIRONMENT_REPOSITORY, dir: ENVIRONMENT_DIR, defaultBranch: 'main', source: environment });
}

export interface SetupResult {
  repository: string;
  command: string;
  passed: boolean;
  exitCode: number | null;
  /** The last lines of its output. */
  outputTail: string;
}

/** How long one setup command may take (dependency installs are slow). */
const SETUP_TIMEOUT_MS = 30 * 60_000;

/**
 * Runs repositories' setup commands in the environment itself (in bubblewrap, with network: installing
 * dependencies needs it), stopping at a repository's first failure. Later forks start from the result.
 */
export async function runSetup(environment: string, specs: readonly RepositorySpec[], policy: SandboxPolicy): Promise<SetupResult[]> {
  const sandbox = directSandbox(environment, policy);
  const results: SetupResult[] = [];
  if (specs.some((spec) => spec.setup.length > 0)) await bumpEnvironmentVersion(environment);
  for (const spec of specs) {
    for (const command of spec.setup) {
      const result = await sandbox.run(['sh', '-c', `exec 2>&1\n${command}`], { cwd: spec.dir, network: true, timeoutMs: SETUP_TIMEOUT_MS });
      const passed = result.exitCode === 0 && !result.timedOut;
      results.push({ repository: spec.name, command, passed, exitCode: result.exitCode, outputTail: result.stdout.trimEnd().split('\n').slice(-20).join('\n') });
      if (!passed) break;
    }
  }
  return results;
}

/** `svc admin repo setup`: runs every repository's setup again (after the config changed). */
export async function setupEnvironment(db: Db, dataDir: string, workspaceName: string, policy: SandboxPolicy): Promise<SetupResult[]> {
  const workspace = await requireWorkspace(db, workspaceName);
  const environment = await ensureEnvironment(db, dataDir, workspace);
  return runSetup(environment, (await readEnvironmentConfig(environment)).repositories, policy);
}

export interface AddRepositoryInput {
  dataDir: string;
  workspace: string;
  /** A git URL or a local path. */
  source: string;
  /** `owner/repo`; derived from a URL, or `local/<directory name>` for a path, when absent. */
  fullName?: string;
  /** Runs the detected setup commands in this sandbox policy; without it, none run. */
  setup?: SandboxPolicy;
}

/**
 * Connects a repository: its bare copy on the code host becomes its origin, its working copy goes into
 * the environment, and the environment config gets an entry with the checks its package.json offers.
 */
export async function addRepository(db: Db, input: AddRepositoryInput): Promise<{ repository: RepositoryRow; spec: RepositorySpec; setup: SetupResult[] }> {
  const source = input.source.trim();
  if (!source) throw ValidationError.field('source', 'must be a git URL or a path');
  const isUrl = fullNameFromUrl(source) !== null;
  const localPath = isUrl ? null : resolve(source);
  if (localPath && !existsSync(localPath)) throw ValidationError.field('source', `${source} is neither a git URL nor an existing path`);
  const fullName = input.fullName ?? fullNameFromUrl(source) ?? `local/${basename(localPath ?? source).replace(/\.git$/, '')}`;
  if (!FULL_NAME.test(fullName) || fullName.split('/').some((part) => part === '.' || part === '..')) {
    throw ValidationError.field('name', 'must be owner/repo: letters, digits, "_", "." and "-"');
  }
  if (fullName === ENVIRONMENT_REPOSITORY) throw ValidationError.field('name', `${ENVIRONMENT_REPOSITORY} is the environment's own repository`);

  const workspace = await requireWorkspace(db, input.workspace);
  const environment = await ensureEnvironment(db, input.dataDir, workspace);
  if (await findRepository(db, workspace.id, fullName)) throw new ConflictError(`${fullName} is already connected to "${workspace.name}"`);
  const taken = new Set((await listRepositories(db, workspace.id)).map((repository) => repository.dir));
  const [owner, repo] = fullName.split('/') as [string, string];
  const dir = [repo, `${owner}-${repo}`].find((candidate) => !taken.has(candidate) && !existsSync(join(environment, candidate)));
  if (!dir) throw new ConflictError(`the environment already has directories named ${repo} and ${owner}-${repo}`);

  const host = new LocalCodeHost(input.dataDir);
  if (existsSync(host.repositoryPath(workspace.id, fullName))) throw new ConflictError(`the code host already has ${fullName}`);
  const { path, defaultBranch } = await host.importRepository(workspace.id, fullName, localPath ?? source);
  const workingCopy = join(environment, dir);
  try {
    await git(['clone', '--quiet', '--', path, workingCopy]);
    const repository = await insertRepository(db, { workspaceId: workspace.id, fullName, dir, defaultBranch, source: localPath ?? source });
    if (!repository) throw new ConflictError(`${fullName} is already connected to "${workspace.name}"`);
    const config = await readEnvironmentConfig(environment);
    const spec: RepositorySpec = { name: fullName, dir, ...(await detectChecks(workingCopy)), devServers: [] };
    await writeEnvironmentConfig(environment, { ...config, repositories: [...config.repositories.filter((entry) => entry.dir !== dir), spec] });
    const ignore = join(environment, '.gitignore');
    await writeFile(ignore, `${(await readFile(ignore, 'utf8')).trimEnd()}\n/${dir}/\n`);
    await publishEnvironment(environment, `Connect ${fullName}`);
    // A failed setup leaves the repository connected: the operator (or a dev_env run) repairs it.
    const setup = input.setup ? await runSetup(environment, [spec], input.setup) : [];
    return { repository, spec, setup };
  } catch (error) {
    await rm(workingCopy, { recursive: true, force: true });
    await host.removeRepository(workspace.id, fullName);
    throw error;
  }
}

export async function workspaceRepositories(db: Db, workspaceName: string): Promise<RepositoryRow[]> {
  return listRepositories(db, (await requireWorkspace(db, workspaceName)).id);
}
