/**
 * Connecting repositories to a workspace (`svc admin repo add`, `POST /api/v1/repos`): the code host gets
 * a bare copy, and the workspace environment (environments.ts) a working copy and a config entry.
 */
import { existsSync, lstatSync, readFileSync, realpathSync } from 'node:fs';
import { basename, isAbsolute, join, resolve } from 'node:path';
import { GitError } from '../codehost/git.js';
import { FULL_NAME, RepositoryExistsError, type LocalCodeHost } from '../codehost/local.js';
import { ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import type { Db } from '../store/db.js';
import { findRepository, insertRepository, listRepositories, type RepositoryRow } from '../store/repositories.js';
import { findWorkspace, findWorkspaceByName, type Workspace } from '../store/workspaces.js';
import type { RepositorySpec } from '../sandbox/environment.js';
import { ENVIRONMENT_REPOSITORY, type Environments, type SetupResult } from './environments.js';

export { ENVIRONMENT_REPOSITORY, ENVIRONMENT_DIR, type SetupResult } from './environments.js';

/** `owner/repo` from a git URL (`https://host/owner/repo.git`, `git@host:owner/repo`), or null. */
export function fullNameFromUrl(source: string): string | null {
  const match = /^(?:[a-z][a-z0-9+.-]*:\/\/[^/]+\/|[^@/:\s]+@[^:/\s]+:)(?:.*\/)?([^/]+)\/([^/]+?)(?:\.git)?\/?$/i.exec(source);
  if (!match) return null;
  const name = `${match[1]}/${match[2]}`;
  return FULL_NAME.test(name) ? name : null;
}

async function requireWorkspace(db: Db, name: string): Promise<Workspace> {
  const workspace = await findWorkspaceByName(db, name);
  if (!workspace) throw new NotFoundError(`workspace "${name}" does not exist`);
  return workspace;
}

/** `svc admin repo setup`: runs every repository's setup again (after the config changed). */
export async function setupEnvironment(db: Db, environments: Environments, workspaceName: string): Promise<SetupResult[]> {
  const workspace = await requireWorkspace(db, workspaceName);
  await environments.ensure(workspace);
  return (await environments.setup(workspace.id)).results;
}

/**
 * Where a repository comes from, decided once (`parseSource`): a remote URL that only git's network
 * transports may fetch, or a local directory by its real path (links resolved), which is what gets
 * cloned. Nothing that was taken for a URL is ever read as a path, and the other way round.
 */
export type RepositorySource = { kind: 'url'; url: string } | { kind: 'path'; realPath: string };

/** Git remotes: the network transports, never `file://`, git's `ext::` or another `<transport>::`. */
const REMOTE_URL = /^(?:(?:https?|ssh|git):\/\/[^/\s]+\/\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^\s]+)$/;
/** The transports a remote URL's clone may use (git's `protocol.<name>.allow`, also on redirects). */
const REMOTE_PROTOCOLS = ['https', 'http', 'ssh', 'git'] as const;
/** Looks like a URL rather than a path to git: `scheme://`, `transport::address`, or `host:path` with no `/` before the colon. */
const URL_SHAPED = /^[A-Za-z][A-Za-z0-9+.-]*(?::\/\/|::)|^[^/]*:/;
const URL_FORMS = 'a git URL (https://, http://, ssh://, git:// or user@host:path)';

/** Why a URL-shaped source is refused, or null: it must be a network remote whose path never climbs. */
function remoteUrlProblem(url: string): string | null {
  if (!REMOTE_URL.test(url)) return `must be ${URL_FORMS}; file://, ext:: and other local transports are refused`;
  const scheme = /^[a-z]+:\/\/([^/]+)(\/.*)$/i.exec(url);
  const [authority, path] = scheme ? [scheme[1]!, scheme[2]!] : [url.slice(0, url.indexOf(':')), url.slice(url.indexOf(':') + 1)];
  // An option in disguise (`-oProxyCommand=…`) must never reach ssh, whatever git makes of it.
  if (authority.split('@').some((part) => part.startsWith('-'))) return 'must not have a user or host that starts with "-"';
  let decoded: string;
  try {
    decoded = decodeURIComponent(path);
  } catch {
    return 'has a malformed %-escape';
  }
  if ([path, decoded].some((text) => text.split(/[/\\]/).includes('..'))) return 'must not contain ".." path segments';
  return null;
}

