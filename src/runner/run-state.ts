/**
 * What the runner remembers of each run it claimed, in `<home>/runs/<run id>/run.json`, so that a restart
 * knows where every run stood:
 *
 * - `executing`: the harness was (or was about to be) running. After a restart its processes are stopped
 *   and it is reported failed: a claimed run executes once, never again by itself.
 * - `finished`: the harness ended and its process groups are gone; `outcome` holds the result. Next: tell
 *   the server `syncing`, deliver the outbox, send the completion receipt.
 * - `synced`: the server knows it is syncing; delivery and the receipt remain.
 *
 * The record is written before the harness starts, so a run with no record never ran here. The run's
 * process groups are recorded beside it (`groups/`, see agents/local-workspace.ts) while they run, each
 * with its leader's identity (platform/process-identity.ts): a group is stopped only while that leader still runs,
 * never by a bare group id that may be another program's by now. A group that outlives its stop (a
 * member that changed user, one stuck in the kernel) keeps its file: the run is not over while it runs.
 *
 * A record that cannot be read (not JSON, not a record) is damaged: `scan` lists it apart. The daemon
 * then moves the run's folder aside as it is (`quarantine/<run id>`, for the user to look at), reports the
 * run failed, and goes on with the others.
 */
import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { z } from 'zod';
import { RunManifest, RunOutcome } from '../protocol/runner.js';
import { assertNever } from '../domain/errors.js';
import { readJsonFile, writeFileAtomic, type RunnerHome } from './home.js';
import { errorText, stderrLog, type Log } from './log.js';
import { matchProcess, matchStartedBy, ownProcessGroup, type ProcessIdentity } from '../platform/process-identity.js';

export const RunPhase = z.enum(['executing', 'finished', 'synced']);
export type RunPhase = z.infer<typeof RunPhase>;

export const RunRecord = z.object({
  /** The manifest as claimed: its generation is the one every request names. */
  manifest: RunManifest,
  phase: RunPhase,
  outcome: RunOutcome.optional(),
  updatedAt: z.string(),
});
export type RunRecord = z.infer<typeof RunRecord>;

const RECORD = 'run.json';

/** A run whose record cannot be read: left alone, shown by `svc runner status`. */
export interface DamagedRun {
  runId: string;
  path: string;
  problem: string;
}

export class RunRecordDamagedError extends Error {
  constructor(
    readonly path: string,
    readonly problem: string,
  ) {
    super(`the run record ${path} is damaged (${problem})`);
    this.name = 'RunRecordDamagedError';
  }
}

/** One file of `groups/`: the group id and, when the writer could tell, its leader's identity. */
export interface GroupRecord {
  path: string;
  pgid: number;
  leader: ProcessIdentity | null;
  /** When the file was written (its mtime): a record without the leader's identity is checked by it. */
  writtenAtMs: number;
}

/** Parses a group file as local-workspace.ts writes it: the pid, then `boot <id>` and `start <time>` lines. */
export function parseGroupRecord(path: string, text: string, writtenAtMs: number): GroupRecord | null {
  const [first, ...rest] = text.split('\n');
  const pgid = Number(first?.trim());
  if (!Number.isInteger(pgid) || pgid <= 1) return null;
  const fields = new Map(rest.map((line) => [line.slice(0, line.indexOf(' ')), line.slice(line.indexOf(' ') + 1).trim()] as const));
  const start = fields.get('start');
  const boot = fields.get('boot');
  return { path, pgid, leader: start ? { pid: pgid, start, ...(boot ? { boot } : {}) } : null, writtenAtMs };
}

/** Sends `signal` to every process of the group `pgid`, throwing as `process.kill` does. */
export type SignalGroup = (pgid: number, signal: NodeJS.Signals | 0) => void;

const signalGroup: SignalGroup = (pgid, signal) => process.kill(-pgid, signal);

/** How process groups are stopped: the real signals and wait by default; tests swap them. */
export interface GroupControl {
  signal?: SignalGroup;
  /** How long one stop keeps killing a group before it gives up (5 s). */
  stopTimeoutMs?: number;
}

/** Process groups of a run that still ran after their stop: the run is not over, and their files stay. */
export class ProcessGroupsSurviveError extends Error {
  constructor(
    readonly runId: string,
    readonly pgids: number[],
  ) {
    super(`process group(s) ${pgids.join(', ')} of run ${runId} still run after SIGKILL`);
    this.name = 'ProcessGroupsSurviveError';
  }
}

export class RunRecords {
  constructor(
    private readonly home: RunnerHome,
    private readonly log: Log = stderrLog,
    private readonly groups: GroupControl = {},
  ) {}

  dirOf(runId: string): string {
    return this.home.runDir(runId);
  }

  groupsDirOf(runId: string): string {
    return join(this.dirOf(runId), 'groups');
  }

  /** The run's record; null when it has none; RunRecordDamagedError when it cannot be read. */
  read(runId: string): RunRecord | null {
    const path = join(this.dirOf(runId), RECORD);
    return readJsonFile(path, RunRecord, (problem) => new RunRecordDamagedError(path, problem.startsWith('not JSON') ? problem : `not a run record: ${problem}`));
  }

  /** The ids of every run folder, recorded or not. */
  runIds(): string[] {
    if (!existsSync(this.home.runsDir)) return [];
    return readdirSync(this.home.runsDir)
      .filter((entry) => z.uuid().safeParse(entry).success)
      .sort();
  }

