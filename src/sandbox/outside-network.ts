/**
 * The outside network of sandboxed commands with network access: a private network namespace of their
 * own, connected to the outside by slirp4netns (user-mode networking) with `--disable-host-loopback`.
 *
 * Sharing the host's network namespace would let an agent's command reach whatever listens on the host's
 * loopback: the service's own database (PostgreSQL with trust authentication on 127.0.0.1), its API, the
 * services of other workspaces. Through slirp4netns the sandbox has an interface (tap0, 10.0.2.100, the
 * gateway 10.0.2.2 and the DNS forwarder 10.0.2.3), and 127.0.0.1 is its own loopback; the host's
 * loopback cannot be reached at all.
 *
 * A sandbox is connected in three steps: bubblewrap makes the namespace and reports its child's pid on
 * its info fd, then waits on its block fd; slirp4netns attaches to that pid's namespace and says on its
 * ready fd when the interface is configured; then the block fd lets the command start. slirp4netns does
 * not exit when the namespace goes away, so whoever started it stops it with the sandbox; its exit fd is
 * a pipe from this process, so it also ends should this process die.
 *
 * Where slirp4netns is missing, commands with network access fail with a message naming the package,
 * unless the operator allowed the host's network (SVC_ALLOW_HOST_NETWORK), the old behaviour.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Readable, Writable } from 'node:stream';

/** How a command with network access reaches the outside. */
export type OutsideNetwork = 'slirp4netns' | 'host';

/** The fds a sandbox connected through slirp4netns is started with (bubblewrap's --info-fd, --block-fd). */
export const INFO_FD = 3;
export const BLOCK_FD = 4;

/** Where slirp4netns forwards DNS queries to the host's resolver. */
const SLIRP_DNS = '10.0.2.3';
const READY_TIMEOUT_MS = 10_000;

export class OutsideNetworkUnavailableError extends Error {
  constructor() {
    super(
      'slirp4netns is not installed, so commands with network access cannot get a network of their own ' +
        "(the host's would expose the services on its loopback); install it with `apt-get install -y slirp4netns`, " +
        "or share the host's network explicitly (SVC_ALLOW_HOST_NETWORK=true)",
    );
    this.name = 'OutsideNetworkUnavailableError';
  }
}

let slirpInstalled: boolean | null = null;

/** Probes once whether slirp4netns runs here. */
export function slirp4netnsAvailable(): boolean {
  slirpInstalled ??= spawnSync('slirp4netns', ['--version'], { stdio: 'ignore' }).status === 0;
  return slirpInstalled;
}

/** The outside network of commands with network access under this policy; throws where there is none. */
export function outsideNetworkOf(policy: { allowHostNetwork?: boolean }, installed: boolean = slirp4netnsAvailable()): OutsideNetwork {
  if (installed) return 'slirp4netns';
  if (policy.allowHostNetwork) return 'host';
  throw new OutsideNetworkUnavailableError();
}

/** One line for the log: how commands with network access will reach the outside. */
export function describeOutsideNetwork(policy: { allowHostNetwork?: boolean }): string {
  if (slirp4netnsAvailable()) return 'commands with network access get a private network through slirp4netns (no access to the host loopback)';
  if (policy.allowHostNetwork) return "slirp4netns is not installed: commands with network access share the host's network (SVC_ALLOW_HOST_NETWORK)";
  return 'slirp4netns is not installed: commands with network access will fail (`apt-get install -y slirp4netns`, or SVC_ALLOW_HOST_NETWORK=true)';
}

/** slirp4netns attached to a namespace: stop it when the namespace's sandbox ends. */
export interface SlirpProcess {
  readonly pid: number;
  /** Kills it; resolves once it has exited. */
  stop(): Promise<void>;
}

/**
 * Waits (bounded) until the namespace's loopback is up, as bubblewrap brings it up: bubblewrap reports its
 * child while that child still sets up the loopback, and slirp4netns bringing `lo` up meanwhile (the kernel
 * then adds 127.0.0.1 itself) fails bubblewrap's own request ("loopback: Failed RTM_NEWADDR").
 */
async function loopbackUp(targetPid: number): Promise<void> {
  const deadline = Date.now() + READY_TIMEOUT_MS;
  while (Date.now() < deadline) {
    try {
      // The local route of 127.0.0.1 exists once lo is up with its address.
      if (readFileSync(`/proc/${targetPid}/net/fib_trie`, 'utf8').includes('127.0.0.1')) return;
    } catch {
      return; // gone, or not ours to read: slirp4netns reports what it finds
    }
    await new Promise((resolveWait) => setTimeout(resolveWait, 2));
  }
}