/**
 * Decides once what a source is. A URL-shaped one must be a network remote (see `remoteUrlProblem`); any
 * other must be an existing path, resolved (relative to the working directory) to its real location.
 */
export function parseSource(source: string): RepositorySource {
  const trimmed = source.trim();
  if (!trimmed) throw ValidationError.field('source', 'must be a git URL or a path');
  if (trimmed.startsWith('-')) throw ValidationError.field('source', 'must not start with "-"');
  if (URL_SHAPED.test(trimmed) || REMOTE_URL.test(trimmed)) {
    const problem = remoteUrlProblem(trimmed);
    if (problem) throw ValidationError.field('source', problem);
    return { kind: 'url', url: trimmed };
  }
  const path = resolve(trimmed);
  if (!existsSync(path)) throw ValidationError.field('source', `${trimmed} is neither a git URL nor an existing path`);
  return { kind: 'path', realPath: realpathSync(path) };
}

export interface AddRepositoryInput {
  /** The workspace's name (operators) or the workspace itself (the API). */
  workspace: string | Workspace;
  /** A git URL or a local path (an operator's, parsed here), or a source the caller parsed and checked. */
  source: string | RepositorySource;
  /** `owner/repo`; derived from a URL, or `local/<directory name>` for a path, when absent. */
  fullName?: string;
  /** Runs the detected setup commands now. */
  setup: boolean;
}

/**
 * Connects a repository: its bare copy on the code host becomes its origin, its working copy goes into
 * the environment, and the environment config gets an entry with the checks its package.json offers.
 */
export async function addRepository(
  db: Db,
  environments: Environments,
  input: AddRepositoryInput,
): Promise<{ repository: RepositoryRow; spec: RepositorySpec; setup: SetupResult[] }> {
  const source = typeof input.source === 'string' ? parseSource(input.source) : input.source;
  const location = source.kind === 'url' ? source.url : source.realPath;
  const fullName = input.fullName ?? (source.kind === 'url' ? fullNameFromUrl(source.url) : `local/${basename(source.realPath).replace(/\.git$/, '')}`);
  if (fullName === null) throw ValidationError.field('name', 'cannot be derived from this URL: give the repository\'s owner/repo');
  if (!FULL_NAME.test(fullName) || fullName.split('/').some((part) => part === '.' || part === '..')) {
    throw ValidationError.field('name', 'must be owner/repo: letters, digits, "_", "." and "-"');
  }
  if (fullName === ENVIRONMENT_REPOSITORY) throw ValidationError.field('name', `${ENVIRONMENT_REPOSITORY} is the environment's own repository`);

  const workspace = typeof input.workspace === 'string' ? await requireWorkspace(db, input.workspace) : input.workspace;
  await environments.ensure(workspace);
  if (await findRepository(db, workspace.id, fullName)) throw new ConflictError(`${fullName} is already connected to "${workspace.name}"`);
  const host = environments.codeHost;
  if (existsSync(host.repositoryPath(workspace.id, fullName))) throw new ConflictError(`the code host already has ${fullName}`);
  const { defaultBranch } = await importSource(host, workspace.id, fullName, source);
  try {
    const connected = await environments.connect(workspace, { fullName, defaultBranch, setup: input.setup });
    const repository = await insertRepository(db, { workspaceId: workspace.id, fullName, dir: connected.spec.dir, defaultBranch, source: location });
    if (!repository) throw new ConflictError(`${fullName} is already connected to "${workspace.name}"`);
    // A failed setup leaves the repository connected: the operator (or a dev_env run) repairs it.
    return { repository, spec: connected.spec, setup: connected.setup };
  } catch (error) {
    await host.removeRepository(workspace.id, fullName);
    throw error;
  }
}

/**
 * The bare copy on the code host. A path is cloned through git's transport (`--no-local`: never hardlinks
 * or a copy of whatever its `.git` points at) with only the file protocol allowed; a URL with only the
 * network ones. A source git cannot clone is bad input, not a server error.
 */
