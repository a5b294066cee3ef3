/**
 * Forks of a workspace environment, and processes run inside them.
 *
 * A fork is a copy-on-write view of one version of the environment (environment-versions.ts): an overlay
 * mount (lower = the version's layers, which never change; upper = the fork's own changes), made inside a
 * private mount namespace (`unshare -m`) for each process,
 * so it costs milliseconds whatever the environment's size and is invisible outside that process. Where
 * overlay mounts are not available (no CAP_SYS_ADMIN), a fork is a real copy instead: each git
 * repository cloned with `git clone --local --shared`, everything else copied, and the log says so.
 *
 * Processes run in bubblewrap: a fresh root with only the host's system directories (read-only), the fork
 * writable at /workspace, an empty /tmp; the service's data dir, the other forks and the other
 * environments are not there (and are covered by empty tmpfs mounts should they live under a system
 * directory). They get their own PID, IPC
 * and network namespaces, their own process group, and CPU, memory and time limits. A command with network
 * access gets a private network connected to the outside through slirp4netns, never the host's loopback
 * (outside-network.ts); the host's own network only where slirp4netns is missing and the operator allowed it.
 * Without bubblewrap a fork refuses to run anything unless the operator allowed unsandboxed execution.
 *
 * A fork with dev servers holds a private network namespace of its own (`fork.network`, made by
 * dev-servers.ts), connected to the outside through slirp4netns when the fork's commands have network
 * access: its commands of that same network access join that namespace (`nsenter --net`) instead of
 * making one each, so they reach the dev servers on 127.0.0.1 (and, with network access, the outside).
 *
 * A command with an egress directory (`egressDir`: an agent CLI reaching the credential proxy) runs in
 * such a private network too, whatever `network` says, with that directory bound in at EGRESS_DIR: the
 * unix socket there is its one way out.
 */
