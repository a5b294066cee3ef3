/**
 * Forks of a workspace environment, and processes run inside them.
 *
 * A fork is a copy-on-write view of the environment directory: an overlay mount (lower = environment,
 * upper = the fork's own changes), made inside a private mount namespace (`unshare -m`) for each process,
 * so it costs milliseconds whatever the environment's size and is invisible outside that process. Where
 * overlay mounts are not available (no CAP_SYS_ADMIN), a fork is a real copy instead: each git
 * repository cloned with `git clone --local --shared`, everything else copied, and the log says so.
 *
 * Processes run in bubblewrap: a fresh root with only the host's system directories (read-only), the fork
 * writable at /workspace, an empty /tmp; the service's data dir, the other forks and the other
 * environments are not there (and are covered by empty tmpfs mounts should they live under a system
 * directory). They get their own PID, IPC
 * and (unless allowed) network namespaces, their own process group, and CPU, memory and time limits.
 * Without bubblewrap a fork refuses to run anything unless the operator allowed unsandboxed execution.
 */
import { spawn, spawnSync } from 'node:child_process';
import { cp, mkdir, readdir, rm, stat } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { join, resolve } from 'node:path';

export const FORK_NAME = /^[A-Za-z0-9_-]{1,64}$/;
export const SANDBOX_ROOT = '/workspace';

export type ForkMode = 'overlay' | 'clone';

/** What a sandboxed process sees of the host, read-only. */
const SYSTEM_DIRS = ['/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32', '/etc', '/opt'];

export interface SandboxPolicy {
  /** Paths a sandboxed process must not see (the data dir, the forks and environments roots, keys). */
  hiddenPaths: string[];
  /** Run without bubblewrap where it is missing (the operator's explicit choice). */
  allowUnsandboxed: boolean;
}

export interface RunOptions {
  /** Working directory relative to the fork's root. */
  cwd?: string;
  env?: Record<string, string>;
  network?: boolean;
  timeoutMs?: number;
  /** Address space limit in MiB and CPU seconds (ulimit -v, -t). */
  memoryMiB?: number;
  cpuSeconds?: number;
  signal?: AbortSignal;
  stdin?: string;
  /** Called with each chunk of standard output as it arrives (it is collected in `stdout` as well). */
  onStdout?: (chunk: string) => void;
}

export interface RunResult {
  exitCode: number | null;
  signal: NodeJS.Signals | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  durationMs: number;
}

export class SandboxUnavailableError extends Error {
  constructor() {
    super(
      'bubblewrap (bwrap) is not installed, so commands cannot run isolated; install it with ' +
        '`apt-get install -y bubblewrap`, or allow unsandboxed execution explicitly',
    );
    this.name = 'SandboxUnavailableError';
  }
}

let capabilities: { overlay: boolean; bwrap: boolean } | null = null;

/** Probes once whether overlay mounts in a private mount namespace and bubblewrap work here. */
export function sandboxCapabilities(): { overlay: boolean; bwrap: boolean } {
  if (capabilities) return capabilities;
  const bwrap = spawnSync('bwrap', ['--ro-bind', '/', '/', 'true'], { stdio: 'ignore' }).status === 0;
  const probe = spawnSync(
    'unshare',
    ['-m', '--propagation', 'private', 'sh', '-c', 'd=$(mktemp -d) && mkdir $d/l $d/u $d/w $d/m && mount -t overlay overlay -o lowerdir=$d/l,upperdir=$d/u,workdir=$d/w $d/m; r=$?; umount $d/m 2>/dev/null; rm -rf $d; exit $r'],
    { stdio: 'ignore' },
  );
  capabilities = { overlay: probe.status === 0, bwrap };
  return capabilities;
}

export interface ForkInfo {
  name: string;
  mode: ForkMode;
  /** The environment this fork copies. */
  base: string;
  /** The fork's own directory: overlay upper and work dirs, or the copy itself. */
  dir: string;
}

