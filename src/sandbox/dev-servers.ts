/**
 * Dev servers in a fork: each repository's long-running servers (`devServers` in the environment config),
 * started in the sandbox while the agent works so that its commands and the checks can talk to them.
 *
 * The servers and the agent's commands share one private network namespace per fork: a holder process
 * (bubblewrap with --unshare-net, which also brings up loopback) keeps it, the servers are started inside
 * it, and every later `fork.run` of the same network access joins it (`fork.network`). So 127.0.0.1:<port>
 * is the dev server. Without network access nothing outside the fork is reachable; with it, the namespace
 * is connected to the outside through slirp4netns (outside-network.ts), which never reaches the host's
 * loopback. Two forks never see each other's ports: both can use a server's preferred port. Without
 * network access, where the namespace cannot be made (no `nsenter` rights), the servers run on the host's
 * network only where the operator allowed that (SVC_ALLOW_HOST_NETWORK), and the log says so; the agent's
 * commands stay isolated then and cannot reach them. Otherwise they are not started and each is reported
 * unhealthy with the reason: a network of their own through slirp4netns would be out of the health check's
 * reach, and would give servers of an environment without network access the outside. With network
 * access the servers run on the host network only where the fork's commands do (slirp4netns missing and
 * the host's network allowed); a namespace that cannot be made or connected fails the start.
 *
 * The processes are recorded in the fork's directory (`processes.json`, outside the files the agent sees),
 * so that the fork lifecycle can stop them from any process on the host.
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync, readlinkSync } from 'node:fs';
import { rename, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { join } from 'node:path';
import type { DevServerSpec, EnvironmentConfig } from './environment.js';
import { killGroup, runProcessGroup, sandboxCapabilities, signalGroup, SYSTEM_DIRS, type Fork, type ForkNetwork, type LongRunningProcess } from './fork.js';
import { startSlirp } from './outside-network.js';

export interface DevServerTarget {
  /** The repository's directory, relative to the fork's root: the server's working directory. */
  repoDir: string;
  spec: DevServerSpec;
}

export interface DevServerStatus {
  name: string;
  port: number;
  /** Where the fork's commands reach it: `http://127.0.0.1:<port>`. */
  url: string;
  healthy: boolean;
  /** Why it is not healthy, with the tail of its output. */
  error?: string;
}

export interface RunningDevServers {
  servers: DevServerStatus[];
  /** `SVC_DEV_<NAME>_URL` and `SVC_DEV_<NAME>_PORT` of each healthy server, for the agent's commands. */
  env(): Record<string, string>;
  /** Stops every server's process group and the network holder; nothing of them is left running. */
  stop(): Promise<void>;
}

export interface DevServerOptions {
  network: boolean;
  signal?: AbortSignal;
  log?: (message: string) => void;
  /** Why no private network can be made, instead of trying (tests stand in for a host without nsenter rights). */
  noPrivateNetwork?: string;
}

/** A process recorded in the fork's directory, identified beyond its pid by its start time. */
export interface ProcessRecord {
  name: string;
  pid: number;
  startTime: string;
}

const PROCESSES_FILE = 'processes.json';
const PROBE_INTERVAL_MS = 200;
const OUTPUT_TAIL_CHARS = 2_000;
const STOP_GRACE_MS = 2_000;
/** Where ports are handed out inside a private namespace for servers without a preferred one. */
const FIRST_PRIVATE_PORT = 3000;

/** Every dev server of the environment config, with its repository's directory. */
export function devServerTargets(config: EnvironmentConfig): DevServerTarget[] {
  return config.repositories.flatMap((repository) => repository.devServers.map((spec) => ({ repoDir: repository.dir, spec })));
}

/**
 * Starts the servers in the fork and waits until each answers its health path (below 500) or its start
 * timeout passes. A server that fails is reported (healthy: false, with its output) and stopped; it never
 * fails the call. Processes a previous start left in this fork are stopped first. Accepts the environment
 * config itself as well (`StartDevServers` of the executor).
 */
