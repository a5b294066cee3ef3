/**
 * Local projects (`svc runner project add`): a folder that is a git repository, or holds repositories as
 * its direct subfolders; or, when asked, the projectless environment (a folder without one). Each project
 * gets a UUID once and keeps it, so the server's project identity survives re-adding and reconnecting.
 *
 * What the server sees (`registrationOf`) is the id, a display name and per repository `owner/repo`, its
 * network remote URL (credentials stripped) and default branch: never a path of this computer.
 */
import { randomUUID } from 'node:crypto';
import { readdirSync, realpathSync, statSync } from 'node:fs';
import { basename, join, resolve } from 'node:path';
import { ProjectRegistration, RUNNER_LIMITS } from '../protocol/runner.js';
import { gitMaybe } from './git.js';
import type { LocalProject, LocalRepository, RunnerHome } from './home.js';

export class ProjectError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ProjectError';
  }
}

const NAME_PART = /^[A-Za-z0-9_.-]{1,100}$/;
const NETWORK_URL = /^(?:(?:https?|ssh|git):\/\/|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:)/;

/**
 * A remote URL the server may see: network URLs only (never a path on this computer), without a password
 * (ssh:// and git:// URLs keep their user, `git` as a rule), and without the user of an https URL too (a
 * token, often). Null for anything else.
 */
