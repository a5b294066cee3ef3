/**
 * The fork lifecycle (SPEC.md "Sandbox fork lifecycle"): a task keeps one fork per host between its jobs
 * (named by its slug, under `forksRoot/<workspace id>/<name>`), so a follow-up continues in the same
 * files. An idle fork is stopped (its dev servers) after `idleStopMs` since last use, a stopped fork is
 * archived (a gzipped tar of its own files, then its directory goes) after `archiveMs`, and an archived
 * fork is deleted `deleteMs` after its last use. Acquiring a task's fork reuses it, restoring it first if
 * it was archived. A fork stays on the environment version it was made from (its lower layers never
 * change); `acquire` says when a newer version exists, and `renew` replaces the fork with a fresh one of
 * it, which the job does when that loses no work.
 *
 * Several processes on one host may run lifecycles over the same forks. The database decides who does a
 * move: every move is a conditional UPDATE on the observed state. The order, and what a crash leaves:
 *
 * - idle → stopped: read the fork's recorded processes, UPDATE, then stop those processes. Reading first
 *   means a job that acquires the fork right after the UPDATE can never have its new servers killed. A
 *   crash after the UPDATE leaves processes that the archive move (or the next start) stops.
 * - stopped → archived: UPDATE to `archiving` (a claim: its `state_changed_at` is the token, renewed while
 *   the tar runs), stop leftover processes, tar to a temporary file, rename it into place, remove the
 *   directory, UPDATE `archiving` → `archived` where the token still matches. A crash leaves `archiving`,
 *   which any tick takes over once the claim's lease (`claimLeaseMs`) passes, and redoes: the steps are
 *   idempotent (a directory still there is archived again; one already gone keeps the archive it has).
 * - archived → deleted: UPDATE to `deleting`, remove the archive and any directory, UPDATE to `deleted`;
 *   a crash leaves `deleting`, taken over and redone the same way.
 * - acquire: a conditional UPDATE to `active` under the job (from idle, stopped, archived or deleted, or
 *   from active when the job holding it no longer runs), then the files: a directory that exists is the
 *   fork; else an archive is restored (unpacked beside it and renamed into place, so a crash leaves the
 *   archive or the whole fork); else a fresh fork is made. A crash leaves the fork active under a job
 *   that does not run, which the next acquire takes over, and which tick stops once it is idle long.
 *
 * A fork made before environment versions has no `.lower` record of its version (an overlay fork may
 * have a `.lower-version` marker instead). It is resumed on the layer its environment was moved into
 * when that environment became version 1 (`EnvironmentStore.legacyLower`), and gets a `.lower` record;
 * until then it keeps version 1 from being collected (a fork without a record may resume on it). One
 * without a marker either (older than the marker) is resumed, and keeps version 1, only when its files
 * are older than version 1 (`EnvironmentStore.mayBeUnmarkedLegacyFork`, `forkFilesChangedAt`): a newer
 * one was not made from it. An archive is newer than its files, so an archived fork is judged by the time
 * its files have in the archive; a legacy fork is also given its record before it is archived.
 */