  /** Every recorded run, and apart the runs whose record is damaged; a folder without a record is left out. */
  scan(): { records: RunRecord[]; damaged: DamagedRun[] } {
    const records: RunRecord[] = [];
    const damaged: DamagedRun[] = [];
    for (const runId of this.runIds()) {
      try {
        const record = this.read(runId);
        if (record) records.push(record);
      } catch (error) {
        const path = error instanceof RunRecordDamagedError ? error.path : join(this.dirOf(runId), RECORD);
        damaged.push({ runId, path, problem: error instanceof RunRecordDamagedError ? error.problem : errorText(error) });
      }
    }
    return { records, damaged };
  }

  /** Every recorded run that can be read. */
  list(): RunRecord[] {
    return this.scan().records;
  }

  write(record: Omit<RunRecord, 'updatedAt'>): RunRecord {
    const full = RunRecord.parse({ ...record, updatedAt: new Date().toISOString() });
    writeFileAtomic(join(this.dirOf(full.manifest.runId), RECORD), `${JSON.stringify(full)}\n`);
    return full;
  }

  /** Moves the run's folder, as it is, into the home's quarantine folder; answers where it went. */
  quarantine(runId: string): string {
    const dir = this.home.quarantineDir;
    mkdirSync(dir, { recursive: true, mode: 0o700 });
    let target = join(dir, runId);
    for (let n = 2; existsSync(target); n++) target = join(dir, `${runId}.${n}`);
    renameSync(this.dirOf(runId), target);
    return target;
  }

  /** The run folders moved aside, each with its run id. */
  quarantined(): Array<{ runId: string; path: string }> {
    const dir = this.home.quarantineDir;
    if (!existsSync(dir)) return [];
    return readdirSync(dir)
      .sort()
      .map((entry) => ({ runId: entry.slice(0, 36), path: join(dir, entry) }))
      .filter((entry) => z.uuid().safeParse(entry.runId).success);
  }

  /** Drops the run's record only: a run that did nothing here yet looks unrecorded again. */
  removeRecord(runId: string): void {
    rmSync(join(this.dirOf(runId), RECORD), { force: true });
  }

  /** Forgets the run: record, outbox and all. */
  remove(runId: string): void {
    rmSync(this.dirOf(runId), { recursive: true, force: true });
  }

  /** The process groups the run recorded and that may still run. */
  groupRecords(runId: string): GroupRecord[] {
    const dir = this.groupsDirOf(runId);
    if (!existsSync(dir)) return [];
    const records: GroupRecord[] = [];
    for (const entry of readdirSync(dir)) {
      const path = join(dir, entry);
      try {
        const record = parseGroupRecord(path, readFileSync(path, 'utf8'), statSync(path).mtimeMs);
        if (record) records.push(record);
      } catch {
        // removed meanwhile: that group is gone
      }
    }
    return records;
  }

  /** Process group ids the run recorded and that may still run. */
  recordedGroups(runId: string): number[] {
    return this.groupRecords(runId).map((record) => record.pgid);
  }

  /**
   * Stops every process group the run recorded whose leader still runs, and waits (bounded) until they
   * are gone; answers how many it stopped. The leader is the recorded one when its identity matches, or,
   * for a record written without one, when it started before the record was written
   * (platform/process-identity.ts). A record whose leader is gone is stale and only dropped; one that cannot be
   * checked (a platform that cannot tell) is left running with a log line, and so is the runner's own group.
   * A group still alive after its stop keeps its file (a later call finds it again), the files of the
   * others are dropped, and ProcessGroupsSurviveError is thrown: nothing may report the run meanwhile.
   */
  async stopGroups(runId: string): Promise<number> {
    const own = ownProcessGroup();
    let stopped = 0;
    const survivors: GroupRecord[] = [];
    for (const record of this.groupRecords(runId)) {
      const { pgid, leader, path, writtenAtMs } = record;
      if (pgid === own || pgid === process.pid) {
        this.log(`run ${runId}: ${path} names the runner's own process group ${pgid}; not stopped`);
        continue;
      }
      const match = leader ? matchProcess(leader) : matchStartedBy(pgid, writtenAtMs);
      switch (match) {
        case 'running':
          if (await stopGroup(pgid, this.groups)) stopped += 1;
          else survivors.push(record);
          break;
        case 'gone':
          break;
        case 'unknown':
          this.log(`run ${runId}: process group ${pgid} (${path}) cannot be checked on this computer; it is not stopped`);
          break;
        default:
          assertNever(match);
      }
    }
    if (survivors.length === 0) {
      rmSync(this.groupsDirOf(runId), { recursive: true, force: true });
      return stopped;
    }
    const kept = new Set(survivors.map((record) => record.path));
    for (const { path } of this.groupRecords(runId)) if (!kept.has(path)) rmSync(path, { force: true });
    throw new ProcessGroupsSurviveError(runId, survivors.map((record) => record.pgid));
  }
}

/**
 * Whether any process of the group `pid` exists (portable: no /proc needed). EPERM counts as alive: a
 * member runs as another user.
 */
export function groupExists(pid: number): boolean {
  return groupAlive(pid, signalGroup);
}

function groupAlive(pid: number, signal: SignalGroup): boolean {
  try {
    signal(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * SIGKILL to the whole group until none of it is left, for at most `stopTimeoutMs`; answers whether it is
 * gone. Only for a group whose leader was just checked: while any member of the group lives, its id cannot
 * be given to another process, so the kills that follow reach the same group.
 */
export async function stopGroup(pid: number, control: GroupControl = {}): Promise<boolean> {
  const signal = control.signal ?? signalGroup;
  const deadline = Date.now() + (control.stopTimeoutMs ?? 5_000);
  for (;;) {
    if (!groupAlive(pid, signal)) return true;
    if (Date.now() >= deadline) return false;
    try {
      signal(pid, 'SIGKILL');
    } catch {
      // gone meanwhile, or not ours to kill: the next check tells
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}