export class Fork {
  constructor(
    readonly info: ForkInfo,
    private readonly policy: SandboxPolicy,
  ) {}

  /** Where the fork's files are as the host sees them: the copy, or the overlay's upper (changes only). */
  get changesDir(): string {
    return this.info.mode === 'overlay' ? join(this.info.dir, 'upper') : join(this.info.dir, 'root');
  }

  /** Runs `command` (argv) in the fork and resolves when its whole process group is gone. */
  run(command: readonly string[], options: RunOptions = {}): Promise<RunResult> {
    const { bwrap } = sandboxCapabilities();
    if (!bwrap && !this.policy.allowUnsandboxed) return Promise.reject(new SandboxUnavailableError());
    const root = this.info.mode === 'overlay' ? join(this.info.dir, 'merged') : join(this.info.dir, 'root');
    const limits = [
      options.memoryMiB ? `ulimit -v ${Math.floor(options.memoryMiB * 1024)}` : '',
      options.cpuSeconds ? `ulimit -t ${Math.floor(options.cpuSeconds)}` : '',
    ].filter(Boolean);
    const inner = bwrap ? ['bwrap', ...this.bwrapArgs(root, options), '--', ...command] : [...command];
    // $1..$4: overlay dirs (or empty); the rest: the command to exec after mounting and limiting.
    const script = [
      this.info.mode === 'overlay' ? 'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" || exit 125' : '',
      ...limits,
      'shift 4',
      bwrap ? 'exec "$@"' : `cd "${root}/${options.cwd ?? ''}" && exec "$@"`,
    ]
      .filter(Boolean)
      .join('\n');
    const overlayArgs =
      this.info.mode === 'overlay'
        ? [this.info.base, join(this.info.dir, 'upper'), join(this.info.dir, 'work'), root]
        : ['', '', '', ''];
    const argv =
      this.info.mode === 'overlay'
        ? ['unshare', '-m', '--propagation', 'private', 'sh', '-c', script, 'sh', ...overlayArgs, ...inner]
        : ['sh', '-c', script, 'sh', ...overlayArgs, ...inner];
    return runProcessGroup(argv, options);
  }

  private bwrapArgs(root: string, options: RunOptions): string[] {
    // A fresh root holding only the system's programs and libraries, read-only: home directories, /srv,
    // /var and wherever the service keeps its data are simply not there.
    const args = ['--die-with-parent'];
    for (const dir of SYSTEM_DIRS) args.push('--ro-bind-try', dir, dir);
    args.push('--dev', '/dev', '--proc', '/proc', '--tmpfs', '/tmp');
    for (const hidden of this.policy.hiddenPaths) {
      if (existsSync(hidden) && SYSTEM_DIRS.some((dir) => hidden === dir || hidden.startsWith(`${dir}/`))) args.push('--tmpfs', hidden);
    }
    // A fallback copy's shared clones borrow the environment's git objects by absolute path.
    if (this.info.mode === 'clone') args.push('--ro-bind', this.info.base, this.info.base);
    args.push('--bind', root, SANDBOX_ROOT, '--chdir', join(SANDBOX_ROOT, options.cwd ?? ''));
    args.push('--unshare-pid', '--unshare-ipc', '--unshare-uts', '--hostname', 'sandbox');
    if (!options.network) args.push('--unshare-net');
    args.push('--setenv', 'HOME', SANDBOX_ROOT);
    for (const [name, value] of Object.entries(options.env ?? {})) args.push('--setenv', name, value);
    return args;
  }
}

