/**
 * The agent's workspace on a desktop runner: a task's folder on the user's own computer (its git
 * worktrees), where processes run directly as the user. There is no bubblewrap here: the run's permission
 * mode decides what the agent may do, and the folder is what it works in. Paths are confined to the
 * folder as `workspacePath` confines them to /workspace in a fork, and symbolic links that lead out of it
 * are refused too, since nothing else stands between the agent and the user's files.
 *
 * The agents' instructions (shared with the cloud) call the root /workspace, so file paths under
 * /workspace are taken as relative to the folder.
 *
 * Every command is a process group of its own (`runProcessGroup`). Long-running ones (commands, agent
 * CLIs) write their group id to a file of their own in `groupsDir` before they start, removed once the
 * group is gone, so that a runner that died while they ran can still stop them when it starts again:
 * their groups outlive the runner otherwise. The file also names the group's leader (boot id and start
 * time, `RECORD_GROUP`): a group id alone may name someone else's group by then.
 */
import { randomUUID } from 'node:crypto';
import { lstatSync, readlinkSync, realpathSync } from 'node:fs';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, isAbsolute, join, posix, relative, resolve, sep } from 'node:path';
import { runProcessGroup, type RunOptions } from '../sandbox/fork.js';
import { lineSplitter, listFilesCommand, searchAnswer, searchCommand, shellCommand } from './fork-workspace.js';
import type { Workspace } from './types.js';

const FILE_TIMEOUT_MS = 30_000;

/**
 * The shell that leads a tracked group writes to "$1": its pid (the group id), then `boot <id>` and
 * `start <ticks>` from /proc on Linux, else `start <ps lstart>`; src/platform/process-identity.ts reads a
 * running process the same way and compares. Builtins only on Linux: nothing else starts first.
 */
const RECORD_GROUP =
  'f() { shift 19; s=$1; }; ' +
  'if [ -r /proc/$$/stat ] && [ -r /proc/sys/kernel/random/boot_id ]; then read -r p < /proc/$$/stat; read -r b < /proc/sys/kernel/random/boot_id; ' +
  'f ${p##*) }; printf "%s\\nboot %s\\nstart %s\\n" "$$" "$b" "$s"; ' +
  'else printf "%s\\nstart %s\\n" "$$" "$(LC_ALL=C TZ=UTC ps -o lstart= -p $$ 2>/dev/null)"; fi > "$1" || exit 126; ';

export class OutsideWorkspaceError extends Error {
  constructor(path: string) {
    super(`path ${path} is outside the task's folder`);
    this.name = 'OutsideWorkspaceError';
  }
}

/** Whether `path` (absolute, resolved) is `root` or below it. */
function within(root: string, path: string): boolean {
  const rel = relative(root, path);
  return rel === '' || (!rel.startsWith(`..${sep}`) && rel !== '..' && !isAbsolute(rel));
}

/**
 * The real location of `path`, resolving links through its nearest existing ancestor; a dangling link is
 * followed to where it points, since writing through it would create its target.
 */
function realLocation(path: string): string {
  let existing = path;
  const rest: string[] = [];
  for (let links = 0; links < 40; ) {
    try {
      return resolve(realpathSync(existing), ...[...rest].reverse());
    } catch {
      if (lstatSync(existing, { throwIfNoEntry: false })?.isSymbolicLink()) {
        existing = resolve(dirname(existing), readlinkSync(existing));
        links += 1;
        continue;
      }
      const parent = dirname(existing);
      if (parent === existing) return path;
      rest.push(basename(existing));
      existing = parent;
    }
  }
  throw new Error(`too many symbolic links in ${path}`);
}

/**
 * The absolute path of `path` (relative to `root`) when it stays inside `root`: relative, never above the
 * root, and not through a link that leaves it. Throws OutsideWorkspaceError otherwise.
 */
export function confinedPath(root: string, path: string): string {
  const normalized = posix.normalize(path.trim().replaceAll('\\', '/') || '.');
  if (posix.isAbsolute(normalized) || normalized === '..' || normalized.startsWith('../')) throw new OutsideWorkspaceError(path);
  const realRoot = realpathSync(root);
  const target = resolve(realRoot, normalized);
  if (!within(realRoot, realLocation(target))) throw new OutsideWorkspaceError(path);
  return target;
}