/**
 * Starts slirp4netns on the network namespace of `targetPid` and resolves once the namespace's tap0 is
 * configured; rejects with its error output when it exits first or does not get ready in time.
 * `detached` makes it a process group of its own (so that it can be recorded and stopped by any process).
 */
export async function startSlirp(targetPid: number, options: { detached?: boolean } = {}): Promise<SlirpProcess> {
  await loopbackUp(targetPid);
  const args = ['--configure', '--mtu=65520', '--disable-host-loopback', '--ready-fd=3', '--exit-fd=4', String(targetPid), 'tap0'];
  const child = spawn('slirp4netns', args, { detached: options.detached ?? false, stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'] });
  const exitFd = child.stdio[4] as Writable;
  exitFd.on('error', () => undefined);
  const exited = new Promise<void>((resolveExit) => {
    child.once('error', () => resolveExit());
    child.once('exit', () => resolveExit());
  });
  const slirp: SlirpProcess = {
    pid: child.pid ?? -1,
    async stop() {
      exitFd.destroy();
      if (child.pid !== undefined && child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      await exited;
    },
  };
  let stderr = '';
  child.stderr?.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk));
  return new Promise((resolveReady, reject) => {
    const fail = (why: string) => {
      clearTimeout(timer);
      void slirp.stop();
      reject(new Error(`slirp4netns could not connect the sandbox: ${stderr.trim().split('\n').pop() || why}`));
    };
    const timer = setTimeout(() => fail('it did not get ready in time'), READY_TIMEOUT_MS);
    (child.stdio[3] as Readable).once('data', () => {
      clearTimeout(timer);
      resolveReady(slirp);
    });
    child.once('error', (error) => fail(error.message));
    child.once('exit', (code, signal) => fail(`it exited (${signal ?? code})`));
  });
}

/**
 * Connects a sandbox that bubblewrap is starting with `--info-fd INFO_FD --block-fd BLOCK_FD` (possibly
 * under nsenter, unshare and sh, which pass the fds on): attaches slirp4netns to its namespace, then lets
 * the command start. `fail` hears why it could not be connected (the caller then ends the sandbox).
 * Answers a function that stops slirp4netns: call it when the sandbox has ended.
 */
export function connectSandbox(child: ChildProcess, fail: (message: string) => void): () => void {
  const info = child.stdio[INFO_FD] as Readable;
  const block = child.stdio[BLOCK_FD] as Writable;
  block.on('error', () => undefined);
  info.on('error', () => undefined);
  let slirp: SlirpProcess | null = null;
  let ended = false;
  let reported = '';
  const onInfo = (chunk: string) => {
    reported += chunk;
    const match = /"child-pid":\s*(\d+)/.exec(reported);
    if (!match) return;
    info.off('data', onInfo);
    info.resume();
    startSlirp(Number(match[1])).then(
      (started) => {
        if (ended) return void started.stop();
        slirp = started;
        block.end('1');
      },
      (error: Error) => {
        if (!ended) fail(error.message);
      },
    );
  };
  info.setEncoding('utf8').on('data', onInfo);
  return () => {
    ended = true;
    void slirp?.stop();
    block.destroy();
  };
}

/**
 * The resolv.conf a sandbox connected through slirp4netns needs instead of the host's, or null when the
 * host's serves: a resolver on the host's loopback (systemd-resolved's 127.0.0.53, a local dnsmasq) is not
 * there inside, so its lines give way to slirp4netns's forwarder, which queries the host's resolver.
 */
export function sandboxResolvConf(hostResolvConf: string): string | null {
  const lines = hostResolvConf.split('\n');
  const loopback = (line: string) => /^\s*nameserver\s+(127\.\S*|::1|0\.0\.0\.0)\s*$/.test(line);
  if (!lines.some(loopback)) return null;
  const kept = lines.filter((line) => !loopback(line) && line.trim() !== '');
  return [`nameserver ${SLIRP_DNS}`, ...kept].join('\n') + '\n';
}

let resolvConf: { path: string | null } | null = null;

/** A file holding `sandboxResolvConf` of this host's /etc/resolv.conf (written once), or null if not needed. */
export function sandboxResolvConfPath(): string | null {
  if (resolvConf) return resolvConf.path;
  let content: string | null = null;
  try {
    content = sandboxResolvConf(readFileSync('/etc/resolv.conf', 'utf8'));
  } catch {
    // No resolv.conf: nothing to replace.
  }
  let path: string | null = null;
  if (content !== null) {
    path = join(mkdtempSync(join(tmpdir(), 'svc-resolv-')), 'resolv.conf');
    writeFileSync(path, content, { mode: 0o644 });
  }
  resolvConf = { path };
  return path;
}
