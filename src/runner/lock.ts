/**
 * The broker lease: one daemon per runner home, so that one connection's runs, outbox and process groups
 * have a single owner. `daemon.lock` (O_EXCL create) holds the owner's pid and its identity (boot and
 * start time, process-identity.ts); a lock whose process is gone is taken over, serialised by a
 * short-lived `daemon.lock.takeover` file so that two starters cannot both take the same stale lock. A
 * pid that a live process has again (after a reboot, or once the number came round) is not the owner:
 * its identity differs (or, in a lock of an older runner that has none, it started after the lock was
 * written). Pairing holds the lock too (nothing of the old connection may execute then).
 */
import { closeSync, openSync, readFileSync, rmSync, statSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { matchProcess, matchStartedBy, processIdentity } from './process-identity.js';

export class RunnerLockedError extends Error {
  constructor(
    readonly home: string,
    readonly holderPid: number,
    readonly lockFile: string,
  ) {
    // The pid is what the user acts on; the lock file is an inner detail (removing it by hand while the
    // daemon runs is what the lock is there to prevent), kept on the error for callers.
    super(`another svc runner (pid ${holderPid}) is running for ${home}; stop it first, or use another --home`);
    this.name = 'RunnerLockedError';
  }
}

interface LockContent {
  pid: number;
  host: string;
  startedAt: string;
  /** The owner's identity; absent in a lock of an older runner, or where the platform cannot tell. */
  boot?: string;
  start?: string;
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * Whether the lock's owner still runs (this host's locks only): its identity where recorded, else a
 * process with its pid that started before the lock was written; by its pid alone only where this
 * platform cannot tell either.
 */
function ownerRuns(holder: LockContent, path: string): boolean {
  const match =
    holder.start === undefined ?
      matchStartedBy(holder.pid, writtenAtMs(path))
    : matchProcess({ pid: holder.pid, start: holder.start, ...(holder.boot === undefined ? {} : { boot: holder.boot }) });
  return match === 'running' || (match === 'unknown' && isAlive(holder.pid));
}

/** When the lock file was written; now when it is gone meanwhile (its owner is then checked as running now). */
function writtenAtMs(path: string): number {
  try {
    return statSync(path).mtimeMs;
  } catch {
    return Date.now();
  }
}

function readLock(path: string): LockContent | null {
  try {
    const parsed = JSON.parse(readFileSync(path, 'utf8')) as Partial<Record<keyof LockContent, unknown>>;
    if (typeof parsed.pid !== 'number' || typeof parsed.startedAt !== 'string') return null;
    return {
      pid: parsed.pid,
      host: String(parsed.host),
      startedAt: parsed.startedAt,
      ...(typeof parsed.boot === 'string' ? { boot: parsed.boot } : {}),
      ...(typeof parsed.start === 'string' ? { start: parsed.start } : {}),
    };
  } catch {
    return null;
  }
}

function tryCreate(path: string, content: string): boolean {
  try {
    const fd = openSync(path, 'wx', 0o600);
    try {
      writeSync(fd, content);
    } finally {
      closeSync(fd);
    }
    return true;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'EEXIST') return false;
    throw error;
  }
}

function ageMs(path: string): number {
  try {
    return Date.now() - statSync(path).mtimeMs;
  } catch {
    return 0;
  }
}

function sleepSync(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

export interface RunnerLock {
  release(): void;
}

/** Lock files this process holds: our own pid in one of them is not a previous life of this process. */
const held = new Set<string>();

/** The holder of the lock at `path`, if a live process holds it. */
export function lockHolder(path: string): number | null {
  const holder = readLock(path);
  if (!holder) return null;
  if (holder.pid === process.pid) return held.has(path) ? holder.pid : null;
  return holder.host === hostname() && ownerRuns(holder, path) ? holder.pid : null;
}

/** Takes the lock at `path` for `home`, or throws RunnerLockedError naming the live holder. */
export function acquireRunnerLock(path: string, home: string): RunnerLock {
  const identity = processIdentity(process.pid);
  const mine: LockContent = {
    pid: process.pid,
    host: hostname(),
    startedAt: new Date().toISOString(),
    ...(identity?.boot === undefined ? {} : { boot: identity.boot }),
    ...(identity ? { start: identity.start } : {}),
  };
  const content = JSON.stringify(mine);
  const takeover = `${path}.takeover`;
  for (let attempt = 0; attempt < 100; attempt++) {
    if (tryCreate(path, content)) return heldLock(path, content);
    const holder = readLock(path);
    // A lock being written is unreadable for a moment; one that stays unreadable was left by a crash
    // between creating and writing it.
    if (holder === null && ageMs(path) < 2_000) {
      sleepSync(20);
      continue;
    }
    if (holder !== null) {
      const ours = holder.pid === process.pid && !held.has(path);
      // A lock from another host (a home on a shared disk) cannot be checked: it is never stale to us.
      if (holder.host !== mine.host || (!ours && ownerRuns(holder, path)) || held.has(path)) throw new RunnerLockedError(home, holder.pid, path);
    }
    if (!tryCreate(takeover, content)) {
      if (ageMs(takeover) > 10_000) rmSync(takeover, { force: true });
      sleepSync(20);
      continue;
    }
    try {
      const again = readLock(path);
      const unchanged = holder === null ? again === null : again?.pid === holder.pid && again.startedAt === holder.startedAt;
      if (unchanged) rmSync(path, { force: true });
    } finally {
      rmSync(takeover, { force: true });
    }
  }
  throw new RunnerLockedError(home, readLock(path)?.pid ?? -1, path);
}

function heldLock(path: string, content: string): RunnerLock {
  held.add(path);
  let released = false;
  const release = (): void => {
    if (released) return;
    released = true;
    held.delete(path);
    process.off('exit', release);
    // Only our own lock, never one a successor wrote after a takeover.
    try {
      if (readFileSync(path, 'utf8') === content) rmSync(path, { force: true });
    } catch {
      // already gone
    }
  };
  process.once('exit', release);
  return { release };
}
