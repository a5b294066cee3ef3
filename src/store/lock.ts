/**
 * PGlite has no lock of its own: two processes on one data dir silently lose writes. The embedded store
 * therefore holds `<dataDir>/svc.lock` (O_EXCL create) for as long as it is open, and a second opener is
 * refused with the holder's pid. A lock whose process is gone is taken over, serialised by a short-lived
 * `svc.lock.takeover` file so that two starters cannot both take the same stale lock.
 */
import { closeSync, mkdirSync, openSync, readFileSync, rmSync, statSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { join } from 'node:path';

export class DataDirLockedError extends Error {
  constructor(
    readonly dataDir: string,
    readonly holderPid: number,
  ) {
    super(
      `the data dir ${dataDir} is in use by process ${holderPid} (a running svc server?); ` +
        'stop that process, or point both at PostgreSQL with DATABASE_URL',
    );
    this.name = 'DataDirLockedError';
  }
}

interface LockContent {
  pid: number;
  host: string;
  startedAt: string;
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

function readLock(path: string): LockContent | null {
  try {
    return JSON.parse(readFileSync(path, 'utf8')) as LockContent;
  } catch {
    return null;
  }
}

function tryCreate(path: string, content: string): boolean {
  try {
    const fd = openSync(path, 'wx');
    writeSync(fd, content);
    closeSync(fd);
    return true;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'EEXIST') return false;
    throw error;
  }
}

export interface DataDirLock {
  release(): void;
}

export function acquireDataDirLock(dataDir: string): DataDirLock {
  mkdirSync(dataDir, { recursive: true });
  const path = join(dataDir, 'svc.lock');
  const takeover = `${path}.takeover`;
  const mine: LockContent = { pid: process.pid, host: hostname(), startedAt: new Date().toISOString() };
  const content = JSON.stringify(mine);

  for (let attempt = 0; attempt < 50; attempt++) {
    if (tryCreate(path, content)) return makeLock(path, content);
    const holder = readLock(path);
    // A lock being written is unreadable for a moment; one that stays unreadable was left by a crash
    // between creating and writing it.
    if (holder === null) {
      if (ageMs(path) < 2_000) {
        sleepSync(20);
        continue;
      }
    }
    // Our own pid in a lock this process does not hold is a previous life of it (a restarted container
    // runs as PID 1 again): stale.
    const ours = holder !== null && holder.pid === process.pid && !held.has(path);
    if (holder !== null && holder.host === mine.host && !ours && isAlive(holder.pid)) throw new DataDirLockedError(dataDir, holder.pid);
    if (holder !== null && holder.host !== mine.host) throw new DataDirLockedError(dataDir, holder.pid);
    // Stale: take it over under the takeover mutex; a takeover file older than 10 s is itself stale.
    if (!tryCreate(takeover, content)) {
      try {
        if (Date.now() - statSync(takeover).mtimeMs > 10_000) rmSync(takeover, { force: true });
      } catch {
        // gone meanwhile
      }
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
  const holder = readLock(path);
  throw new DataDirLockedError(dataDir, holder?.pid ?? -1);
}

/** Lock files this process holds. */
const held = new Set<string>();

function ageMs(path: string): number {
  try {
    return Date.now() - statSync(path).mtimeMs;
  } catch {
    return 0;
  }
}

function makeLock(path: string, content: string): DataDirLock {
  held.add(path);
  let released = false;
  const release = (): void => {
    if (released) return;
    released = true;
    held.delete(path);
    // Remove only our own lock, never one a successor wrote after a takeover.
    try {
      if (readFileSync(path, 'utf8') === content) rmSync(path, { force: true });
    } catch {
      // already gone
    }
  };
  process.once('exit', release);
  return { release };
}

function sleepSync(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}