import { spawn, spawnSync } from 'node:child_process';
import { cp, mkdir, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
import { existsSync, readdirSync, readFileSync, readlinkSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { BLOCK_FD, connectSandbox, INFO_FD, outsideNetworkOf, resolvConfMount, type OutsideNetwork } from './outside-network.js';

export const FORK_NAME = /^[A-Za-z0-9_-]{1,64}$/;
export const SANDBOX_ROOT = '/workspace';
/** Where a command's egress directory (`RunOptions.egressDir`) appears inside the sandbox. */
export const EGRESS_DIR = '/run/svc-egress';

/** `direct` is no fork at all: the sandbox works on the directory itself (the environment's own setup). */
export type ForkMode = 'overlay' | 'clone' | 'direct';

/** What a sandboxed process sees of the host, read-only. */
export const SYSTEM_DIRS = ['/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32', '/etc', '/opt'];

export interface SandboxPolicy {
  /** Paths a sandboxed process must not see (the data dir, the forks and environments roots, keys). */
  hiddenPaths: string[];
  /** Run without bubblewrap where it is missing (the operator's explicit choice). */
  allowUnsandboxed: boolean;
  /**
   * Share the host's network with commands that have network access where slirp4netns is missing (the
   * operator's explicit choice: they can then reach the services on the host's loopback).
   */
  allowHostNetwork?: boolean;
  /** Limits of every process that asks for none of its own: address space in MiB, CPU seconds. */
  memoryMiB?: number;
  cpuSeconds?: number;
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
  /** Mount the fork read-only (ask and plan runs change nothing). */
  readOnly?: boolean;
  /** Called with each chunk of standard output as it arrives (it is collected in `stdout` as well). */
  onStdout?: (chunk: string) => void;
  /**
   * A host directory of unix sockets, bound read-only at EGRESS_DIR: the command's only way out of its
   * private network. The host's network is never shared with it. Needs bubblewrap.
   */
  egressDir?: string;
  /**
   * With `network`: share the host's network even where slirp4netns could give the command its own.
   * Only where the policy allows the host's network (throws otherwise): dev servers where no private
   * namespace can be made, which must stay reachable from the host (their health check).
   */
  hostNetwork?: boolean;
}

/** What a long-running process (a dev server) is started with; it runs until stopped. */
export type LongRunningOptions = Pick<RunOptions, 'cwd' | 'env' | 'network' | 'hostNetwork' | 'memoryMiB' | 'cpuSeconds'>;

/** A process group started by `spawnLongRunning`. */
export interface LongRunningProcess {
  /** The group's leader (and so the group's id). */
  readonly pid: number;
  /** Its latest output, standard output and error interleaved, at most 16 KiB. */
  output(): string;
  /** Resolves when its group leader has exited (and whatever it left in its group was killed). */
  readonly exited: Promise<{ exitCode: number | null; signal: NodeJS.Signals | null }>;
  /** SIGTERM to the whole group, SIGKILL after `graceMs`; resolves when it is gone. */
  stop(graceMs?: number): Promise<void>;
}

/**
 * A private network namespace a fork's commands share (with its dev servers). Held open by a process;
 * `inode` names the namespace so that a reused pid is never mistaken for it.
 */
export interface ForkNetwork {
  holderPid: number;
  /** `net:[<inode>]`, as /proc/<pid>/ns/net links to it. */
  inode: string;
  /** A network namespace connected to the outside (through slirp4netns): for commands with network access. */
  outside?: boolean;
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

/**
 * One immutable version of an environment: its layers, bottom first (see environment-versions.ts). A
 * plain directory is a version of one layer. A fork keeps the version it was made from for its whole
 * life, so nothing under a fork ever changes while it is in use.
 */
export interface EnvironmentSnapshot {
  version: number;
  layers: string[];
}

export interface ForkInfo {
  name: string;
  mode: ForkMode;
  /** The environment version this fork copies (for `direct`, the directory itself). */
  lower: EnvironmentSnapshot;
  /** The fork's own directory: overlay upper and work dirs, or the copy itself. */
  dir: string;
}

/** The overlay `lowerdir` option of a snapshot: its layers top first, as overlayfs wants them. */
export function lowerdirOption(snapshot: EnvironmentSnapshot): string {
  return [...snapshot.layers].reverse().join(':');
}

/** A page: mount(2) takes no longer option string. Deeper stacks are flattened before they get there. */
const MAX_MOUNT_OPTIONS = 4000;

/** The fork's own files within its directory: the overlay's upper dir (its changes only), or the copy. */
export function changesDirOf(info: Pick<ForkInfo, 'mode' | 'dir'>): string {
  return info.mode === 'overlay' ? join(info.dir, 'upper') : info.mode === 'direct' ? info.dir : join(info.dir, 'root');
}

export class Fork {
  /** Set while the fork holds a private network namespace; see the module comment. */
  network: ForkNetwork | null = null;
  /**
   * Set while one overlay mount of the fork is held open (while dev servers run): every command then
   * joins that mount instead of making its own, since overlayfs does not support two mounts sharing one
   * upper directory at once (a long-running server would not see the agent's later edits).
   */
  mount: ForkNetwork | null = null;

  constructor(
    readonly info: ForkInfo,
    private readonly policy: SandboxPolicy,
  ) {}

  /** Where the fork's files are as the host sees them: the copy, or the overlay's upper (changes only). */
  get changesDir(): string {
    return changesDirOf(this.info);
  }

  /** Runs `command` (argv) in the fork and resolves when its whole process group is gone. */
  run(command: readonly string[], options: RunOptions = {}): Promise<RunResult> {
    try {
      const { argv, connect } = this.commandLine(command, options);
      return runProcessGroup(argv, options, connect);
    } catch (error) {
      return Promise.reject(error as Error);
    }
  }

  /**
   * Starts `command` in the fork like `run`, as a process group of its own that runs until it exits or is
   * stopped (a dev server). It dies with this process (bubblewrap's --die-with-parent).
   */
  spawnLongRunning(command: readonly string[], options: LongRunningOptions = {}): LongRunningProcess {
    const { argv, connect } = this.commandLine(command, options);
    return spawnLongRunningGroup(argv, options.env ?? {}, connect);
  }

  /**
   * How the fork's commands with network access reach the outside: through slirp4netns, or on the host's
   * network (unsandboxed, or slirp4netns missing and the operator allowed it). Throws where neither may be used.
   */
  outsideNetwork(): OutsideNetwork {
    return sandboxCapabilities().bwrap ? outsideNetworkOf(this.policy) : 'host';
  }

  /** Whether the policy lets the fork's commands share the host's network (SVC_ALLOW_HOST_NETWORK). */
  hostNetworkAllowed(): boolean {
    return this.policy.allowHostNetwork === true;
  }

  /** The namespace path of the fork's private network, if it still exists (checked against its inode). */
  privateNetworkPath(): string | null {
    return namespacePath(this.network, 'net');
  }

  /** The mount namespace holding the fork's overlay open, if it still exists. */
  heldMountPath(): string | null {
    return namespacePath(this.mount, 'mnt');
  }

  /**
   * Mounts the fork's overlay once, in a mount namespace a holder process keeps open, and makes every
   * later command of the fork join it (see `mount`). Answers the holder (stop it to let go), or null for
   * a fork that is not an overlay or where the mount could not be held.
   */
  async holdMount(): Promise<LongRunningProcess | null> {
    if (this.info.mode !== 'overlay' || this.heldMountPath()) return null;
    const root = join(this.info.dir, 'merged');
    const script = 'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" || exit 125\necho mounted\nexec sleep infinity';
    const holder = spawnLongRunningGroup(
      // It dies with the service, as the sandboxes do (their --die-with-parent).
      ['setpriv', '--pdeathsig', 'KILL', 'unshare', '-m', '--propagation', 'private', 'sh', '-c', script, 'sh', lowerdirOption(this.info.lower), join(this.info.dir, 'upper'), join(this.info.dir, 'work'), root],
      {},
    );
    let exited = false;
    void holder.exited.then(() => (exited = true));
    for (let waited = 0; !holder.output().includes('mounted') && !exited && waited < 10_000; waited += 10) {
      await new Promise((resolveWait) => setTimeout(resolveWait, 10));
    }
    try {
      if (!holder.output().includes('mounted')) throw new Error(holder.output().trim() || 'the overlay was not mounted');
      this.mount = { holderPid: holder.pid, inode: readlinkSync(`/proc/${holder.pid}/ns/mnt`) };
      return holder;
    } catch {
      await holder.stop(0);
      return null;
    }
  }

  /**
   * The whole argv that runs `command` in the fork: private network, overlay mount, limits, bubblewrap;
   * `connect`: its sandbox waits to be connected to the outside (`connectSandbox`) before the command starts.
   */
  private commandLine(command: readonly string[], options: RunOptions): { argv: string[]; connect: boolean } {
    const { bwrap } = sandboxCapabilities();
    if (!bwrap && !this.policy.allowUnsandboxed) throw new SandboxUnavailableError();
    if (!bwrap && options.egressDir) throw new Error('a command confined to the credential proxy needs bubblewrap (bwrap), which is not installed');
    const root = this.info.mode === 'overlay' ? join(this.info.dir, 'merged') : this.info.mode === 'direct' ? this.info.dir : join(this.info.dir, 'root');
    // A fork's private network serves the commands of its own network access (connected to the outside or
    // not); any other command makes a network of its own, empty or connected through slirp4netns.
    const wantsOutside = outsideAccess(options);
    const held = bwrap && (this.network?.outside === true) === wantsOutside ? this.privateNetworkPath() : null;
    if (wantsOutside && options.hostNetwork && !this.hostNetworkAllowed()) throw new Error("the host's network is not allowed here (SVC_ALLOW_HOST_NETWORK)");
    const outside: OutsideNetwork | null =
      bwrap && wantsOutside ? (held ? 'slirp4netns' : options.hostNetwork ? 'host' : outsideNetworkOf(this.policy)) : null;
    const connect = outside === 'slirp4netns' && held === null;
    const memoryMiB = options.memoryMiB ?? this.policy.memoryMiB;
    const cpuSeconds = options.cpuSeconds ?? this.policy.cpuSeconds;
    const limits = [
      memoryMiB ? `ulimit -v ${Math.floor(memoryMiB * 1024)}` : '',
      cpuSeconds ? `ulimit -t ${Math.floor(cpuSeconds)}` : '',
    ].filter(Boolean);
    const inner = bwrap ? ['bwrap', ...this.bwrapArgs(root, options, { shared: held !== null, outside, connect }), '--', ...command] : [...command];
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
        ? [lowerdirOption(this.info.lower), join(this.info.dir, 'upper'), join(this.info.dir, 'work'), root]
        : ['', '', '', ''];
    const heldMount = this.heldMountPath();
    const argv = heldMount
      ? ['sh', '-c', script.replace(/^mount .*\n/, ''), 'sh', ...overlayArgs, ...inner]
      : this.info.mode === 'overlay'
        ? ['unshare', '-m', '--propagation', 'private', 'sh', '-c', script, 'sh', ...overlayArgs, ...inner]
        : ['sh', '-c', script, 'sh', ...overlayArgs, ...inner];
    const namespaces = [...(held ? [`--net=${held}`] : []), ...(heldMount ? [`--mount=${heldMount}`] : [])];
    return { argv: namespaces.length > 0 ? ['nsenter', ...namespaces, ...argv] : argv, connect };
  }

  /**
   * `network.shared`: the command joins the fork's private network; `outside`: how it reaches the outside
   * (null: it does not); `connect`: its own network waits for slirp4netns (see `commandLine`).
   */
  private bwrapArgs(root: string, options: RunOptions, network: { shared: boolean; outside: OutsideNetwork | null; connect: boolean }): string[] {
    // A fresh root holding only the system's programs and libraries, read-only: home directories, /srv,
    // /var and wherever the service keeps its data are simply not there.
    // No capabilities: root inside cannot mount, chown to others or otherwise reach past the fork.
    const args = ['--die-with-parent', '--cap-drop', 'ALL'];
    for (const dir of SYSTEM_DIRS) args.push('--ro-bind-try', dir, dir);
    args.push('--dev', '/dev', '--proc', '/proc', '--tmpfs', '/tmp');
    for (const hidden of this.policy.hiddenPaths) {
      if (existsSync(hidden) && SYSTEM_DIRS.some((dir) => hidden === dir || hidden.startsWith(`${dir}/`))) args.push('--tmpfs', hidden);
    }
    // A fallback copy's shared clones borrow the environment's git objects by absolute path.
    if (this.info.mode === 'clone') for (const layer of this.info.lower.layers) args.push('--ro-bind', layer, layer);
    args.push(options.readOnly ? '--ro-bind' : '--bind', root, SANDBOX_ROOT, '--chdir', join(SANDBOX_ROOT, options.cwd ?? ''));
    args.push('--unshare-pid', '--unshare-ipc', '--unshare-uts', '--hostname', 'sandbox');
    if (!network.shared && network.outside !== 'host') args.push('--unshare-net');
    if (network.connect) args.push('--info-fd', String(INFO_FD), '--block-fd', String(BLOCK_FD));
    // A resolver on the host's loopback is not there inside: slirp4netns's forwarder stands in for it; and
    // a resolv.conf linked out of /etc must be bound where the link leads (after --tmpfs /tmp, which could hold it).
    const resolvConf = network.outside ? resolvConfMount(network.outside, SYSTEM_DIRS) : null;
    if (resolvConf) args.push('--ro-bind', resolvConf.source, resolvConf.target);
    if (options.egressDir) args.push('--ro-bind', options.egressDir, EGRESS_DIR);
    // Caches that tools keep in HOME (npm's logs, for one) stay out of the repositories.
    args.push('--setenv', 'HOME', '/tmp');
    for (const [name, value] of Object.entries(options.env ?? {})) args.push('--setenv', name, value);
    return args;
  }
}

/** Whether a command reaches the outside network: asked for, and not confined to an egress directory. */
function outsideAccess(options: Pick<RunOptions, 'network' | 'egressDir'>): boolean {
  return options.network === true && !options.egressDir;
}

/** `/proc/<pid>/ns/<kind>` of a held namespace, if its holder still holds that very namespace. */
function namespacePath(held: ForkNetwork | null, kind: 'net' | 'mnt'): string | null {
  if (!held) return null;
  const path = `/proc/${held.holderPid}/ns/${kind}`;
  try {
    return readlinkSync(path) === held.inode ? path : null;
  } catch {
    return null;
  }
}

const baseEnv = (env: Record<string, string>) => ({ PATH: process.env.PATH ?? '/usr/bin:/bin', LANG: 'C.UTF-8', ...env });

/** Sends `signal` to the process group led by `pid`; false when there is none. */
export function signalGroup(pid: number, signal: NodeJS.Signals): boolean {
  try {
    process.kill(-pid, signal);
    return true;
  } catch {
    return false;
  }
}

/** Whether any process of the group led by `pid` still runs (zombies, waiting to be reaped, do not). */
export function groupRunning(pid: number): boolean {
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
      const [state, , pgid] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      if (Number(pgid) === pid && state !== 'Z' && state !== 'X') return true;
    } catch {
      // gone meanwhile
    }
  }
  return false;
}

/** Kills the group led by `pid` and waits (bounded) until none of it runs any more. */
export async function killGroup(pid: number, timeoutMs = 2_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (groupRunning(pid) && Date.now() < deadline) {
    signalGroup(pid, 'SIGKILL');
    await new Promise((resolveWait) => setTimeout(resolveWait, 20));
  }
}

/**
 * Runs argv (on the host, as it is) as a process group of its own and resolves when the group is gone:
 * whatever the command leaves behind in its group is killed with it.
 */
export function runProcessGroup(argv: readonly string[], options: RunOptions, connect = false): Promise<RunResult> {
  const started = Date.now();
  return new Promise((resolvePromise, reject) => {
    const child = spawn(argv[0]!, argv.slice(1), {
      detached: true,
      stdio: connect ? ['pipe', 'pipe', 'pipe', 'pipe', 'pipe'] : ['pipe', 'pipe', 'pipe'],
      env: baseEnv(options.env ?? {}),
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
      if (child.pid) signalGroup(child.pid, 'SIGKILL');
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
    const disconnect = connect
      ? connectSandbox(child, (message) => {
          stderr += `${message}\n`;
          killGroup();
        })
      : () => undefined;
    child.on('error', (error) => {
      if (timer) clearTimeout(timer);
      disconnect();
      reject(error);
    });
    child.on('close', (exitCode, signal) => {
      if (timer) clearTimeout(timer);
      disconnect();
      options.signal?.removeEventListener('abort', onAbort);
      // Whatever the command left behind in its group goes with it.
      killGroup();
      resolvePromise({ exitCode, signal, timedOut, stdout, stderr, durationMs: Date.now() - started });
    });
  });
}

const OUTPUT_TAIL = 16 * 1024;

function spawnLongRunningGroup(argv: readonly string[], env: Record<string, string>, connect = false): LongRunningProcess {
  const child = spawn(argv[0]!, argv.slice(1), {
    detached: true,
    stdio: connect ? ['ignore', 'pipe', 'pipe', 'pipe', 'pipe'] : ['ignore', 'pipe', 'pipe'],
    env: baseEnv(env),
  });
  let tail = '';
  const collect = (chunk: string) => {
    tail = (tail + chunk).slice(-OUTPUT_TAIL);
  };
  child.stdout!.setEncoding('utf8').on('data', collect);
  child.stderr!.setEncoding('utf8').on('data', collect);
  const disconnect = connect
    ? connectSandbox(child, (message) => {
        collect(`${message}\n`);
        if (child.pid) signalGroup(child.pid, 'SIGKILL');
      })
    : () => undefined;
  const exited = new Promise<{ exitCode: number | null; signal: NodeJS.Signals | null }>((resolveExit) => {
    child.on('error', (error) => {
      disconnect();
      collect(`${error.message}\n`);
      resolveExit({ exitCode: null, signal: null });
    });
    child.on('close', (exitCode, signal) => {
      disconnect();
      if (child.pid) signalGroup(child.pid, 'SIGKILL');
      resolveExit({ exitCode, signal });
    });
  });
  const pid = child.pid ?? -1;
  return {
    pid,
    output: () => tail,
    exited,
    async stop(graceMs = 2_000) {
      if (pid <= 0) return;
      if (signalGroup(pid, 'SIGTERM')) {
        const timer = setTimeout(() => signalGroup(pid, 'SIGKILL'), graceMs);
        await exited;
        clearTimeout(timer);
      }
      // The leader gone, its group may still hold a process that outlived it.
      await killGroup(pid);
    },
  };
}

/**
 * A sandbox over a directory itself, writable, with no fork in between: for the workspace environment's
 * setup commands, which install dependencies into the environment that every fork then starts from.
 */
export function directSandbox(dir: string, policy: SandboxPolicy): Fork {
  const path = resolve(dir);
  return new Fork({ name: 'environment', mode: 'direct', lower: { version: 0, layers: [path] }, dir: path }, policy);
}

/** Creates and removes forks under `forksRoot`. */
export class ForkManager {
  constructor(
    private readonly forksRoot: string,
    private readonly policy: SandboxPolicy,
    private readonly log: (message: string) => void = () => undefined,
  ) {}

  /** Where the fork named `name` keeps its files, and its archive once archived. */
  dirOf(name: string): string {
    if (!FORK_NAME.test(name)) throw new Error(`fork name "${name}" must be 1-64 letters, digits, "-" or "_"`);
    return join(resolve(this.forksRoot), name);
  }

  archiveOf(name: string): string {
    return `${this.dirOf(name)}${ARCHIVE_SUFFIX}`;
  }

  /**
   * Makes the fork `name` of an environment version (or of a plain directory, a version of one layer).
   * The version is written beside the fork, so that it is reopened on the very same layers.
   */
  async create(name: string, lower: string | EnvironmentSnapshot, options: { mode?: ForkMode; fullCopy?: boolean } = {}): Promise<Fork> {
    const dir = this.dirOf(name);
    const snapshot = await checkedSnapshot(typeof lower === 'string' ? { version: 0, layers: [lower] } : lower);
    if (existsSync(dir)) throw new Error(`fork "${name}" already exists`);
    // Only the service's user may enter the forks: a sandboxed command runs as root and could leave a
    // setuid file in its fork, which no other local user must be able to reach.
    await mkdir(resolve(this.forksRoot), { recursive: true, mode: 0o700 });
    let mode = options.mode ?? (sandboxCapabilities().overlay ? 'overlay' : 'clone');
    if (mode === 'overlay' && !sandboxCapabilities().overlay) mode = 'clone';
    if (mode === 'clone' && snapshot.layers.length !== 1) {
      throw new Error(`environment version ${snapshot.version} has ${snapshot.layers.length} layers, which only overlay mounts can combine; this host cannot mount overlays`);
    }
    await writeFile(`${dir}${LOWER_SUFFIX}`, JSON.stringify(snapshot));
    if (mode === 'overlay') {
      await mkdir(join(dir, 'upper'), { recursive: true });
      await mkdir(join(dir, 'work'));
      await mkdir(join(dir, 'merged'));
    } else {
      if (options.fullCopy) {
        await copyTree(snapshot.layers[0]!, join(dir, 'root'));
      } else {
        this.log(`fork ${name}: overlay mounts are unavailable here; copying the environment (git clone --local --shared)`);
        await copyEnvironment(snapshot.layers[0]!, join(dir, 'root'));
      }
    }
    return new Fork({ name, mode, lower: snapshot, dir }, this.policy);
  }

  /**
   * The fork `name` whose directory exists already (made by `create` or `restore`), on the environment
   * version it was made from; null when that version is not recorded (a fork from before versions).
   */
  async open(name: string, mode: ForkMode): Promise<Fork | null> {
    const lower = this.lowerOf(name);
    return lower ? new Fork({ name, mode, lower, dir: this.dirOf(name) }, this.policy) : null;
  }

  /** The environment version the fork `name` was made from, as recorded beside it. */
  lowerOf(name: string): EnvironmentSnapshot | null {
    return readSnapshot(`${this.dirOf(name)}${LOWER_SUFFIX}`);
  }

  async remove(fork: Fork): Promise<void> {
    await rm(fork.info.dir, { recursive: true, force: true });
  }

  /** Removes whatever the fork `name` has here: its directory, its archive, a restore under way. */
  async removeAll(name: string): Promise<void> {
    const dir = this.dirOf(name);
    for (const path of [dir, `${dir}${RESTORING_SUFFIX}`, `${dir}${LOWER_SUFFIX}`, this.archiveOf(name)]) await rm(path, { recursive: true, force: true });
    await this.removeTemporaryArchives(name);
  }

  /** Temporary archives that an archive move which crashed (or was taken over) left behind. */
  private async removeTemporaryArchives(name: string): Promise<void> {
    const prefix = `${name}${ARCHIVE_SUFFIX}.`;
    const parent = resolve(this.forksRoot);
    if (!existsSync(parent)) return;
    for (const entry of await readdir(parent)) {
      if (entry.startsWith(prefix) && entry.endsWith('.tmp')) await rm(join(parent, entry), { force: true });
    }
  }

  /**
   * Keeps the fork compactly: a gzipped tar of its own files only (an overlay fork's changes, with their
   * whiteouts and overlay attributes), written under a temporary name and renamed into place, then its
   * directory is removed. `check` runs before each of those two steps and throws to abandon the move.
   * A fork whose directory is gone already keeps the archive it has.
   */
  async archive(name: string, mode: ForkMode, check: () => Promise<void> = async () => undefined): Promise<void> {
    const dir = this.dirOf(name);
    await this.removeTemporaryArchives(name);
    if (!existsSync(dir)) return;
    const archive = this.archiveOf(name);
    const temporary = `${archive}.${process.pid}-${Date.now()}.tmp`;
    try {
      await runTar(['--create', '--file', temporary, '--directory', changesDirOf({ mode, dir }), '.']);
      await check();
      await rename(temporary, archive);
    } finally {
      await rm(temporary, { force: true });
    }
    await check();
    await rm(dir, { recursive: true, force: true });
  }

  /**
   * Restores an archived fork: unpacked beside its place, renamed into it (so a crash leaves either the
   * archive or the whole fork), then the archive is removed.
   */
  async restore(name: string, mode: ForkMode): Promise<Fork | null> {
    const dir = this.dirOf(name);
    const staging = `${dir}${RESTORING_SUFFIX}`;
    await rm(staging, { recursive: true, force: true });
    await mkdir(staging, { recursive: true });
    if (mode === 'overlay') {
      await mkdir(join(staging, 'work'));
      await mkdir(join(staging, 'merged'));
    }
    const changes = changesDirOf({ mode, dir: staging });
    await mkdir(changes);
    await runTar(['--extract', '--file', this.archiveOf(name), '--directory', changes]);
    await rename(staging, dir);
    await rm(this.archiveOf(name), { force: true });
    return this.open(name, mode);
  }
}

const ARCHIVE_SUFFIX = '.tar.gz';
/** Beside a fork: the environment version it was made from (JSON EnvironmentSnapshot). */
export const LOWER_SUFFIX = '.lower';

/** A recorded snapshot, or null when there is none or it is not one. */
export function readSnapshot(path: string): EnvironmentSnapshot | null {
  try {
    const parsed = JSON.parse(readFileSync(path, 'utf8')) as Partial<EnvironmentSnapshot>;
    if (!Number.isInteger(parsed.version) || !Array.isArray(parsed.layers) || parsed.layers.some((layer) => typeof layer !== 'string')) return null;
    return { version: parsed.version!, layers: parsed.layers };
  } catch {
    return null;
  }
}
const RESTORING_SUFFIX = '.restoring';

async function runTar(args: string[]): Promise<void> {
  // Overlay whiteouts are device files and opaque directories carry trusted.overlay.* attributes: both
  // must survive the round trip (as root, which overlay forks need anyway).
  const result = await runProcessGroup(['tar', '--gzip', '--numeric-owner', '--xattrs', '--xattrs-include=trusted.*', ...args], { timeoutMs: 60 * 60_000 });
  if (result.exitCode !== 0) throw new Error(`tar ${args[0]} failed (${result.exitCode ?? result.signal}): ${result.stderr.trim()}`);
}

async function checkedSnapshot(snapshot: EnvironmentSnapshot): Promise<EnvironmentSnapshot> {
  if (snapshot.layers.length === 0) throw new Error(`environment version ${snapshot.version} has no layers`);
  const layers: string[] = [];
  for (const layer of snapshot.layers) {
    const path = resolve(layer);
    // The overlay options separate layers with ":" and options with ",".
    if (/[,:]/.test(path)) throw new Error(`environment layer ${path} may not contain "," or ":"`);
    if (!(await stat(path)).isDirectory()) throw new Error(`environment layer ${path} is not a directory`);
    layers.push(path);
  }
  const checked = { version: snapshot.version, layers };
  if (lowerdirOption(checked).length > MAX_MOUNT_OPTIONS) throw new Error(`environment version ${snapshot.version} has too many layers to mount (${layers.length})`);
  return checked;
}

/** A whole copy, every file as it is (links not followed), on the host. */
async function copyTree(source: string, target: string): Promise<void> {
  await mkdir(target, { recursive: true });
  const result = await runProcessGroup(['cp', '-a', '--', `${source}/.`, `${target}/`], { timeoutMs: 60 * 60_000 });
  if (result.exitCode !== 0) throw new Error(`copying ${source} failed: ${result.stderr.trim()}`);
}

/** The fallback copy: git repositories as shared local clones, everything else copied as it is. */
async function copyEnvironment(source: string, target: string): Promise<void> {
  await mkdir(target, { recursive: true });
  for (const entry of await readdir(source, { withFileTypes: true })) {
    const from = join(source, entry.name);
    const to = join(target, entry.name);
    if (entry.isDirectory() && existsSync(join(from, '.git'))) {
      const clone = spawnSync('git', ['clone', '--quiet', '--local', '--shared', '--', from, to], { encoding: 'utf8' });
      if (clone.status !== 0) throw new Error(`git clone of ${from} failed: ${clone.stderr.trim()}`);
      // Uncommitted work and untracked files (installed dependencies) come along as well.
      const gitDir = join(from, '.git');
      await cp(from, to, { recursive: true, force: true, filter: (path) => path !== gitDir && !path.startsWith(`${gitDir}/`) });
    } else {
      await cp(from, to, { recursive: true, verbatimSymlinks: true });
    }
  }
}