export async function startDevServers(
  fork: Fork,
  servers: DevServerTarget[] | EnvironmentConfig,
  options: DevServerOptions,
): Promise<RunningDevServers> {
  const targets = Array.isArray(servers) ? servers : devServerTargets(servers);
  const log = options.log ?? (() => undefined);
  await stopRecordedProcesses(fork.info.dir, readProcessRecords(fork.info.dir));
  fork.network = null;
  if (targets.length === 0) return running(fork, [], [], null);
  const records: ProcessRecord[] = [];
  // One overlay mount for the servers and every command of the fork while they run (see Fork.mount).
  const mount = await fork.holdMount();
  if (mount) records.push(processRecord('mount', mount.pid));
  let holder: LongRunningProcess | null = null;
  const stopMount = async () => {
    await mount?.stop(STOP_GRACE_MS);
    fork.mount = null;
  };
  // With network access, a private network connected through slirp4netns (or the host's, as the fork's
  // commands have it where slirp4netns is missing and the operator allowed that).
  let outside: boolean;
  try {
    outside = options.network && fork.outsideNetwork() === 'slirp4netns';
  } catch (error) {
    await stopMount();
    throw error;
  }
  // Without a private network (none could be made), servers without network access use the host's.
  let hostNetwork = false;
  if (!options.network || outside) {
    const made = options.noPrivateNetwork ?? (await makePrivateNetwork(outside));
    if (typeof made !== 'string') {
      holder = made.holder;
      fork.network = made.network;
      records.push(processRecord('network', holder.pid));
      if (made.slirpPid !== null) records.push(processRecord('network-outside', made.slirpPid));
    } else if (outside) {
      log(`dev servers cannot start: a private network for the fork could not be made or connected (${made})`);
      await stopMount();
      throw new Error(`the dev servers of a fork with network access need a private network connected through slirp4netns, which could not be made: ${made}`);
    } else if (fork.hostNetworkAllowed()) {
      hostNetwork = true;
      log(
        `dev servers of fork ${fork.info.name} run on the host's network (SVC_ALLOW_HOST_NETWORK; a private network for the fork could not be made: ${made}); commands without network access cannot reach them`,
      );
    } else {
      // In a network of their own through slirp4netns the health check could not reach them, and
      // servers of an environment without network access would have the outside.
      const error = `dev servers need a private network namespace: ${made}`;
      log(`dev servers of fork ${fork.info.name} not started: ${error}`);
      await stopMount();
      const taken = new Set<number>();
      const unstarted = targets.map(({ spec }): DevServerStatus => {
        const port = privatePort(spec.port, taken);
        taken.add(port);
        return { name: spec.name, port, url: `http://127.0.0.1:${port}`, healthy: false, error };
      });
      return running(fork, [], [], null, null, unstarted);
    }
  }
  if (outside) log(`dev servers of fork ${fork.info.name} run in a private network connected through slirp4netns`);
  const started: StartedServer[] = [];
  const stopAll = async () => {
    await Promise.all(started.map(({ handle }) => handle.stop(STOP_GRACE_MS)));
    await holder?.stop(STOP_GRACE_MS);
    fork.network = null;
    await stopMount();
    await writeProcessRecords(fork.info.dir, []);
  };
  try {
    const taken = new Set<number>();
    for (const { repoDir, spec } of targets) {
      const port = fork.network ? privatePort(spec.port, taken) : await hostPort(spec.port, taken);
      taken.add(port);
      const handle = fork.spawnLongRunning(['sh', '-c', spec.command], {
        cwd: repoDir,
        env: { PORT: String(port) },
        network: options.network || hostNetwork,
        hostNetwork,
      });
      records.push(processRecord(spec.name, handle.pid));
      await writeProcessRecords(fork.info.dir, records);
      started.push({ status: { name: spec.name, port, url: `http://127.0.0.1:${port}`, healthy: false }, handle, spec });
    }
    const probeNetwork = fork.privateNetworkPath();
    await Promise.all(started.map((server) => awaitHealthy(server, probeNetwork, options.signal)));
    options.signal?.throwIfAborted();
  } catch (error) {
    await stopAll();
    throw error;
  }
  for (const server of started.filter(({ status }) => !status.healthy)) {
    log(`dev server ${server.status.name} did not start: ${server.status.error ?? ''}`);
    await server.handle.stop(STOP_GRACE_MS);
  }
  return running(fork, started, records, holder, mount);
}

