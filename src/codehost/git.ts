/** Runs git on the host, on repositories svc owns (the code host's bare repositories, environments). */
import { execFile } from 'node:child_process';

export class GitError extends Error {
  constructor(
    readonly args: readonly string[],
    readonly stderr: string,
  ) {
    super(`git ${args.join(' ')} failed: ${stderr.trim().split('\n').slice(-3).join(' ') || 'no output'}`);
    this.name = 'GitError';
  }
}

/**
 * Host git ignores the user's and the system's config and never prompts, so a repository behaves the
 * same for every operator; hooks are off (svc runs no repository code outside the sandbox).
 */
const GIT_ENV = {
  PATH: process.env.PATH ?? '/usr/bin:/bin',
  HOME: '/nonexistent',
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
  GIT_TERMINAL_PROMPT: '0',
  GIT_AUTHOR_NAME: 'svc',
  GIT_AUTHOR_EMAIL: 'svc@localhost',
  GIT_COMMITTER_NAME: 'svc',
  GIT_COMMITTER_EMAIL: 'svc@localhost',
  LANG: 'C.UTF-8',
};

/** Runs git and answers its exit code and output, whatever the code. */
export function runGit(
  args: readonly string[],
  options: { cwd?: string; maxBuffer?: number } = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  const full = ['-c', 'core.hooksPath=/dev/null', ...args];
  return new Promise((resolve, reject) => {
    execFile(
      'git',
      full,
      { cwd: options.cwd, env: GIT_ENV, maxBuffer: options.maxBuffer ?? 64 * 1024 * 1024, encoding: 'utf8' },
      (error, stdout, stderr) => {
        if (error && typeof error.code !== 'number') reject(new GitError(args, error.message));
        else resolve({ code: error ? Number(error.code) : 0, stdout, stderr });
      },
    );
  });
}

/** Runs git and answers its output; a non-zero exit is a GitError. */
export async function git(args: readonly string[], options: { cwd?: string; maxBuffer?: number } = {}): Promise<string> {
  const result = await runGit(args, options);
  if (result.code !== 0) throw new GitError(args, result.stderr || result.stdout);
  return result.stdout;
}

/** The commit a ref names, or null when there is none. */
export async function revParse(cwd: string, ref: string): Promise<string | null> {
  try {
    return (await git(['rev-parse', '--verify', '--quiet', `${ref}^{commit}`], { cwd })).trim() || null;
  } catch {
    return null;
  }
}
