/** Git on the user's computer, for project registration and task worktrees. */
import { execFile } from 'node:child_process';

export class GitError extends Error {
  constructor(args: readonly string[], detail: string) {
    super(`git ${args.join(' ')} failed: ${detail}`);
    this.name = 'GitError';
  }
}

/** Runs git in `cwd` and answers its standard output, trimmed; throws GitError with its complaint. */
export function git(cwd: string, args: readonly string[]): Promise<string> {
  return new Promise((resolve, reject) => {
    execFile('git', [...args], { cwd, encoding: 'utf8', maxBuffer: 16 * 1024 * 1024, env: { ...process.env, GIT_TERMINAL_PROMPT: '0' } }, (error, stdout, stderr) => {
      if (error) reject(new GitError(args, (stderr || error.message).trim().split('\n').at(-1) ?? error.message));
      else resolve(stdout.trim());
    });
  });
}

/** git's answer, or null when it fails (an optional fact: no remote, a detached HEAD). */
export async function gitMaybe(cwd: string, args: readonly string[]): Promise<string | null> {
  try {
    const output = await git(cwd, args);
    return output || null;
  } catch {
    return null;
  }
}
