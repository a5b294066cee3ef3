/**
 * A lock file that gives one process the ownership of something on disk (a PGlite data dir, a runner
 * home). The file is created with O_EXCL and holds the owner's pid, host and identity (boot and start
 * time, process-identity.ts); it is removed on release or when the owner exits. A lock whose owner is
 * gone is taken over, serialised by a short-lived `<lock>.takeover` file so that two starters cannot
 * both take the same stale lock; a takeover file older than 10 s was left by a crash and is itself stale.
 *
 * A pid that a live process has again (after a reboot, or once the number came round) is not the owner:
 * its identity differs, or, in a lock that records none (written by an older version, or where the
 * platform cannot tell), it started after the lock was written. A lock from another host (a directory
 * on a shared disk) cannot be checked and is never stale to us.
 */
import { closeSync, openSync, readFileSync, rmSync, statSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { matchProcess, matchStartedBy, processIdentity } from './process-identity.js';

export interface LockFile {
  release(): void;
}

/** What a lock file holds; older writers wrote only pid, host and startedAt. */
interface LockContent {
  pid: number;
  host: string;
  startedAt: string;
  /** The owner's identity; absent in a lock of an older version, or where the platform cannot tell. */
  boot?: string;
  start?: string;
}

/** Lock files this process holds: our own pid in one of them is not a previous life of this process. */
const held = new Set<string>();

/** The pid of the live process that holds the lock at `path`, or null when nobody does. */
export function lockFileHolder(path: string): number | null {
  const holder = readLock(path);
  if (!holder) return null;
  if (holder.pid === process.pid) return held.has(path) ? holder.pid : null;
  return holder.host === hostname() && ownerRuns(holder, path) ? holder.pid : null;
}

/**
 * Takes the lock at `path` (its directory must exist), or throws `locked(holderPid)` while a live
 * process, this one included, or another host holds it.
 */
export function acquireLockFile(path: string, locked: (holderPid: number) => Error): LockFile {
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
      // Our own pid in a lock this process does not hold is a previous life of it (a restarted container
      // runs as PID 1 again): stale.
      const ours = holder.pid === process.pid && !held.has(path);
      if (holder.host !== mine.host || (!ours && ownerRuns(holder, path)) || held.has(path)) throw locked(holder.pid);
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
  throw locked(readLock(path)?.pid ?? -1);
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

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
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

function heldLock(path: string, content: string): LockFile {
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
