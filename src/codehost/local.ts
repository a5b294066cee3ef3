/**
 * The built-in code host: a bare git repository per connected repository in the data dir
 * (`codehost/<workspace id>/<owner>/<repo>.git`). It is the origin of the environment's working copies;
 * task branches arrive as git bundles written inside the sandbox (the sandbox never sees the code host),
 * and pull requests are merged here by a person through the API, never automatically.
 */
import { existsSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { mkdir, rename, rm } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { git, GitError, revParse, runGit } from './git.js';

export const FULL_NAME = /^[A-Za-z0-9_.-]{1,100}\/[A-Za-z0-9_.-]{1,100}$/;

export class MergeConflictError extends Error {
  constructor(readonly files: string[]) {
    super(`the branches conflict${files.length ? ` in ${files.join(', ')}` : ''}`);
    this.name = 'MergeConflictError';
  }
}

/** A branch that only moves forward was offered a commit that does not descend from it. */
export class FastForwardError extends Error {
  constructor(fullName: string, branch: string) {
    super(`${branch} of ${fullName} moved meanwhile; the change does not build on it`);
    this.name = 'FastForwardError';
  }
}

/** The base branch moved while a merge was computed (another merge landed): try again. */
export class BaseMovedError extends Error {
  constructor(branch: string) {
    super(`${branch} moved while the merge was made; try again`);
    this.name = 'BaseMovedError';
  }
}

export class RepositoryExistsError extends Error {
  constructor(fullName: string) {
    super(`the code host already has ${fullName}`);
    this.name = 'RepositoryExistsError';
  }
}

export class LocalCodeHost {
  constructor(private readonly dataDir: string) {}

  repositoryPath(workspaceId: string, fullName: string): string {
    if (!FULL_NAME.test(fullName) || fullName.split('/').some((part) => part === '.' || part === '..')) {
      throw new Error(`"${fullName}" is not an owner/repo name`);
    }
    return join(this.dataDir, 'codehost', workspaceId, `${fullName}.git`);
  }

  /**
   * Creates the bare repository from a git URL or path; answers its default branch. It is made beside its
   * place and renamed into it, so that of two imports at once exactly one lands (the other gets
   * RepositoryExistsError) and nobody ever sees half a repository. With `protocols`, the clone may use
   * only those git transports (`file` for a path) and goes through the transport even for a path
   * (`--no-local`: no hardlinks, no copy of whatever the source's git files point at).
   */
  async importRepository(
    workspaceId: string,
    fullName: string,
    source: string,
    options: { protocols?: readonly string[] } = {},
  ): Promise<{ path: string; defaultBranch: string }> {
    const path = this.repositoryPath(workspaceId, fullName);
    if (existsSync(path)) throw new RepositoryExistsError(fullName);
    await mkdir(dirname(path), { recursive: true });
    const staging = `${path}.${process.pid}-${randomBytes(4).toString('hex')}.importing`;
    try {
      const allowed = options.protocols ? ['-c', 'protocol.allow=never', ...options.protocols.flatMap((name) => ['-c', `protocol.${name}.allow=always`])] : [];
      await git([...allowed, 'clone', '--quiet', '--bare', ...(options.protocols ? ['--no-local'] : []), '--', source, staging]);
      const head = (await git(['symbolic-ref', '--short', 'HEAD'], { cwd: staging })).trim();
      if (!(await revParse(staging, head))) throw new Error(`${source} has no commits on its default branch ${head}`);
      // A bare clone keeps the source as `origin`; the code host is the origin from now on.
      await git(['remote', 'remove', 'origin'], { cwd: staging }).catch(() => undefined);
      try {
        await rename(staging, path);
      } catch (error) {
        const code = (error as NodeJS.ErrnoException).code;
        if (code === 'EEXIST' || code === 'ENOTEMPTY') throw new RepositoryExistsError(fullName);
        throw error;
      }
      return { path, defaultBranch: head };
    } finally {
      await rm(staging, { recursive: true, force: true });
    }
  }

  async removeRepository(workspaceId: string, fullName: string): Promise<void> {
    await rm(this.repositoryPath(workspaceId, fullName), { recursive: true, force: true });
  }

  async resolve(workspaceId: string, fullName: string, ref: string): Promise<string | null> {
    return revParse(this.repositoryPath(workspaceId, fullName), ref);
  }

  /**
   * Stores a branch from a bundle written in a sandbox (`git bundle create … HEAD ^base`). The bundle is
   * data: git verifies it and reads only objects and the `HEAD` ref from it. Answers the branch's commit,
   * which must be `expectedHead` (what the sandbox said it bundled).
   */
  async receiveBranch(
    workspaceId: string,
    fullName: string,
    bundle: string,
    branch: string,
    expectedHead: string,
    options: { fastForwardOnly?: boolean } = {},
  ): Promise<string> {
    const path = this.repositoryPath(workspaceId, fullName);
    await git(['bundle', 'verify', '--quiet', bundle], { cwd: path });
    // A task branch is the task's to rewrite; a default branch only moves forward (FastForwardError).
    const fetched = await runGit(['fetch', '--quiet', '--no-tags', bundle, `${options.fastForwardOnly ? '' : '+'}HEAD:refs/heads/${branch}`], { cwd: path });
    if (fetched.code !== 0) {
      if (options.fastForwardOnly && /non-fast-forward|rejected/.test(fetched.stderr)) throw new FastForwardError(fullName, branch);
      throw new GitError(['fetch'], fetched.stderr);
    }
    const head = await revParse(path, `refs/heads/${branch}`);
    if (head !== expectedHead) throw new Error(`the bundle of ${fullName} holds ${head ?? 'nothing'}, not ${expectedHead}`);
    return head;
  }

  /**
   * Commits this repository has, for a fork to tell what is new: the last `depth` commits of each branch
   * named (first parents), newest first. Branches that do not exist are skipped.
   */
  async knownCommits(workspaceId: string, fullName: string, branches: readonly string[], depth = 50): Promise<string[]> {
    const path = this.repositoryPath(workspaceId, fullName);
    const known: string[] = [];
    for (const branch of branches) {
      const result = await runGit(['rev-list', '--first-parent', `--max-count=${depth}`, `refs/heads/${branch}`, '--'], { cwd: path });
      if (result.code === 0) known.push(...result.stdout.split('\n').filter(Boolean));
    }
    return [...new Set(known)];
  }

  /**
   * Writes a bundle of `branch` for a fork: what it adds to `base` (a commit the fork has), or the whole
   * branch without one. Answers the branch's head, or null when it does not exist or adds nothing.
   */
  async bundleBranch(workspaceId: string, fullName: string, branch: string, base: string | null, out: string): Promise<string | null> {
    const path = this.repositoryPath(workspaceId, fullName);
    const head = await revParse(path, `refs/heads/${branch}`);
    if (!head) return null;
    if (head === base) return null;
    await git(['bundle', 'create', '--quiet', out, `refs/heads/${branch}`, ...(base ? [`^${base}`] : [])], { cwd: path });
    return head;
  }

  /** Paths that differ between two commits (for deciding whether a merge needs the setup again). */
  async changedPaths(workspaceId: string, fullName: string, from: string, to: string): Promise<string[]> {
    const path = this.repositoryPath(workspaceId, fullName);
    return (await git(['diff', '--name-only', '--no-renames', from, to, '--'], { cwd: path })).split('\n').filter(Boolean);
  }

  /** The unified diff a pull request shows: what `head` adds since it left `base`. */
  async diff(workspaceId: string, fullName: string, base: string, head: string): Promise<string> {
    const path = this.repositoryPath(workspaceId, fullName);
    return git(['diff', '--no-color', '--no-ext-diff', `${base}...${head}`], { cwd: path });
  }

  /** Changed files with added and removed line counts, for the pull request's summary. */
  async diffStat(workspaceId: string, fullName: string, base: string, head: string): Promise<Array<{ file: string; added: number; removed: number }>> {
    const path = this.repositoryPath(workspaceId, fullName);
    const text = await git(['diff', '--numstat', '--no-color', `${base}...${head}`], { cwd: path });
    return text
      .split('\n')
      .filter(Boolean)
      .map((line) => {
        const [added, removed, ...file] = line.split('\t');
        return { file: file.join('\t'), added: Number(added) || 0, removed: Number(removed) || 0 };
      });
  }

  /**
   * Merges the commit `head` (the one a person reviewed) into `baseBranch` with a merge commit, in the
   * bare repository (no working tree): `git merge-tree` computes the result, and the base ref moves only
   * if nobody moved it meanwhile (BaseMovedError otherwise).
   */
  async merge(workspaceId: string, fullName: string, baseBranch: string, head: string, message: string): Promise<string> {
    const path = this.repositoryPath(workspaceId, fullName);
    const base = await revParse(path, `refs/heads/${baseBranch}`);
    if (!base) throw new Error(`branch ${baseBranch} does not exist in ${fullName}`);
    const merged = await runGit(['merge-tree', '--write-tree', '--name-only', '--no-messages', base, head], { cwd: path });
    // Exit 1: a conflict; the output is the tree, then the conflicted files.
    if (merged.code === 1) throw new MergeConflictError(merged.stdout.split('\n').slice(1).map((line) => line.trim()).filter(Boolean));
    if (merged.code !== 0) throw new GitError(['merge-tree'], merged.stderr);
    const tree = merged.stdout.split('\n')[0]!.trim();
    const commit = (await git(['commit-tree', tree, '-p', base, '-p', head, '-m', message], { cwd: path })).trim();
    const moved = await runGit(['update-ref', `refs/heads/${baseBranch}`, commit, base], { cwd: path });
    if (moved.code !== 0) throw new BaseMovedError(baseBranch);
    return commit;
  }
}