async function importSource(host: LocalCodeHost, workspaceId: string, fullName: string, source: RepositorySource): Promise<{ defaultBranch: string }> {
  const location = source.kind === 'url' ? source.url : source.realPath;
  try {
    return await host.importRepository(workspaceId, fullName, location, { protocols: source.kind === 'url' ? REMOTE_PROTOCOLS : ['file'] });
  } catch (error) {
    if (error instanceof RepositoryExistsError) throw new ConflictError(error.message);
    if (error instanceof GitError || /has no commits/.test((error as Error).message)) {
      throw ValidationError.field('source', `${location} could not be cloned with git: ${(error as Error).message.replace(/^git .*? failed: /, '')}`);
    }
    throw error;
  }
}

/** Whether `path` (real) is one of the real `roots` or below one. */
function underRoots(path: string, roots: readonly string[]): boolean {
  return roots.some((root) => path === root || path.startsWith(`${root}/`));
}

/**
 * The repository's own git directory, real: the directory itself (bare), or where its `.git` leads (a
 * directory, a link, or a `gitdir:` file as worktrees and submodules have), and that one's common
 * directory. Null when one of them cannot be read.
 */
function gitDirsOf(realPath: string): string[] | null {
  try {
    const dotGit = join(realPath, '.git');
    const entry = lstatSync(dotGit, { throwIfNoEntry: false });
    let gitDir = realPath;
    if (entry?.isFile()) {
      const pointer = /^gitdir:\s*(.+?)\s*$/m.exec(readFileSync(dotGit, 'utf8'))?.[1];
      if (!pointer) return null;
      gitDir = realpathSync(resolve(realPath, pointer));
    } else if (entry) {
      gitDir = realpathSync(dotGit);
    }
    const common = join(gitDir, 'commondir');
    if (!existsSync(common)) return [gitDir];
    return [gitDir, realpathSync(resolve(gitDir, readFileSync(common, 'utf8').trim()))];
  } catch {
    return null;
  }
}

/**
 * `POST /api/v1/repos`: connects a repository to the caller's workspace from a git URL, or from a path on
 * the server only under one of the roots the operator allowed (SVC_REPO_PATHS): a workspace key must not
 * read the server's files. The path's real location (links resolved) and the git directory it uses must
 * both be under a root, and that real location is what gets cloned.
 */
export async function connectRepository(
  db: Db,
  environments: Environments,
  caller: { workspaceId: string },
  body: { source: string; name?: string | undefined; setup: boolean },
  allowedPaths: readonly string[],
): Promise<{ repository: RepositoryRow; setup: SetupResult[] }> {
  const trimmed = body.source.trim();
  const outside = 'paths on the server are accepted only under the roots the operator allows (SVC_REPO_PATHS)';
  const pathShaped = !trimmed.startsWith('-') && !URL_SHAPED.test(trimmed) && !REMOTE_URL.test(trimmed);
  if (pathShaped && !isAbsolute(trimmed)) throw ValidationError.field('source', `must be ${URL_FORMS} or an absolute path`);
  // A path says where it is plainly: no climbing, even when it would land under a root again.
  if (pathShaped && trimmed.split('/').includes('..')) throw ValidationError.field('source', 'must not contain ".." path segments');
  let source: RepositorySource;
  try {
    source = parseSource(trimmed);
  } catch (error) {
    // A path that does not exist is outside as far as the caller may know: no probing the server's files.
    if (error instanceof ValidationError && isAbsolute(trimmed) && !URL_SHAPED.test(trimmed)) throw ValidationError.field('source', outside);
    throw error;
  }
  if (source.kind === 'path') {
    const roots = allowedPaths.filter((root) => existsSync(root)).map((root) => realpathSync(root));
    const gitDirs = gitDirsOf(source.realPath);
    if (!underRoots(source.realPath, roots) || !gitDirs?.every((dir) => underRoots(dir, roots))) throw ValidationError.field('source', outside);
  }
  const workspace = await findWorkspace(db, caller.workspaceId);
  if (!workspace) throw new NotFoundError('Workspace not found');
  const { repository, setup } = await addRepository(db, environments, { workspace, source, setup: body.setup, ...(body.name === undefined ? {} : { fullName: body.name }) });
  return { repository, setup };
}

export async function workspaceRepositories(db: Db, workspaceName: string): Promise<RepositoryRow[]> {
  return listRepositories(db, (await requireWorkspace(db, workspaceName)).id);
}
