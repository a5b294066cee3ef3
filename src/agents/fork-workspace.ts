/** The agent's workspace operations, each run as a command inside the sandboxed fork. */
import { posix } from 'node:path';
import type { Fork } from '../sandbox/fork.js';
import type { Workspace } from './types.js';

const FILE_TIMEOUT_MS = 30_000;

/** Keeps a path inside /workspace: relative, normalized, never above the root. */
export function workspacePath(path: string): string {
  const normalized = posix.normalize(path.trim() || '.');
  if (posix.isAbsolute(normalized) || normalized === '..' || normalized.startsWith('../')) {
    throw new Error(`path ${path} is outside /workspace`);
  }
  return normalized;
}

/**
 * The `find` that lists a directory (relative to the root, normalized) two levels deep. Its start always
 * begins with `./`: find has no `--`, and takes any argument that starts with `-`, `(` or `!` for its
 * expression (a path `-delete` would delete the whole tree).
 */
export function listFilesCommand(relativePath: string): string[] {
  const start = relativePath === '.' ? '.' : `./${relativePath}`;
  return ['find', start, '-maxdepth', '2', '-not', '-path', '*/.git/*', '-not', '-name', '.git'];
}

/** `grep` over a directory (relative to the root), skipping git's and dependencies' folders. */
export function searchCommand(pattern: string, relativePath: string): string[] {
  return ['grep', '-rnI', '--exclude-dir=.git', '--exclude-dir=node_modules', '-e', pattern, '--', relativePath];
}

/** What a search answers: its matches, `no matches` (grep's exit 1), or an error. */
export function searchAnswer(result: { exitCode: number | null; stdout: string; stderr: string }): string {
  if (result.exitCode === 1) return 'no matches';
  if (result.exitCode !== 0) throw new Error(result.stderr.trim() || `grep failed with ${result.exitCode}`);
  return result.stdout;
}

/** A shell command with all of the shell's own complaints (a failed redirection, say) in its output, not only the commands' stderr. */
export function shellCommand(command: string): string[] {
  return ['sh', '-c', `exec 2>&1\n${command}`];
}

/** Cuts streamed output into lines for `onLine`; `flush` hands over a last line without a newline. */
export function lineSplitter(onLine: (line: string) => void): { onStdout(chunk: string): void; flush(): void } {
  let pending = '';
  return {
    onStdout(chunk) {
      pending += chunk;
      const lines = pending.split('\n');
      pending = lines.pop() ?? '';
      for (const line of lines) onLine(line);
    },
    flush() {
      if (pending) onLine(pending);
      pending = '';
    },
  };
}

export interface ForkWorkspaceOptions {
  network: boolean;
  /** Stops every command of the run (its whole process group) when aborted: cancel, lost lease. */
  signal?: AbortSignal;
  /** Variables every command sees (dev server addresses, for one). */
  env?: Record<string, string>;
  /** Every command sees the fork read-only (ask and plan runs). */
  readOnly?: boolean;
}

export function forkWorkspace(fork: Fork, options: ForkWorkspaceOptions): Workspace {
  const base = { network: options.network, readOnly: options.readOnly ?? false, ...(options.signal ? { signal: options.signal } : {}), ...(options.env ? { env: options.env } : {}) };
  const run = (argv: string[], stdin?: string, timeoutMs = FILE_TIMEOUT_MS) =>
    fork.run(argv, { ...base, timeoutMs, ...(stdin === undefined ? {} : { stdin }) });
  const checked = async (argv: string[], stdin?: string) => {
    const result = await run(argv, stdin);
    if (result.exitCode !== 0) throw new Error((result.stderr || result.stdout).trim() || `exit code ${result.exitCode}`);
    return result.stdout;
  };
  return {
    listFiles: (path) => checked(listFilesCommand(workspacePath(path))),
    readFile: (path) => checked(['cat', '--', workspacePath(path)]),
    async writeFile(path, content) {
      await checked(['sh', '-c', 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', 'sh', workspacePath(path)], content);
    },
    search: async (pattern, path) => searchAnswer(await run(searchCommand(pattern, workspacePath(path)))),
    async runCommand(command, timeoutMs) {
      const result = await run(shellCommand(command), undefined, timeoutMs);
      return { exitCode: result.exitCode, output: result.stdout, timedOut: result.timedOut };
    },
    async runStreaming(argv, { env, timeoutMs, network, egressDir, stdin, onLine }) {
      const lines = lineSplitter(onLine);
      const result = await fork.run(argv, {
        ...base,
        env: { ...(options.env ?? {}), ...(env ?? {}) },
        network: network ?? options.network,
        timeoutMs,
        ...(egressDir === undefined ? {} : { egressDir }),
        ...(stdin === undefined ? {} : { stdin }),
        onStdout: lines.onStdout,
      });
      lines.flush();
      return { exitCode: result.exitCode, stderr: result.stderr, timedOut: result.timedOut };
    },
  };
}
