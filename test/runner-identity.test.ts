/**
 * A recorded pid is acted on only while it names the process that was recorded: a run's leftover process
 * groups (killed at the next start) and the daemon's lock (respected, or taken over). Real processes
 * stand in for the recorded ones; a reused pid is played by a live process whose record does not match it
 * (another start time, another boot, or a record written before it started).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdirSync, mkdtempSync, utimesSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { RunnerHome } from '../src/runner/home.js';
import { RunnerLockedError, acquireRunnerLock, lockHolder } from '../src/runner/lock.js';
import { silentLog } from '../src/runner/log.js';
import { processIdentity, type ProcessIdentity } from '../src/platform/process-identity.js';
import { ProcessGroupsSurviveError, RunRecords, groupExists, type SignalGroup } from '../src/runner/run-state.js';

const children: ChildProcess[] = [];
afterEach(() => {
  for (const child of children.splice(0)) if (child.pid && groupExists(child.pid)) process.kill(-child.pid, 'SIGKILL');
});

/** A live process group of its own (its leader's pid is the group id). */
function liveGroup(): number {
  const child = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
  children.push(child);
  return child.pid!;
}

const home = () => new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-identity-'))).ensure();
const anHourAgo = () => new Date(Date.now() - 3_600_000);

/** A group file as agents/local-workspace.ts writes it. */
function groupFile(records: RunRecords, runId: string, pgid: number, leader: Partial<ProcessIdentity> | null): string {
  const dir = records.groupsDirOf(runId);
  mkdirSync(dir, { recursive: true });
  const path = join(dir, `${randomUUID()}.pid`);
  const lines = [String(pgid), ...(leader?.boot ? [`boot ${leader.boot}`] : []), ...(leader?.start ? [`start ${leader.start}`] : [])];
  writeFileSync(path, `${lines.join('\n')}\n`);
  return path;
}

describe('stopping the process groups a run left', () => {
  it('stops a group whose leader is the recorded process, by its identity or by a record written while it ran', async () => {
    const records = new RunRecords(home(), silentLog);
    const runId = randomUUID();
    const [identified, bare] = [liveGroup(), liveGroup()];
    groupFile(records, runId, identified, processIdentity(identified)!);
    groupFile(records, runId, bare, null);
    expect(await records.stopGroups(runId)).toBe(2);
    expect([groupExists(identified), groupExists(bare)]).toEqual([false, false]);
    expect(records.groupRecords(runId)).toEqual([]);
  });

  it('leaves alone a group whose id another process has by now: another start, another boot, or started after the record', async () => {
    const records = new RunRecords(home(), silentLog);
    const runId = randomUUID();
    const [restarted, rebooted, later] = [liveGroup(), liveGroup(), liveGroup()];
    const now = [restarted, rebooted].map((pid) => processIdentity(pid)!);
    groupFile(records, runId, restarted, { ...now[0], start: String(Number(now[0]!.start) - 1) });
    groupFile(records, runId, rebooted, { ...now[1], boot: now[1]!.boot ? randomUUID() : undefined, start: now[1]!.boot ? now[1]!.start : 'Thu Jan  1 00:00:00 1970' });
    // A record without the leader's identity, written an hour before the process with its pid started.
    const stale = groupFile(records, runId, later, null);
    utimesSync(stale, anHourAgo(), anHourAgo());

    expect(await records.stopGroups(runId)).toBe(0);
    expect([groupExists(restarted), groupExists(rebooted), groupExists(later)]).toEqual([true, true, true]);
    // The stale records are dropped: they name nothing of this run any more.
    expect(records.groupRecords(runId)).toEqual([]);
  });
});

describe('a process group that survives its stop', () => {
  it('keeps its record and throws, drops the records of the groups that are gone, and is stopped by a later call', async () => {
    const [survivor, other] = [liveGroup(), liveGroup()];
    // A member that changed user: the group answers EPERM to every signal.
    let survives = true;
    const signal: SignalGroup = (pgid, sig) => {
      if (survives && pgid === survivor) throw Object.assign(new Error('kill EPERM'), { code: 'EPERM' });
      process.kill(-pgid, sig);
    };
    const records = new RunRecords(home(), silentLog, { signal, stopTimeoutMs: 100 });
    const runId = randomUUID();
    const kept = groupFile(records, runId, survivor, processIdentity(survivor)!);
    groupFile(records, runId, other, processIdentity(other)!);

    const error = await records.stopGroups(runId).catch((failure: unknown) => failure);
    expect(error).toBeInstanceOf(ProcessGroupsSurviveError);
    expect((error as ProcessGroupsSurviveError).pgids).toEqual([survivor]);
    expect(records.groupRecords(runId).map((record) => record.path)).toEqual([kept]);
    expect([groupExists(survivor), groupExists(other)]).toEqual([true, false]);

    survives = false;
    expect(await records.stopGroups(runId)).toBe(1);
    expect(groupExists(survivor)).toBe(false);
    expect(records.groupRecords(runId)).toEqual([]);
  });
});

describe('the daemon lock of a process that is gone', () => {
  const lockOf = (pid: number, fields: Record<string, string> = {}) => JSON.stringify({ pid, host: hostname(), startedAt: new Date().toISOString(), ...fields });

  it('is taken over when its pid names another live process now (another start time, or started after the lock was written)', () => {
    const runnerHome = home();
    const pid = liveGroup();
    const identity = processIdentity(pid)!;

    writeFileSync(runnerHome.lockFile, lockOf(pid, { ...(identity.boot ? { boot: identity.boot } : {}), start: identity.start }));
    expect(lockHolder(runnerHome.lockFile)).toBe(pid);
    expect(() => acquireRunnerLock(runnerHome.lockFile, runnerHome.dir)).toThrow(RunnerLockedError);

    writeFileSync(runnerHome.lockFile, lockOf(pid, { ...(identity.boot ? { boot: identity.boot } : {}), start: `${identity.start}0` }));
    expect(lockHolder(runnerHome.lockFile)).toBeNull();
    acquireRunnerLock(runnerHome.lockFile, runnerHome.dir).release();

    // An older runner's lock names its pid alone: a process that started after it was written is not its owner.
    writeFileSync(runnerHome.lockFile, lockOf(pid));
    expect(lockHolder(runnerHome.lockFile)).toBe(pid);
    utimesSync(runnerHome.lockFile, anHourAgo(), anHourAgo());
    expect(lockHolder(runnerHome.lockFile)).toBeNull();
    const taken = acquireRunnerLock(runnerHome.lockFile, runnerHome.dir);
    expect(lockHolder(runnerHome.lockFile)).toBe(process.pid);
    taken.release();
  });
});
