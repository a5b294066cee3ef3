/**
 * The broker lease: one daemon per runner home, so that one connection's runs, outbox and process groups
 * have a single owner. `daemon.lock` is a lock file (platform/lock-file.ts: the owner's pid and identity,
 * a lock whose owner is gone, or whose pid another process has now, is taken over). Pairing holds the
 * lock too (nothing of the old connection may execute then).
 */
import { acquireLockFile, lockFileHolder, type LockFile } from '../platform/lock-file.js';

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

export type RunnerLock = LockFile;

/** The holder of the lock at `path`, if a live process holds it. */
export function lockHolder(path: string): number | null {
  return lockFileHolder(path);
}

/** Takes the lock at `path` for `home`, or throws RunnerLockedError naming the live holder. */
export function acquireRunnerLock(path: string, home: string): RunnerLock {
  return acquireLockFile(path, (holderPid) => new RunnerLockedError(home, holderPid, path));
}