interface StartedServer {
  status: DevServerStatus;
  handle: LongRunningProcess;
  spec: DevServerSpec;
}

function running(
  fork: Fork,
  started: StartedServer[],
  records: ProcessRecord[],
  holder: LongRunningProcess | null,
  mount: LongRunningProcess | null = null,
  unstarted: DevServerStatus[] = [],
): RunningDevServers {
  return {
    servers: [...started.map(({ status }) => status), ...unstarted],
    env() {
      const env: Record<string, string> = {};
      for (const { status } of started.filter(({ status }) => status.healthy)) {
        const key = status.name.toUpperCase().replace(/-/g, '_');
        env[`SVC_DEV_${key}_URL`] = status.url;
        env[`SVC_DEV_${key}_PORT`] = String(status.port);
      }
      return env;
    },
    async stop() {
      await Promise.all(started.map(({ handle }) => handle.stop(STOP_GRACE_MS)));
      await holder?.stop(STOP_GRACE_MS);
      if (holder && fork.network) fork.network = null;
      await mount?.stop(STOP_GRACE_MS);
      if (mount && fork.mount) fork.mount = null;
      // Keep whatever a later start recorded meanwhile; drop what this one started.
      const ours = new Set(records.map((record) => `${record.pid}:${record.startTime}`));
      await writeProcessRecords(
        fork.info.dir,
        readProcessRecords(fork.info.dir).filter((record) => !ours.has(`${record.pid}:${record.startTime}`)),
      );
    },
  };
}

/**
 * Polls the server's health URL from where the server is (inside the fork's private network, through
 * `nsenter`, or on the host) until it answers below 500, the server exits, or its start timeout passes.
 */
async function awaitHealthy(server: StartedServer, network: string | null, signal: AbortSignal | undefined): Promise<void> {
  const { status, handle, spec } = server;
  const timeoutMs = spec.startTimeoutSeconds * 1000;
  const exited = new AbortController();
  let exit: { exitCode: number | null; signal: NodeJS.Signals | null } | null = null;
  void handle.exited.then((result) => {
    exit = result;
    exited.abort();
  });
  const url = `${status.url}${spec.healthPath}`;
  const probe = [process.execPath, '-e', PROBE_SCRIPT, url, String(timeoutMs), String(PROBE_INTERVAL_MS)];
  const result = await runProcessGroup(network ? ['nsenter', `--net=${network}`, ...probe] : probe, {
    timeoutMs: timeoutMs + 10_000,
    signal: signal ? AbortSignal.any([signal, exited.signal]) : exited.signal,
  });
  const answer = parseProbe(result.stdout);
  if (answer?.ok && !exit) {
    status.healthy = true;
    return;
  }
  const reason = exit
    ? `it exited (${describeExit(exit)}) before ${url} answered`
    : answer
      ? `${url} did not answer below 500 within ${spec.startTimeoutSeconds} s (last: ${answer.last})`
      : `its health check could not run: ${(result.stderr || result.stdout).trim() || `exit code ${result.exitCode}`}`;
  const output = handle.output().slice(-OUTPUT_TAIL_CHARS).trim();
  status.error = output ? `${reason}; its output ends:\n${output}` : `${reason}; it printed nothing`;
}

function describeExit(exit: { exitCode: number | null; signal: NodeJS.Signals | null }): string {
  return exit.signal ? `signal ${exit.signal}` : `exit code ${exit.exitCode}`;
}

