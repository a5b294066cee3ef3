/**
 * Task forks on a host (the `forks` table): one row per host, workspace and name. Every state move is a
 * conditional UPDATE (`… where state = <from> and <condition>`) returning the row, or null when another
 * process moved it first; times are the database's (`now()`), never a process clock.
 *
 * States: `active` (a job runs in it), `idle`, `stopped`, `archived`, `deleted`, and two that mark a
 * move under way on the host's files: `archiving` and `deleting`. A claim's `state_changed_at` is its
 * token (kept to whole milliseconds, so that it survives the round trip through a JS Date) and its lease.
 */
import { and, eq, inArray, or, sql, type SQL } from 'drizzle-orm';
import type { Db } from './db.js';
import { forks } from './schema.js';

export type ForkRow = typeof forks.$inferSelect;
export type ForkState = 'active' | 'idle' | 'stopped' | 'archiving' | 'archived' | 'deleting' | 'deleted';

export interface ForkKey {
  host: string;
  workspaceId: string;
  name: string;
}

/** When forks move on: idle → stopped, stopped → archived, archived → deleted; and a claim's lease. */
export interface ForkDurations {
  /** Since last use, an idle fork (or one whose job no longer runs) is stopped. */
  idleStopMs: number;
  /** Since it stopped, a stopped fork is archived. */
  archiveMs: number;
  /** Since last use, an archived fork is deleted. */
  deleteMs: number;
  /** How long an `archiving` or `deleting` claim holds before another process may take over the move. */
  claimLeaseMs: number;
}

/** `now()` in whole milliseconds: a claim token that compares equal after a round trip through Date. */
const NOW_MS = sql`date_trunc('milliseconds', now())`;
const olderThan = (column: typeof forks.lastUsedAt | typeof forks.stateChangedAt, ms: number) => sql`${column} <= now() - ${ms}::double precision * interval '1 millisecond'`;

/**
 * The fork's job no longer runs: gone, finished, or its lease expired (its executor died). A cancelled
 * job still counts until its lease runs out (or its executor releases the fork), since its executor may
 * still be winding down in the fork.
 */
export const jobNotRunning = sql`not exists (select 1 from jobs where jobs.id = ${forks.jobId} and jobs.status in ('IN_PROGRESS', 'CANCELLED') and jobs.lease_expires_at > now())`;

/** The conditions under which each state is due to move on (idle includes an abandoned active fork). */
export function dueCondition(state: ForkState, durations: ForkDurations): SQL | null {
  switch (state) {
    case 'idle':
      return olderThan(forks.lastUsedAt, durations.idleStopMs);
    case 'active':
      return and(jobNotRunning, olderThan(forks.lastUsedAt, durations.idleStopMs)) ?? null;
    case 'stopped':
      return olderThan(forks.stateChangedAt, durations.archiveMs);
    case 'archived':
      return olderThan(forks.lastUsedAt, durations.deleteMs);
    case 'archiving':
    case 'deleting':
      return olderThan(forks.stateChangedAt, durations.claimLeaseMs);
    case 'deleted':
      return null;
  }
}

export async function findFork(db: Db, key: ForkKey): Promise<ForkRow | null> {
  const [row] = await db
    .select()
    .from(forks)
    .where(and(eq(forks.host, key.host), eq(forks.workspaceId, key.workspaceId), eq(forks.name, key.name)));
  return row ?? null;
}

/** Inserts the fork `active` under `jobId`; null when a row for its key exists already. */
export async function insertActiveFork(db: Db, values: ForkKey & { taskId: string; jobId: string; mode: string }): Promise<ForkRow | null> {
  const [row] = await db
    .insert(forks)
    .values({ ...values, state: 'active', lastUsedAt: sql`now()`, stateChangedAt: NOW_MS })
    .onConflictDoNothing()
    .returning();
  return row ?? null;
}

export interface ForkMove {
  /** The state the row must be in (the one observed). */
  from: ForkState;
  to: ForkState;
  /** Further conditions: a due time, a claim token, the job that holds it. */
  where?: SQL | undefined;
  jobId?: string | null;
  taskId?: string;
  mode?: string;
  /** Sets `last_used_at = now()`. */
  touch?: boolean;
}

/** Moves the fork `from` → `to` if it is still in `from` (and `where` holds); null when it was not. */
export async function moveFork(db: Db, id: string, move: ForkMove): Promise<ForkRow | null> {
  const [row] = await db
    .update(forks)
    .set({
      state: move.to,
      stateChangedAt: NOW_MS,
      ...(move.jobId !== undefined ? { jobId: move.jobId } : {}),
      ...(move.taskId !== undefined ? { taskId: move.taskId } : {}),
      ...(move.mode !== undefined ? { mode: move.mode } : {}),
      ...(move.touch ? { lastUsedAt: sql`now()` } : {}),
    })
    .where(and(eq(forks.id, id), eq(forks.state, move.from), move.where))
    .returning();
  return row ?? null;
}

/** Sets the fork's mode while `jobId` holds it active (a fresh fork learns its mode when it is made). */
export async function setForkMode(db: Db, id: string, jobId: string, mode: string): Promise<void> {
  await db
    .update(forks)
    .set({ mode })
    .where(and(eq(forks.id, id), eq(forks.state, 'active'), eq(forks.jobId, jobId)));
}

/** This host's forks that are due to move on (or whose claimed move was abandoned), oldest first. */
export async function listDueForks(db: Db, host: string, durations: ForkDurations, limit = 100): Promise<ForkRow[]> {
  const states: ForkState[] = ['active', 'idle', 'stopped', 'archiving', 'archived', 'deleting'];
  const due = states.map((state) => and(eq(forks.state, state), dueCondition(state, durations) ?? undefined));
  return db
    .select()
    .from(forks)
    .where(and(eq(forks.host, host), inArray(forks.state, states), or(...due)))
    .orderBy(forks.stateChangedAt)
    .limit(limit);
}