export interface LocalWorkspaceOptions {
  /** Stops every command of the run (its whole process group) when aborted: cancel, shutdown. */
  signal?: AbortSignal;
  /** The environment every process gets (the user's own, as the runner received it). */
  env?: Record<string, string>;
  /** Where each long-running process group records its id while it runs; see the file comment. */
  groupsDir?: string;
}

/** A path as the agent gives it: `/workspace/x` (the root its instructions name) is `x` here. */
function agentPath(path: string): string {
  const trimmed = path.trim();
  if (trimmed === '/workspace') return '.';
  return trimmed.startsWith('/workspace/') ? trimmed.slice('/workspace/'.length) : trimmed;
}

export function localWorkspace(dir: string, options: LocalWorkspaceOptions = {}): Workspace {
  const root = resolve(dir);
  const inside = (path: string) => confinedPath(root, agentPath(path));
  const base: RunOptions = { env: options.env ?? {}, ...(options.signal ? { signal: options.signal } : {}) };
  /**
   * `runProcessGroup` starts programs where the runner runs: a small shell enters the folder first (and
   * records its group for long-running work), then becomes the program.
   */
  const run = async (argv: readonly string[], extra: RunOptions & { tracked?: boolean }) => {
    const { tracked, ...rest } = extra;
    const record = tracked && options.groupsDir ? join(options.groupsDir, `${randomUUID()}.pid`) : null;
    if (record) await mkdir(dirname(record), { recursive: true, mode: 0o700 });
    const line = record
      ? ['sh', '-c', `${RECORD_GROUP}cd -- "$2" || exit 126; shift 2; exec "$@"`, 'sh', record, root, ...argv]
      : ['sh', '-c', 'cd -- "$1" || exit 126; shift; exec "$@"', 'sh', root, ...argv];
    try {
      return await runProcessGroup(line, { ...base, ...rest, env: { ...(base.env ?? {}), ...(rest.env ?? {}) } });
    } finally {
      // runProcessGroup resolves once the group is killed: nothing is left to stop.
      if (record) await rm(record, { force: true });
    }
  };
  const relativeOf = (path: string) => {
    const rel = relative(realpathSync(root), inside(path));
    return rel === '' ? '.' : rel;
  };
  return {
    async listFiles(path) {
      const result = await run(listFilesCommand(relativeOf(path)), { timeoutMs: FILE_TIMEOUT_MS });
      if (result.exitCode !== 0) throw new Error((result.stderr || result.stdout).trim() || `exit code ${result.exitCode}`);
      return result.stdout;
    },
    readFile: async (path) => readFile(inside(path), 'utf8'),
    async writeFile(path, content) {
      const target = inside(path);
      await mkdir(dirname(target), { recursive: true });
      // Checked again: a link may have appeared in its place while the directories were made.
      await writeFile(inside(path), content);
    },
    search: async (pattern, path) => searchAnswer(await run(searchCommand(pattern, relativeOf(path)), { timeoutMs: FILE_TIMEOUT_MS })),
    async runCommand(command, timeoutMs) {
      const result = await run(shellCommand(command), { timeoutMs, tracked: true });
      return { exitCode: result.exitCode, output: result.stdout, timedOut: result.timedOut };
    },
    async runStreaming(argv, { env, timeoutMs, egressDir, stdin, onLine }) {
      // Nothing here confines a program's network: a CLI on the user's computer runs with its own login.
      if (egressDir) throw new Error("a desktop runner's folder has no sandbox to confine a program to the credential proxy");
      const lines = lineSplitter(onLine);
      const result = await run(argv, {
        ...(env ? { env } : {}),
        timeoutMs,
        tracked: true,
        ...(stdin === undefined ? {} : { stdin }),
        onStdout: lines.onStdout,
      });
      lines.flush();
      return { exitCode: result.exitCode, stderr: result.stderr, timedOut: result.timedOut };
    },
  };
}
