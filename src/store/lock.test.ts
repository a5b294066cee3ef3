import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, utimesSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { processIdentity } from '../platform/process-identity.js';
import { acquireDataDirLock, DataDirLockedError } from './lock.js';

const freshDir = () => mkdtempSync(join(tmpdir(), 'svc-lock-'));

/** The pid of a process that has exited. */
function deadPid(): number {
  const child = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))']);
  return Number(child.stdout.toString());
}

describe('the data-dir lock', () => {
  it('is held until released, and refuses a second holder naming the first', () => {
    const dir = freshDir();
    const lock = acquireDataDirLock(dir);
    expect(JSON.parse(readFileSync(join(dir, 'svc.lock'), 'utf8')).pid).toBe(process.pid);
    expect(() => acquireDataDirLock(dir)).toThrow(DataDirLockedError);
    expect(() => acquireDataDirLock(dir)).toThrow(new RegExp(`in use by process ${process.pid}`));
    lock.release();
    expect(existsSync(join(dir, 'svc.lock'))).toBe(false);
    acquireDataDirLock(dir).release();
  });

  it('takes over a lock whose process is gone', () => {
    const dir = freshDir();
    writeFileSync(join(dir, 'svc.lock'), JSON.stringify({ pid: deadPid(), host: hostname(), startedAt: '2020-01-01T00:00:00Z' }));
    const lock = acquireDataDirLock(dir);
    expect(JSON.parse(readFileSync(join(dir, 'svc.lock'), 'utf8')).pid).toBe(process.pid);
    lock.release();
  });

  it('takes over a lock with its own pid that it does not hold (a restarted container), and an empty one left by a crash', () => {
    const dir = freshDir();
    writeFileSync(join(dir, 'svc.lock'), JSON.stringify({ pid: process.pid, host: hostname(), startedAt: 'a previous life' }));
    acquireDataDirLock(dir).release();
    const empty = join(dir, 'svc.lock');
    writeFileSync(empty, '');
    const old = new Date(Date.now() - 60_000);
    utimesSync(empty, old, old);
    const lock = acquireDataDirLock(dir);
    expect(JSON.parse(readFileSync(empty, 'utf8')).pid).toBe(process.pid);
    lock.release();
  });

  it('takes over a lock whose pid another live process has now (its holder died and the number came round)', () => {
    const dir = freshDir();
    const path = join(dir, 'svc.lock');
    // Started now, after the lock below was written: not the process that wrote it.
    const other = spawn('sleep', ['30'], { stdio: 'ignore' });
    try {
      const pid = other.pid!;
      // A lock of the format written before locks recorded their owner's identity: checked by start time.
      writeFileSync(path, JSON.stringify({ pid, host: hostname(), startedAt: '2020-01-01T00:00:00Z' }));
      const written = new Date(Date.now() - 60_000);
      utimesSync(path, written, written);
      acquireDataDirLock(dir).release();
      // A lock that records its owner's identity: another start is another process.
      const identity = processIdentity(pid);
      expect(identity).toBeTruthy();
      writeFileSync(path, JSON.stringify({ pid, host: hostname(), startedAt: new Date().toISOString(), boot: identity?.boot, start: '1' }));
      const lock = acquireDataDirLock(dir);
      expect(JSON.parse(readFileSync(path, 'utf8')).pid).toBe(process.pid);
      lock.release();
    } finally {
      other.kill();
    }
  });

  it('refuses a lock whose owner lives, whether it records its identity or, written before it did, only its pid', () => {
    const dir = freshDir();
    const path = join(dir, 'svc.lock');
    // The parent of this test process started before the lock is written.
    writeFileSync(path, JSON.stringify({ pid: process.ppid, host: hostname(), startedAt: new Date().toISOString() }));
    expect(() => acquireDataDirLock(dir)).toThrow(new RegExp(`in use by process ${process.ppid}`));
    const identity = processIdentity(process.ppid);
    writeFileSync(path, JSON.stringify({ pid: process.ppid, host: hostname(), startedAt: new Date().toISOString(), ...identity }));
    expect(() => acquireDataDirLock(dir)).toThrow(DataDirLockedError);
  });

  it('refuses a lock held on another host, which it cannot check', () => {
    const dir = freshDir();
    writeFileSync(join(dir, 'svc.lock'), JSON.stringify({ pid: 12345, host: 'elsewhere', startedAt: '2020-01-01T00:00:00Z' }));
    expect(() => acquireDataDirLock(dir)).toThrow(DataDirLockedError);
  });

  it('never removes a lock somebody else wrote after a takeover', () => {
    const dir = freshDir();
    const lock = acquireDataDirLock(dir);
    const successor = JSON.stringify({ pid: 1, host: hostname(), startedAt: 'later' });
    writeFileSync(join(dir, 'svc.lock'), successor);
    lock.release();
    expect(readFileSync(join(dir, 'svc.lock'), 'utf8')).toBe(successor);
  });
});
