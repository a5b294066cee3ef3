/**
 * A task's folder on this computer, `<home>/worktrees/<task id>/`: for each repository of its project a
 * git worktree `<repo dir>` on the branch `svc/<task slug>`, made from the user's repository (so the
 * user's own checkout is never touched), or a plain folder in the projectless environment. Later runs of
 * the task reuse it as they find it.
 */
import { existsSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import type { LocalProject, RunnerHome } from './home.js';
import { git, gitMaybe } from './git.js';

export class WorktreeError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'WorktreeError';
  }
}

/** The task's branch: `svc/` and its slug, reduced to what a ref name may hold. */
export function branchOf(taskSlug: string): string {
  const cleaned = taskSlug
    .replace(/[^A-Za-z0-9._-]+/g, '-')
    .replace(/\.{2,}/g, '.')
    .replace(/^[.-]+|[.-]+$/g, '')
    .replace(/\.lock$/, '');
  return `svc/${cleaned || 'task'}`;
}

/** The base of a new worktree: the repository's default branch when it has one locally, else its HEAD. */
async function baseOf(repositoryPath: string, defaultBranch: string | undefined): Promise<string> {
  if (defaultBranch && (await gitMaybe(repositoryPath, ['rev-parse', '--verify', '--quiet', `refs/heads/${defaultBranch}^{commit}`]))) return defaultBranch;
  return 'HEAD';
}

/** Makes (or finds) the task's folder and answers its path. */
export async function prepareTaskFolder(home: RunnerHome, project: LocalProject, task: { taskId: string; taskSlug: string }): Promise<string> {
  const folder = home.taskDir(task.taskId);
  mkdirSync(folder, { recursive: true, mode: 0o700 });
  const branch = branchOf(task.taskSlug);
  for (const repository of project.repositories) {
    const target = join(folder, repository.dir);
    if (existsSync(target)) {
      if ((await gitMaybe(target, ['rev-parse', '--is-inside-work-tree'])) === 'true') continue;
      throw new WorktreeError(`${target} exists and is not a git worktree; remove it to let the task start again`);
    }
    if (!existsSync(repository.path)) throw new WorktreeError(`the repository ${repository.name} is no longer at ${repository.path}; add the project again`);
    // A worktree removed by hand leaves its registration behind, which would block the branch.
    await git(repository.path, ['worktree', 'prune']);
    // A branch that exists already holds the task's earlier work (its worktree was removed): keep it.
    const exists = await gitMaybe(repository.path, ['rev-parse', '--verify', '--quiet', `refs/heads/${branch}`]);
    const args = exists ? ['worktree', 'add', target, branch] : ['worktree', 'add', '-b', branch, target, await baseOf(repository.path, repository.defaultBranch)];
    try {
      await git(repository.path, args);
    } catch (error) {
      throw new WorktreeError(`cannot make the worktree of ${repository.name}: ${error instanceof Error ? error.message : String(error)}`);
    }
  }
  return folder;
}