function runProcessGroup(argv: readonly string[], options: RunOptions): Promise<RunResult> {
  const started = Date.now();
  return new Promise((resolvePromise, reject) => {
    const child = spawn(argv[0]!, argv.slice(1), {
      detached: true,
      stdio: ['pipe', 'pipe', 'pipe'],
      env: { PATH: process.env.PATH ?? '/usr/bin:/bin', LANG: 'C.UTF-8', ...(options.env ?? {}) },
    });
    let stdout = '';
    let stderr = '';
    let timedOut = false;
    child.stdout.setEncoding('utf8');
    child.stderr.setEncoding('utf8');
    child.stdout.on('data', (chunk: string) => {
      stdout += chunk;
      options.onStdout?.(chunk);
    });
    child.stderr.on('data', (chunk: string) => (stderr += chunk));
    // A command that exits without reading its input must not fail the run.
    child.stdin.on('error', () => undefined);
    child.stdin.end(options.stdin ?? '');
    const killGroup = () => {
      try {
        if (child.pid) process.kill(-child.pid, 'SIGKILL');
      } catch {
        // already gone
      }
    };
    const timer = options.timeoutMs
      ? setTimeout(() => {
          timedOut = true;
          killGroup();
        }, options.timeoutMs)
      : null;
    const onAbort = () => killGroup();
    if (options.signal?.aborted) killGroup();
    else options.signal?.addEventListener('abort', onAbort, { once: true });
    child.on('error', (error) => {
      if (timer) clearTimeout(timer);
      reject(error);
    });
    child.on('close', (exitCode, signal) => {
      if (timer) clearTimeout(timer);
      options.signal?.removeEventListener('abort', onAbort);
      // Whatever the command left behind in its group goes with it.
      killGroup();
      resolvePromise({ exitCode, signal, timedOut, stdout, stderr, durationMs: Date.now() - started });
    });
  });
}

/** Creates and removes forks under `forksRoot`. */
export class ForkManager {
  constructor(
    private readonly forksRoot: string,
    private readonly policy: SandboxPolicy,
    private readonly log: (message: string) => void = () => undefined,
  ) {}

  async create(name: string, base: string, options: { mode?: ForkMode } = {}): Promise<Fork> {
    if (!FORK_NAME.test(name)) throw new Error(`fork name "${name}" must be 1-64 letters, digits, "-" or "_"`);
    const environment = resolve(base);
    if (/[,:]/.test(environment)) throw new Error(`environment path ${environment} may not contain "," or ":"`);
    if (!(await stat(environment)).isDirectory()) throw new Error(`environment ${environment} is not a directory`);
    const dir = join(resolve(this.forksRoot), name);
    if (existsSync(dir)) throw new Error(`fork "${name}" already exists`);
    let mode = options.mode ?? (sandboxCapabilities().overlay ? 'overlay' : 'clone');
    if (mode === 'overlay' && !sandboxCapabilities().overlay) mode = 'clone';
    if (mode === 'overlay') {
      await mkdir(join(dir, 'upper'), { recursive: true });
      await mkdir(join(dir, 'work'));
      await mkdir(join(dir, 'merged'));
    } else {
      this.log(`fork ${name}: overlay mounts are unavailable here; copying the environment (git clone --local --shared)`);
      await copyEnvironment(environment, join(dir, 'root'));
    }
    return new Fork({ name, mode, base: environment, dir }, this.policy);
  }

  async remove(fork: Fork): Promise<void> {
    await rm(fork.info.dir, { recursive: true, force: true });
  }
}

/** The fallback copy: git repositories as shared local clones, everything else copied as it is. */
async function copyEnvironment(source: string, target: string): Promise<void> {
  await mkdir(target, { recursive: true });
  for (const entry of await readdir(source, { withFileTypes: true })) {
    const from = join(source, entry.name);
    const to = join(target, entry.name);
    if (entry.isDirectory() && existsSync(join(from, '.git'))) {
      const clone = spawnSync('git', ['clone', '--quiet', '--local', '--shared', from, to], { encoding: 'utf8' });
      if (clone.status !== 0) throw new Error(`git clone of ${from} failed: ${clone.stderr.trim()}`);
      // Uncommitted work and untracked files (installed dependencies) come along as well.
      const gitDir = join(from, '.git');
      await cp(from, to, { recursive: true, force: true, filter: (path) => path !== gitDir && !path.startsWith(`${gitDir}/`) });
    } else {
      await cp(from, to, { recursive: true, verbatimSymlinks: true });
    }
  }
}
