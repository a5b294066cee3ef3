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
 * Where slirp4netns or the TUN device it needs (/dev/net/tun) is missing, commands with network access fail
 * with a message naming what is missing, unless the operator allowed the host's network
 * (SVC_ALLOW_HOST_NETWORK), the old behaviour.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { closeSync, existsSync, mkdtempSync, openSync, readFileSync, readlinkSync, realpathSync, renameSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import type { Readable, Writable } from 'node:stream';

/** How a command with network access reaches the outside. */
export type OutsideNetwork = 'slirp4netns' | 'host';

/** The fds a sandbox connected through slirp4netns is started with (bubblewrap's --info-fd, --block-fd). */
export const INFO_FD = 3;
export const BLOCK_FD = 4;

/** Where slirp4netns forwards DNS queries to the host's resolver. */
const SLIRP_DNS = '10.0.2.3';
const READY_TIMEOUT_MS = 10_000;

const TUN_DEVICE = '/dev/net/tun';

/** What a private network needs that this host lacks: the program, or the TUN device it makes tap0 with. */
export type OutsideNetworkMissing = 'slirp4netns' | typeof TUN_DEVICE;

export class OutsideNetworkUnavailableError extends Error {
  constructor(readonly missing: OutsideNetworkMissing = 'slirp4netns') {
    super(
      `${missingText(missing)}, so commands with network access cannot get a network of their own ` +
        `(the host's would expose the services on its loopback); ${missing === 'slirp4netns' ? 'install it with ' : ''}${remedyOf(missing)}, ` +
        "or share the host's network explicitly (SVC_ALLOW_HOST_NETWORK=true)",
    );
    this.name = 'OutsideNetworkUnavailableError';
  }
}

function missingText(missing: OutsideNetworkMissing): string {
  return missing === 'slirp4netns' ? 'slirp4netns is not installed' : `${TUN_DEVICE} is not available`;
}

function remedyOf(missing: OutsideNetworkMissing): string {
  return missing === 'slirp4netns' ? '`apt-get install -y slirp4netns`' : `make ${TUN_DEVICE} available to the service (a container: \`--device ${TUN_DEVICE}\`)`;
}

/**
 * What of slirp4netns's needs this host lacks, or null: the program, and the TUN device it opens to make
 * tap0 (a container often has no /dev/net/tun; slirp4netns then fails every sandbox with "child failed").
 */
export function probeOutsideNetwork(options: { tunDevice?: string; program?: string } = {}): OutsideNetworkMissing | null {
  if (spawnSync(options.program ?? 'slirp4netns', ['--version'], { stdio: 'ignore' }).status !== 0) return 'slirp4netns';
  try {
    closeSync(openSync(options.tunDevice ?? TUN_DEVICE, 'r+'));
  } catch {
    return TUN_DEVICE;
  }
  return null;
}

let probed: { missing: OutsideNetworkMissing | null } | null = null;

/** What private networks lack here (probed once), or null when they work. */
export function outsideNetworkMissing(): OutsideNetworkMissing | null {
  probed ??= { missing: probeOutsideNetwork() };
  return probed.missing;
}

/** Whether commands with network access can get a private network here (slirp4netns and its TUN device). */
export function slirp4netnsAvailable(): boolean {
  return outsideNetworkMissing() === null;
}

/**
 * The outside network of commands with network access under this policy; throws where there is none.
 * `missing`: what private networks lack here (null: nothing).
 */
export function outsideNetworkOf(policy: { allowHostNetwork?: boolean }, missing: OutsideNetworkMissing | null = outsideNetworkMissing()): OutsideNetwork {
  if (missing === null) return 'slirp4netns';
  if (policy.allowHostNetwork) return 'host';
  throw new OutsideNetworkUnavailableError(missing);
}

/** One line for the log: how commands with network access will reach the outside. */
export function describeOutsideNetwork(policy: { allowHostNetwork?: boolean }, missing: OutsideNetworkMissing | null = outsideNetworkMissing()): string {
  if (missing === null) return 'commands with network access get a private network through slirp4netns (no access to the host loopback)';
  if (policy.allowHostNetwork) return `${missingText(missing)}: commands with network access share the host's network (SVC_ALLOW_HOST_NETWORK)`;
  return `${missingText(missing)}: commands with network access will fail (${remedyOf(missing)}, or SVC_ALLOW_HOST_NETWORK=true)`;
}

/** slirp4netns attached to a namespace: stop it when the namespace's sandbox ends. */
export interface SlirpProcess {
  readonly pid: number;
  /** Kills it; resolves once it has exited. */
  stop(): Promise<void>;
}

/** How long `loopbackUp` waits where it cannot see the namespace's routes. */
const UNSEEN_LOOPBACK_WAIT_MS = 100;

/**
 * Waits (bounded) until the namespace's loopback is up, as bubblewrap brings it up: bubblewrap reports its
 * child while that child still sets up the loopback, and slirp4netns bringing `lo` up meanwhile (the kernel
 * then adds 127.0.0.1 itself) fails bubblewrap's own request ("loopback: Failed RTM_NEWADDR").
 * Returns at once only where the process is gone (slirp4netns then reports that). Where its routes cannot
 * be read (hidepid, a process whose credentials are changing), returning at once would race bubblewrap
 * again, and polling to the bound would delay every command by it: it keeps trying for a short fixed while,
 * far longer than bubblewrap's one netlink request takes, then lets slirp4netns go ahead.
 * `read` is there for tests.
 */
export async function loopbackUp(targetPid: number, read: (path: string) => string = (path) => readFileSync(path, 'utf8')): Promise<void> {
  const deadline = Date.now() + READY_TIMEOUT_MS;
  let unseenUntil: number | null = null;
  while (Date.now() < deadline) {
    try {
      // The local route of 127.0.0.1 exists once lo is up with its address.
      if (read(`/proc/${targetPid}/net/fib_trie`).includes('127.0.0.1')) return;
    } catch (error) {
      const code = (error as NodeJS.ErrnoException).code;
      if (code === 'ENOENT' || code === 'ESRCH') return;
      unseenUntil ??= Date.now() + UNSEEN_LOOPBACK_WAIT_MS;
      if (Date.now() >= unseenUntil) return;
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

/** A file to bind into a sandbox so that its /etc/resolv.conf resolves: `target` is a path inside the sandbox. */
export interface ResolvConfMount {
  source: string;
  target: string;
}

/**
 * What a sandbox must have bound for its /etc/resolv.conf to serve, or null where the host's serves as the
 * sandbox sees it. `outside`: how the sandbox reaches the outside; `boundDirs`: the host directories it has
 * at the same paths (/etc among them). `hostPath` is there for tests.
 *
 * /etc/resolv.conf is often a link out of /etc (systemd-resolved's to /run/systemd/resolve/stub-resolv.conf):
 * inside, that link dangles, and bubblewrap cannot bind a file over it ("Can't create file at
 * /etc/resolv.conf"). So the file is bound where the link leads inside the sandbox, which bubblewrap creates
 * on the sandbox's own root: slirp4netns's resolv.conf where the host resolves on its loopback, the host's
 * real file otherwise.
 */
export function resolvConfMount(outside: OutsideNetwork, boundDirs: readonly string[], hostPath = '/etc/resolv.conf'): ResolvConfMount | null {
  const end = linkEnd(hostPath, boundDirs);
  if (end === null) return null;
  const generated = outside === 'slirp4netns' ? generatedResolvConf(hostPath) : null;
  if (generated !== null) return { source: generated, target: end.path };
  if (end.bound) return null;
  try {
    return { source: realpathSync(hostPath), target: end.path };
  } catch {
    return null; // a link dangling on the host too: there is no resolver to show
  }
}

/**
 * Where the link chain from `path` ends inside a sandbox that has `boundDirs`: at a file in those
 * directories (`bound`), or at the first path outside them, where the sandbox has nothing. Null where the
 * host has nothing either. Links are followed one at a time, as the kernel does inside the sandbox: a
 * directory link on the way (/var/run to /run) is not there inside, so realpath would name the wrong place.
 */
function linkEnd(path: string, boundDirs: readonly string[]): { path: string; bound: boolean } | null {
  let current = resolve(path);
  for (let hop = 0; hop < 40; hop++) {
    if (!boundDirs.some((dir) => current === dir || current.startsWith(`${dir}/`))) return { path: current, bound: false };
    let link: string;
    try {
      link = readlinkSync(current);
    } catch (error) {
      return (error as NodeJS.ErrnoException).code === 'EINVAL' ? { path: current, bound: true } : null;
    }
    current = resolve(dirname(current), link);
  }
  return null;
}

let generated: { hostPath: string; hostContent: string; path: string } | null = null;

/**
 * A file holding `sandboxResolvConf` of the host's resolv.conf, or null if the host's serves. Checked at
 * every use: the host's resolver may have changed (a new network), and a tmp cleaner may have removed the
 * file (it lives in the tmp dir: nothing of the service's own is in reach here); either way it is written
 * anew. It is replaced by a rename, so a sandbox binding it meanwhile never sees it half written.
 */
function generatedResolvConf(hostPath: string): string | null {
  let hostContent: string;
  try {
    hostContent = readFileSync(hostPath, 'utf8');
  } catch {
    return null; // no resolv.conf: nothing to replace
  }
  const content = sandboxResolvConf(hostContent);
  if (content === null) return null;
  if (generated && generated.hostPath === hostPath && generated.hostContent === hostContent && existsSync(generated.path)) return generated.path;
  let dir = generated ? dirname(generated.path) : null;
  if (dir === null || !existsSync(dir)) dir = mkdtempSync(join(tmpdir(), 'svc-resolv-'));
  const path = join(dir, 'resolv.conf');
  const partial = join(dir, `resolv.conf.${process.pid}.tmp`);
  writeFileSync(partial, content, { mode: 0o644 });
  renameSync(partial, path);
  generated = { hostPath, hostContent, path };
  return path;
}
