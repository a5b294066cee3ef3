/**
 * PGlite has no lock of its own: two processes on one data dir silently lose writes. The embedded store
 * therefore holds `<dataDir>/svc.lock` (a lock file, platform/lock-file.ts) for as long as it is open, and
 * a second opener is refused with the holder's pid. A lock whose process is gone, or whose pid another
 * process has now (after a crash and a reboot, say), is taken over.
 */
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { acquireLockFile, type LockFile } from '../platform/lock-file.js';

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

export type DataDirLock = LockFile;

export function acquireDataDirLock(dataDir: string): DataDirLock {
  mkdirSync(dataDir, { recursive: true });
  return acquireLockFile(join(dataDir, 'svc.lock'), (holderPid) => new DataDirLockedError(dataDir, holderPid));
}