/** Runs in a short-lived node process (so it can sit in the fork's network namespace). */
const PROBE_SCRIPT = `
const [url, timeoutMs, intervalMs] = process.argv.slice(1);
const end = Date.now() + Number(timeoutMs);
let last = 'no answer';
(async () => {
  while (Date.now() < end) {
    try {
      const response = await fetch(url, { redirect: 'manual', signal: AbortSignal.timeout(2000) });
      await response.arrayBuffer().catch(() => undefined);
      if (response.status < 500) { console.log(JSON.stringify({ ok: true, last: 'status ' + response.status })); return; }
      last = 'status ' + response.status;
    } catch (error) {
      last = String((error.cause && error.cause.code) || error.message);
    }
    await new Promise((resolve) => setTimeout(resolve, Number(intervalMs)));
  }
  console.log(JSON.stringify({ ok: false, last }));
})();
`;

function parseProbe(stdout: string): { ok: boolean; last: string } | null {
  try {
    const parsed = JSON.parse(stdout.trim().split('\n').pop() ?? '') as { ok?: unknown; last?: unknown };
    return typeof parsed.ok === 'boolean' ? { ok: parsed.ok, last: String(parsed.last) } : null;
  } catch {
    return null;
  }
}

/** In a fork's own namespace only its servers listen: the preferred port unless a sibling took it. */
function privatePort(preferred: number | undefined, taken: Set<number>): number {
  let port = preferred ?? FIRST_PRIVATE_PORT;
  while (taken.has(port)) port = port >= 65535 ? 1024 : port + 1;
  return port;
}

/** On the host network: the preferred port if it is free there, else one the kernel picks. */
async function hostPort(preferred: number | undefined, taken: Set<number>): Promise<number> {
  if (preferred !== undefined && !taken.has(preferred)) {
    const port = await tryListen(preferred);
    if (port !== null) return port;
  }
  for (;;) {
    const port = await tryListen(0);
    if (port !== null && !taken.has(port)) return port;
  }
}

function tryListen(port: number): Promise<number | null> {
  return new Promise((resolvePort) => {
    const server = createServer();
    server.once('error', () => resolvePort(null));
    server.listen({ port, host: '127.0.0.1', exclusive: true }, () => {
      const address = server.address();
      server.close(() => resolvePort(typeof address === 'object' && address ? address.port : null));
    });
  });
}

/**
 * Makes a private network namespace held by a sleeping bubblewrap process, and checks that this process
 * may enter it; with `outside`, connects it through slirp4netns (stopped with the holder, and recorded by
 * its pid since another process may have to stop it). Answers why where it cannot.
 */
async function makePrivateNetwork(outside: boolean): Promise<{ holder: LongRunningProcess; network: ForkNetwork; slirpPid: number | null } | string> {
  if (!sandboxCapabilities().bwrap) return 'bubblewrap is not available';
  const args = ['--die-with-parent', '--unshare-net', '--info-fd', '3'];
  for (const dir of SYSTEM_DIRS) args.push('--ro-bind-try', dir, dir);
  const child = spawn('bwrap', [...args, '--', 'sleep', 'infinity'], { detached: true, stdio: ['ignore', 'ignore', 'pipe', 'pipe'] });
  let holder = holderProcess(child);
  let stderr = '';
  child.stderr?.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk));
  const childPid = await new Promise<number | null>((resolvePid) => {
    let info = '';
    const info$ = child.stdio[3] as NodeJS.ReadableStream | null;
    const timer = setTimeout(() => resolvePid(null), 10_000);
    const done = (pid: number | null) => {
      clearTimeout(timer);
      resolvePid(pid);
    };
    info$?.setEncoding('utf8');
    info$?.on('data', (chunk: string) => {
      info += chunk;
      const match = /"child-pid":\s*(\d+)/.exec(info);
      if (match) done(Number(match[1]));
    });
    info$?.on('end', () => done(null));
    child.on('error', () => done(null));
  });
  if (childPid === null) {
    await holder.stop(0);
    return stderr.trim() || 'bubblewrap did not report its namespace';
  }
  let inode: string;
  try {
    inode = readlinkSync(`/proc/${childPid}/ns/net`);
  } catch (error) {
    await holder.stop(0);
    return (error as Error).message;
  }
  const entered = await runProcessGroup(['nsenter', `--net=/proc/${childPid}/ns/net`, 'true'], { timeoutMs: 10_000 });
  if (entered.exitCode !== 0) {
    await holder.stop(0);
    return entered.stderr.trim() || `nsenter exited with ${entered.exitCode}`;
  }
  if (!outside) return { holder, network: { holderPid: childPid, inode }, slirpPid: null };
  try {
    // Its own process group, so that a process that finds it recorded can stop it.
    const slirp = await startSlirp(childPid, { detached: true });
    const namespace = holder;
    holder = {
      ...namespace,
      async stop() {
        await slirp.stop();
        await namespace.stop();
      },
    };
    return { holder, network: { holderPid: childPid, inode, outside: true }, slirpPid: slirp.pid };
  } catch (error) {
    await holder.stop(0);
    return (error as Error).message;
  }
}