import { closeSync, existsSync, openSync, readdirSync, readFileSync, readSync, statSync } from 'node:fs';
import { rename, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { constants as zlib, gunzipSync } from 'node:zlib';
import { and, eq, isNull } from 'drizzle-orm';
import type { Logger } from 'pino';
import { readProcessRecords, stopRecordedProcesses, type ProcessRecord } from '../sandbox/dev-servers.js';
import { EnvironmentStore, LEGACY_LOWER_SUFFIX, LEGACY_VERSION, sameFiles, type VersionRecord } from '../sandbox/environment-versions.js';
import {
  type EnvironmentSnapshot,
  type Fork,
  FORK_NAME,
  ForkManager,
  LOWER_SUFFIX,
  readSnapshot,
  sandboxCapabilities,
  type ForkMode,
  type SandboxPolicy,
} from '../sandbox/fork.js';
import type { Database } from '../store/db.js';
import {
  dueCondition,
  findFork,
  insertActiveFork,
  jobNotRunning,
  listDueForks,
  moveFork,
  setForkMode,
  type ForkDurations,
  type ForkRow,
  type ForkState,
} from '../store/forks.js';
import { forks } from '../store/schema.js';

export interface ForkLifecycleOptions {
  database: Database;
  /** `dataDir/forks`: each workspace's forks in a directory of its own. */
  forksRoot: string;
  /** This host's name: forks live on one host's disk, and each host moves only its own. */
  host: string;
  /** `dataDir/environments`: where a fork made before environment versions finds the layer it was made from. */
  environmentsRoot?: string;
  policy: SandboxPolicy;
  /** SPEC.md: 30 minutes, 24 hours, 7 days. `claimLeaseMs` (default 5 minutes) bounds a crashed move. */
  durations: Omit<ForkDurations, 'claimLeaseMs'> & { claimLeaseMs?: number };
  logger: Logger;
}

export interface AcquireInput {
  workspaceId: string;
  taskId: string;
  /** The task's slug: letters, digits, `-` and `_`. */
  name: string;
  jobId: string;
  /** The workspace environment's current version: what a fresh fork copies. */
  environment: EnvironmentSnapshot & { record?: Pick<VersionRecord, 'sameFilesAs'> };
}

export interface AcquiredFork {
  fork: Fork;
  /** Made fresh now (nothing of earlier jobs in it). */
  fresh: boolean;
  /** A kept fork of an older environment version than `environment` (one that shows other files). */
  outdated: boolean;
}

export interface TickResult {
  stopped: number;
  archived: number;
  deleted: number;
}

/** The task's fork is in use by another job that still runs. */
export class ForkBusyError extends Error {
  constructor(name: string, jobId: string | null) {
    super(`fork ${name} is in use by job ${jobId ?? '(unknown)'}, which still runs`);
    this.name = 'ForkBusyError';
  }
}

/** A claimed move lost its claim to another process (its lease ran out): it stops where it is. */
class ClaimLostError extends Error {
  constructor(name: string) {
    super(`fork ${name}: another process took over this move`);
    this.name = 'ClaimLostError';
  }
}

const DEFAULT_CLAIM_LEASE_MS = 5 * 60_000;
/** A fork's archive beside its directory (ForkManager.archiveOf). */
const ARCHIVE_SUFFIX = '.tar.gz';
const WAIT_FOR_MOVE_MS = 200;
const MAX_ACQUIRE_ROUNDS = 10_000;

export class ForkLifecycle {
  private readonly durations: ForkDurations;
  /** The row and job behind each fork handed out, for release and discard. */
  private readonly held = new WeakMap<Fork, { id: string; jobId: string; workspaceId: string }>();
  private readonly managers = new Map<string, ForkManager>();
  private aborted = false;

  constructor(private readonly options: ForkLifecycleOptions) {
    this.durations = { claimLeaseMs: DEFAULT_CLAIM_LEASE_MS, ...options.durations };
  }

  private get db() {
    return this.options.database.db;
  }

  /** Forks of one workspace: `forksRoot/<workspace id>/<name>`. */
  private manager(workspaceId: string): ForkManager {
    let manager = this.managers.get(workspaceId);
    if (!manager) {
      manager = new ForkManager(join(this.options.forksRoot, workspaceId), this.options.policy, (message) => this.options.logger.info(message));
      this.managers.set(workspaceId, manager);
    }
    return manager;
  }

  /**
   * The task's fork on this host, active under `jobId`: reused (idle or stopped), restored (archived) or
   * made fresh (`fresh: true`). Waits for a move under way on it; throws ForkBusyError while another job
   * that still runs holds it.
   */
  async acquire(input: AcquireInput): Promise<AcquiredFork> {
    const manager = this.manager(input.workspaceId);
    manager.dirOf(input.name); // refuses a bad name before anything is written
    const key = { host: this.options.host, workspaceId: input.workspaceId, name: input.name };
    const deadline = Date.now() + this.durations.claimLeaseMs + 30_000;
    const claim = { to: 'active' as const, jobId: input.jobId, taskId: input.taskId, touch: true };
    for (let attempt = 0; ; attempt++) {
      // Each round either claims the fork or sees another process move it meanwhile; this bounds a storm.
      if (attempt >= MAX_ACQUIRE_ROUNDS) throw new ForkBusyError(input.name, null);
      const row = await findFork(this.db, key);
      let claimed: ForkRow | null = null;
      if (!row) {
        claimed = await insertActiveFork(this.db, { ...key, taskId: input.taskId, jobId: input.jobId, mode: defaultMode() });
      } else {
        switch (row.state as ForkState) {
          case 'idle':
          case 'stopped':
          case 'archived':
          case 'deleted':
            claimed = await moveFork(this.db, row.id, { ...claim, from: row.state as ForkState });
            break;
          case 'active': {
            // The same job again (a retried acquire), or a job that no longer runs (its executor died).
            const holder = row.jobId === null ? isNull(forks.jobId) : eq(forks.jobId, row.jobId);
            const where = row.jobId === input.jobId ? holder : and(holder, jobNotRunning);
            claimed = await moveFork(this.db, row.id, { ...claim, from: 'active', where });
            if (!claimed && (await findFork(this.db, key))?.jobId === row.jobId) {
              // Its job still runs, or was cancelled and is winding down: wait for the release (or its
              // lease to run out), within bounds.
              if (Date.now() > deadline) throw new ForkBusyError(input.name, row.jobId);
              await new Promise((resolve) => setTimeout(resolve, WAIT_FOR_MOVE_MS));
              continue;
            }
            break;
          }
          case 'archiving':
          case 'deleting':
            if (Date.now() > deadline) throw new ForkBusyError(input.name, null);
            // A move under way finishes first; one abandoned by a crash is finished here.
            if (!(await this.moveOn(row))) await new Promise((resolve) => setTimeout(resolve, WAIT_FOR_MOVE_MS));
            continue;
        }
      }
      if (!claimed) continue;
      try {
        const made = await this.materialize(manager, claimed, row?.state ?? 'deleted', input.environment);
        this.held.set(made.fork, { id: claimed.id, jobId: input.jobId, workspaceId: input.workspaceId });
        return made;
      } catch (error) {
        await moveFork(this.db, claimed.id, { from: 'active', to: 'idle', where: eq(forks.jobId, input.jobId), jobId: null }).catch(() => undefined);
        throw error;
      }
    }
  }

  /** The claimed fork's files: its directory as it is, restored from its archive, or made fresh. */
  private async materialize(manager: ForkManager, row: ForkRow, previous: string, environment: AcquireInput['environment']): Promise<AcquiredFork> {
    const mode = row.mode as ForkMode;
    // A flattened version shows the files of the version it flattened: a fork of that one is not behind.
    const kept = (fork: Fork | null): AcquiredFork | null => (fork ? { fork, fresh: false, outdated: !sameFiles(environment, fork.info.lower.version) } : null);
    if (previous !== 'deleted') {
      await this.adoptLegacyLower(manager, row);
      let reused: AcquiredFork | null = null;
      if (existsSync(manager.dirOf(row.name))) {
        // An archive beside the directory is left by a crash between a restore's rename and its cleanup.
        await rm(manager.archiveOf(row.name), { force: true });
        reused = kept(await manager.open(row.name, mode));
      } else if (existsSync(manager.archiveOf(row.name))) {
        this.options.logger.info({ fork: row.name, workspaceId: row.workspaceId }, 'restoring an archived fork');
        reused = kept(await manager.restore(row.name, mode));
      }
      if (reused) return reused;
      this.options.logger.warn({ fork: row.name, workspaceId: row.workspaceId, state: previous }, "the fork's files are gone or predate environment versions; starting a fresh fork");
    }
    return { fork: await this.makeFresh(manager, row, environment), fresh: true, outdated: false };
  }

  /**
   * Gives an overlay fork made before environment versions (its directory or its archive, and no `.lower`
   * record) the record of the legacy layer it was made from, then drops its `.lower-version` marker.
   * Leaves it as it is when that layer is not the fork's (it is then made fresh).
   */
  private async adoptLegacyLower(manager: ForkManager, row: ForkRow): Promise<void> {
    if (!this.options.environmentsRoot || (row.mode as ForkMode) !== 'overlay' || manager.lowerOf(row.name)) return;
    const dir = manager.dirOf(row.name);
    const changedAt = forkFilesChangedAt(dir);
    if (changedAt === undefined) return;
    const marker = existsSync(`${dir}${LEGACY_LOWER_SUFFIX}`) ? readFileSync(`${dir}${LEGACY_LOWER_SUFFIX}`, 'utf8') : null;
    const store = new EnvironmentStore(join(this.options.environmentsRoot, row.workspaceId), this.options.policy);
    const lower = await store.legacyLower({ marker, changedAt });
    if (!lower) return;
    await writeFile(`${dir}${LOWER_SUFFIX}.tmp`, JSON.stringify(lower));
    await rename(`${dir}${LOWER_SUFFIX}.tmp`, `${dir}${LOWER_SUFFIX}`);
    await rm(`${dir}${LEGACY_LOWER_SUFFIX}`, { force: true });
    this.options.logger.info({ fork: row.name, workspaceId: row.workspaceId, version: lower.version }, 'a fork made before environment versions resumes on the environment it was made from');
  }

  /** Removes everything of the fork here, a marker from before environment versions too. */
  private async removeAll(manager: ForkManager, name: string): Promise<void> {
    await manager.removeAll(name);
    for (const suffix of [LEGACY_LOWER_SUFFIX, `${LOWER_SUFFIX}.tmp`]) await rm(`${manager.dirOf(name)}${suffix}`, { force: true });
  }

  private async makeFresh(manager: ForkManager, row: ForkRow, environment: EnvironmentSnapshot): Promise<Fork> {
    await this.removeAll(manager, row.name);
    const fork = await manager.create(row.name, environment);
    if (fork.info.mode !== row.mode) await setForkMode(this.db, row.id, row.jobId ?? '', fork.info.mode);
    return fork;
  }

  /**
   * Replaces a fork this process holds with a fresh one of `environment` (the job found nothing in it
   * that a fresh fork would lose). The old fork must run nothing any more.
   */
  async renew(fork: Fork, environment: EnvironmentSnapshot): Promise<Fork> {
    const held = this.held.get(fork);
    if (!held) throw new Error(`fork ${fork.info.name} was not acquired here`);
    const row = await findFork(this.db, { host: this.options.host, workspaceId: held.workspaceId, name: fork.info.name });
    if (!row || row.state !== 'active' || row.jobId !== held.jobId) throw new ForkBusyError(fork.info.name, row?.jobId ?? null);
    // Dev servers an earlier job left running (the fork was idle, not yet stopped) go with their fork.
    await stopRecordedProcesses(fork.info.dir, readProcessRecords(fork.info.dir));
    const fresh = await this.makeFresh(this.manager(held.workspaceId), row, environment);
    this.held.delete(fork);
    this.held.set(fresh, held);
    return fresh;
  }

  /**
   * The environment versions forks of `workspaceId` use, on every host under `forksParent` (`dataDir/forks`):
   * what environment garbage collection must keep. `environment` (the workspace's) judges forks with no
   * record of their version; without it, each of them keeps version 1.
   */
  static versionsInUse(forksParent: string, workspaceId: string, environment?: Pick<EnvironmentStore, 'mayBeUnmarkedLegacyFork'>): Set<number> {
    const versions = new Set<number>();
    if (!existsSync(forksParent)) return versions;
    for (const host of readdirSync(forksParent)) {
      const dir = join(forksParent, host, workspaceId);
      if (!existsSync(dir)) continue;
      for (const entry of readdirSync(dir)) {
        // A fork from before versions, not yet resumed: it may resume on the first version. So may a fork
        // (its directory or its archive) with no record at all (older than the marker) or an unreadable
        // one, when its files are older than the first version: the rule its resumption follows.
        if (entry.endsWith(LEGACY_LOWER_SUFFIX)) versions.add(LEGACY_VERSION);
        const fork = entry.endsWith(ARCHIVE_SUFFIX) ? entry.slice(0, -ARCHIVE_SUFFIX.length) : entry;
        if (FORK_NAME.test(fork) && !readSnapshot(join(dir, `${fork}${LOWER_SUFFIX}`))) {
          if (!environment || environment.mayBeUnmarkedLegacyFork(forkFilesChangedAt(join(dir, fork)) ?? null)) versions.add(LEGACY_VERSION);
        }
        if (!entry.endsWith(LOWER_SUFFIX)) continue;
        const snapshot = readSnapshot(join(dir, entry));
        if (snapshot) versions.add(snapshot.version);
      }
    }
    return versions;
  }

  /** The job is done with the fork: it stays as it is, idle, for the task's next job. */
  async release(fork: Fork): Promise<void> {
    const held = this.held.get(fork);
    if (!held) throw new Error(`fork ${fork.info.name} was not acquired here`);
    this.held.delete(fork);
    const moved = await moveFork(this.db, held.id, { from: 'active', to: 'idle', where: eq(forks.jobId, held.jobId), jobId: null, touch: true });
    if (!moved) this.options.logger.warn({ fork: fork.info.name, jobId: held.jobId }, 'the fork was taken over by another job before its release');
  }

  /** Removes the fork now (a read-only run leaves nothing worth keeping). */
  async discard(fork: Fork): Promise<void> {
    const held = this.held.get(fork);
    if (!held) throw new Error(`fork ${fork.info.name} was not acquired here`);
    this.held.delete(fork);
    const records = readProcessRecords(fork.info.dir);
    const claimed = await moveFork(this.db, held.id, { from: 'active', to: 'deleting', where: eq(forks.jobId, held.jobId), jobId: null, touch: true });
    if (!claimed) {
      this.options.logger.warn({ fork: fork.info.name, jobId: held.jobId }, 'the fork was taken over by another job before it was discarded');
      return;
    }
    await this.delete(claimed, records);
  }

  /**
   * Shutdown: a tick under way stops after the move it is making (a move is crash-safe, so what is left
   * is done by the next process), and no other starts.
   */
  abort(): void {
    this.aborted = true;
  }

  /** Moves this host's forks that are due; each move is done by one process only. */
  async tick(): Promise<TickResult> {
    const result: TickResult = { stopped: 0, archived: 0, deleted: 0 };
    for (const row of this.aborted ? [] : await listDueForks(this.db, this.options.host, this.durations)) {
      if (this.aborted) break;
      try {
        const moved = await this.moveOn(row);
        if (moved) result[moved] += 1;
      } catch (error) {
        const log = error instanceof ClaimLostError ? 'info' : 'warn';
        this.options.logger[log]({ err: error, fork: row.name, workspaceId: row.workspaceId, state: row.state }, 'a fork lifecycle move failed');
      }
    }
    return result;
  }

  /** Does the move that is due for the fork in its observed state; the move done, or null if none was. */
  private async moveOn(row: ForkRow): Promise<keyof TickResult | null> {
    const state = row.state as ForkState;
    const due = dueCondition(state, this.durations) ?? undefined;
    const manager = this.manager(row.workspaceId);
    const records = readProcessRecords(manager.dirOf(row.name));
    switch (state) {
      case 'idle':
      case 'active': {
        const holder = row.jobId === null ? isNull(forks.jobId) : eq(forks.jobId, row.jobId);
        const moved = await moveFork(this.db, row.id, { from: state, to: 'stopped', where: and(due, holder), jobId: null });
        if (!moved) return null;
        await stopRecordedProcesses(manager.dirOf(row.name), records);
        return 'stopped';
      }
      case 'stopped':
      case 'archiving':
      case 'archived':
      case 'deleting': {
        // The claim first (`archiving` or `deleting`), then the files.
        const archiving = state === 'stopped' || state === 'archiving';
        const claimed = await moveFork(this.db, row.id, { from: state, to: archiving ? 'archiving' : 'deleting', where: due });
        if (!claimed) return null;
        await (archiving ? this.archive(claimed, records) : this.delete(claimed, records));
        return archiving ? 'archived' : 'deleted';
      }
      case 'deleted':
        return null;
    }
  }

  /** Archives a fork claimed `archiving`, renewing the claim while the tar runs. */
  private async archive(claimed: ForkRow, records: ProcessRecord[]): Promise<void> {
    const manager = this.manager(claimed.workspaceId);
    let token = claimed.stateChangedAt;
    let renewal: Promise<void> = Promise.resolve();
    const renew = async () => {
      const renewed = await moveFork(this.db, claimed.id, { from: 'archiving', to: 'archiving', where: eq(forks.stateChangedAt, token) });
      if (!renewed) throw new ClaimLostError(claimed.name);
      token = renewed.stateChangedAt;
    };
    const timer = setInterval(() => {
      renewal = renewal.then(renew).catch(() => undefined);
    }, Math.max(50, Math.floor(this.durations.claimLeaseMs / 3)));
    try {
      await stopRecordedProcesses(manager.dirOf(claimed.name), records);
      // An archive is newer than the files of a fork from before versions: they are judged before it.
      await this.adoptLegacyLower(manager, claimed);
      await manager.archive(claimed.name, claimed.mode as ForkMode, async () => {
        await renewal;
        await renew();
      });
    } finally {
      clearInterval(timer);
      await renewal;
    }
    if (!(await moveFork(this.db, claimed.id, { from: 'archiving', to: 'archived', where: eq(forks.stateChangedAt, token) }))) {
      throw new ClaimLostError(claimed.name);
    }
    this.options.logger.info({ fork: claimed.name, workspaceId: claimed.workspaceId }, 'fork archived');
  }

  /** Removes everything of a fork claimed `deleting` (idempotent: a crashed removal is simply redone). */
  private async delete(claimed: ForkRow, records: ProcessRecord[]): Promise<void> {
    const manager = this.manager(claimed.workspaceId);
    await stopRecordedProcesses(manager.dirOf(claimed.name), records);
    await this.removeAll(manager, claimed.name);
    if (!(await moveFork(this.db, claimed.id, { from: 'deleting', to: 'deleted', where: eq(forks.stateChangedAt, claimed.stateChangedAt) }))) {
      throw new ClaimLostError(claimed.name);
    }
  }
}

/**
 * When the files of the fork at `dir` last changed (ms), at their top: its upper dir (the fork's directory
 * itself also changes when its dev servers are recorded or stopped), else its directory; when only its
 * archive is left, the upper dir's time as archived (the archive itself is newer than its files: it may
 * have been made after version 1). Undefined when the fork has no files here; null when the archive's
 * time cannot be read.
 */
export function forkFilesChangedAt(dir: string): number | null | undefined {
  for (const path of [join(dir, 'upper'), dir]) {
    try {
      return statSync(path).mtimeMs;
    } catch {
      // Not there: the next place.
    }
  }
  const archive = `${dir}${ARCHIVE_SUFFIX}`;
  return existsSync(archive) ? archivedTopTime(archive) : undefined;
}

/** A tar header's block; the first entry's headers fit in the first blocks read here. */
const TAR_BLOCK = 512;
const ARCHIVE_HEAD_BYTES = 64 * 1024;

/**
 * The time of the top directory (`./`, the fork's upper dir) in a fork's archive (ForkManager.archive: a
 * gzipped tar of that directory, its first entry), read from the archive's first blocks; null when it
 * cannot be read there.
 */
function archivedTopTime(archive: string): number | null {
  let tar: Buffer;
  try {
    const head = Buffer.alloc(ARCHIVE_HEAD_BYTES);
    const file = openSync(archive, 'r');
    try {
      tar = gunzipSync(head.subarray(0, readSync(file, head, 0, head.length, 0)), { finishFlush: zlib.Z_SYNC_FLUSH });
    } finally {
      closeSync(file);
    }
  } catch {
    return null;
  }
  const field = (at: number, start: number, length: number): string => tar.subarray(at + start, at + start + length).toString('latin1').replace(/\0.*$/s, '').trim();
  let paxTime: number | null = null;
  for (let at = 0; at + TAR_BLOCK <= tar.length; ) {
    if (field(at, 257, 5) !== 'ustar') return null;
    const type = field(at, 156, 1);
    const size = parseInt(field(at, 124, 12) || '0', 8);
    if (type === 'x') {
      // A pax header (GNU tar writes one for xattrs): its `mtime=` is the entry's exact time.
      const records = tar.subarray(at + TAR_BLOCK, at + TAR_BLOCK + size).toString('utf8');
      const mtime = /(?:^|\n)\d+ mtime=([\d.]+)\n/.exec(records)?.[1];
      if (mtime) paxTime = Number(mtime) * 1000;
      at += TAR_BLOCK + Math.ceil(size / TAR_BLOCK) * TAR_BLOCK;
      continue;
    }
    if (type !== '5' || !['.', './'].includes(field(at, 0, 100))) return null;
    const seconds = parseInt(field(at, 136, 12), 8);
    return paxTime ?? (Number.isFinite(seconds) ? seconds * 1000 : null);
  }
  return null;
}

function defaultMode(): ForkMode {
  return sandboxCapabilities().overlay ? 'overlay' : 'clone';
}