export function publicRemoteUrl(url: string): string | null {
  const trimmed = url.trim();
  if (!NETWORK_URL.test(trimmed)) return null;
  if (/^https?:\/\//.test(trimmed)) {
    if (!URL.canParse(trimmed)) return null;
    const parsed = new URL(trimmed);
    parsed.username = '';
    parsed.password = '';
    return parsed.toString().replace(/\/$/, '');
  }
  const scheme = /^(?:ssh|git):\/\//.exec(trimmed);
  if (!scheme) return trimmed;
  // Taken apart by hand, not by URL, which would rewrite the rest of a non-special URL's text.
  const rest = trimmed.slice(scheme[0].length);
  const authorityEnd = rest.search(/[/?#]/);
  const authority = authorityEnd === -1 ? rest : rest.slice(0, authorityEnd);
  const at = authority.lastIndexOf('@');
  if (at === -1) return trimmed;
  const user = authority.slice(0, at).split(':')[0];
  return `${scheme[0]}${user ? `${user}@` : ''}${authority.slice(at + 1)}${rest.slice(authority.length)}`;
}

/** `owner/repo` from a remote URL's last two path segments, or null. */
export function repositoryNameOf(url: string): string | null {
  const trimmed = url.trim().replace(/\/+$/, '').replace(/\.git$/, '');
  let path: string;
  const scp = /^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:(.+)$/.exec(trimmed);
  if (scp) path = scp[1]!;
  else if (URL.canParse(trimmed) && /^[a-z+]+:\/\//.test(trimmed)) path = new URL(trimmed).pathname;
  else return null;
  const segments = path.split('/').filter(Boolean);
  const [owner, repo] = segments.slice(-2);
  return owner && repo && NAME_PART.test(owner) && NAME_PART.test(repo) ? `${owner}/${repo}` : null;
}

function localName(dir: string): string {
  const cleaned = basename(dir).replace(/[^A-Za-z0-9_.-]/g, '-').slice(0, 100) || 'repository';
  return `local/${/^\.+$/.test(cleaned) ? 'repository' : cleaned}`;
}

async function isRepositoryRoot(dir: string): Promise<boolean> {
  const top = await gitMaybe(dir, ['rev-parse', '--show-toplevel']);
  return top !== null && realpathSync(top) === realpathSync(dir);
}

async function describeRepository(dir: string): Promise<LocalRepository> {
  const origin = await gitMaybe(dir, ['remote', 'get-url', 'origin']);
  const remoteUrl = origin ? publicRemoteUrl(origin) : null;
  const originHead = await gitMaybe(dir, ['symbolic-ref', '--quiet', '--short', 'refs/remotes/origin/HEAD']);
  const defaultBranch = originHead?.replace(/^origin\//, '') ?? (await gitMaybe(dir, ['symbolic-ref', '--quiet', '--short', 'HEAD']));
  return {
    name: (origin && repositoryNameOf(origin)) || localName(dir),
    ...(remoteUrl ? { remoteUrl } : {}),
    ...(defaultBranch ? { defaultBranch } : {}),
    path: realpathSync(dir),
    dir: basename(realpathSync(dir)),
  };
}

/** The repositories of a folder: the folder itself, or else its direct subfolders that are repositories. */
export async function detectRepositories(path: string): Promise<LocalRepository[]> {
  if (await isRepositoryRoot(path)) return [await describeRepository(path)];
  const repositories: LocalRepository[] = [];
  for (const entry of readdirSync(path, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    if (!entry.isDirectory() || entry.name === '.git') continue;
    const dir = join(path, entry.name);
    if (await isRepositoryRoot(dir)) repositories.push(await describeRepository(dir));
  }
  return repositories;
}

function registrationFields(project: LocalProject) {
  return {
    id: project.id,
    name: project.name,
    repositories: project.repositories.map(({ name, remoteUrl, defaultBranch }) => {
      // Again here: a project list written by an older runner may hold a URL with its password.
      const sent = remoteUrl ? publicRemoteUrl(remoteUrl) : null;
      return { name, ...(sent ? { remoteUrl: sent } : {}), ...(defaultBranch ? { defaultBranch } : {}) };
    }),
  };
}

/** What the server sees of a project. */
export function registrationOf(project: LocalProject): ProjectRegistration {
  return ProjectRegistration.parse(registrationFields(project));
}

export interface AddProjectOptions {
  name?: string;
  /** The folder has no repository and is the projectless environment. */
  projectless?: boolean;
}

/**
 * Registers the folder at `path` in the home: adding it again refreshes its repositories and keeps its
 * id. There is one projectless environment: adding another moves it (its id stays).
 */
export async function addProject(home: RunnerHome, path: string, options: AddProjectOptions = {}): Promise<LocalProject> {
  const absolute = resolve(path);
  let isDirectory = false;
  try {
    isDirectory = statSync(absolute).isDirectory();
  } catch {
    throw new ProjectError(`${absolute} does not exist`);
  }
  if (!isDirectory) throw new ProjectError(`${absolute} is not a directory`);
  const real = realpathSync(absolute);
  const repositories = await detectRepositories(real);
  if (repositories.length === 0 && !options.projectless) {
    throw new ProjectError(`${real} holds no git repository (itself or a direct subfolder); add --projectless to make it the projectless environment`);
  }
  if (repositories.length > 0 && options.projectless) {
    throw new ProjectError(`${real} holds git repositories (${repositories.map((repository) => repository.name).join(', ')}); --projectless is for a folder without one`);
  }
  if (repositories.length > RUNNER_LIMITS.repositoriesPerProject) {
    throw new ProjectError(`${real} holds ${repositories.length} repositories; a project may have at most ${RUNNER_LIMITS.repositoriesPerProject}`);
  }
  const projects = home.readProjects();
  const existing = projects.find((project) => project.path === real) ?? (options.projectless ? projects.find((project) => project.repositories.length === 0) : undefined);
  const project: LocalProject = {
    id: existing?.id ?? randomUUID(),
    name: options.name?.trim() || basename(real) || 'project',
    path: real,
    repositories,
  };
  const parsed = ProjectRegistration.safeParse(registrationFields(project));
  if (!parsed.success) throw new ProjectError(`the project cannot be registered: ${parsed.error.issues.map((issue) => `${issue.path.join('.')} ${issue.message}`).join('; ')}`);
  const others = projects.filter((candidate) => candidate.id !== project.id);
  if (others.length + 1 > RUNNER_LIMITS.projectsPerRunner) throw new ProjectError(`a runner may register at most ${RUNNER_LIMITS.projectsPerRunner} projects`);
  home.writeProjects([...others, project]);
  return project;
}