function holderProcess(child: ReturnType<typeof spawn>): LongRunningProcess {
  const exited = new Promise<{ exitCode: number | null; signal: NodeJS.Signals | null }>((resolveExit) => {
    child.on('error', () => resolveExit({ exitCode: null, signal: null }));
    child.on('exit', (exitCode, signal) => resolveExit({ exitCode, signal }));
  });
  const pid = child.pid ?? -1;
  return {
    pid,
    output: () => '',
    exited,
    async stop() {
      // The holder only sleeps: nothing to wind down gracefully.
      if (pid > 0 && signalGroup(pid, 'SIGKILL')) await exited;
      if (pid > 0) await killGroup(pid);
    },
  };
}

function processRecord(name: string, pid: number): ProcessRecord {
  return { name, pid, startTime: processStartTime(pid) ?? '' };
}

/** The start time of a live (not zombie) process, in clock ticks since boot; null when there is none. */
function processStartTime(pid: number): string | null {
  if (pid <= 0) return null;
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    if (fields[0] === 'Z' || fields[0] === 'X') return null;
    return fields[19] ?? null;
  } catch {
    return null;
  }
}

/** The processes recorded in a fork's directory (its dev servers and network holder). */
export function readProcessRecords(forkDir: string): ProcessRecord[] {
  const path = join(forkDir, PROCESSES_FILE);
  if (!existsSync(path)) return [];
  try {
    return JSON.parse(readFileSync(path, 'utf8')) as ProcessRecord[];
  } catch {
    return [];
  }
}

async function writeProcessRecords(forkDir: string, records: ProcessRecord[]): Promise<void> {
  const path = join(forkDir, PROCESSES_FILE);
  const temporary = `${path}.${randomBytes(4).toString('hex')}.tmp`;
  try {
    await writeFile(temporary, JSON.stringify(records));
    await rename(temporary, path);
  } catch (error) {
    // A fork removed meanwhile has nothing left to record.
    if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
  }
}

/**
 * Stops the recorded process groups that still run (the same pid and start time), from any process on
 * the host: SIGTERM, then SIGKILL after a grace period. Forgets the records of processes that are gone.
 */
export async function stopRecordedProcesses(forkDir: string, records: ProcessRecord[], graceMs = STOP_GRACE_MS): Promise<number> {
  const alive = records.filter((record) => record.startTime !== '' && processStartTime(record.pid) === record.startTime);
  for (const record of alive) signalGroup(record.pid, 'SIGTERM');
  const deadline = Date.now() + graceMs;
  while (alive.some((record) => processStartTime(record.pid) === record.startTime) && Date.now() < deadline) {
    await new Promise((resolveWait) => setTimeout(resolveWait, 50));
  }
  await Promise.all(alive.map((record) => killGroup(record.pid)));
  const remaining = readProcessRecords(forkDir).filter((record) => record.startTime !== '' && processStartTime(record.pid) === record.startTime);
  if (existsSync(join(forkDir, PROCESSES_FILE))) await writeProcessRecords(forkDir, remaining);
  return alive.length;
}
