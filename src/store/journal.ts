/**
 * The job journal: one ordered, idempotent log of events per job, read by `svc task logs`, the web
 * timeline and pull-request proof, and written by the cloud executor and the runner's POST /events.
 */
import { createHash } from 'node:crypto';
import { and, asc, eq, gt, gte, sql, type SQL } from 'drizzle-orm';
import { queryRows, type Db } from './db.js';
import { heldByRunner } from './runs.js';
import { jobEvents, jobs } from './schema.js';

/** NOTIFY channel for appended events; the payload is the task id. */
export const EVENTS_CHANNEL = 'svc_events';

export interface JournalEvent {
  kind: string;
  data: unknown;
  /**
   * What a retry of the event is compared with; by default the SHA-256 of `{ kind, data }`. A writer whose
   * stored data differs from what it was sent (characters replaced, an event joined from parts) names the
   * digest of what it was sent, so that a retry compares the sender's content.
   */
  digest?: string;
}

export type EventRow = typeof jobEvents.$inferSelect;

export type AppendRefusal =
  | { ok: false; reason: 'stale_generation' | 'not_running' | 'sequence_conflict'; message: string; expectedSequence: number }
  /** `runnerId` was given and the job is not that runner's (or there is no such job). */
  | { ok: false; reason: 'not_found'; message: string };

export type AppendResult = { ok: true; acknowledgedSequence: number } | AppendRefusal;

/** A job locked for an append, with its journal's last sequence. */
export interface JournalHead {
  jobId: string;
  taskId: string;
  status: string;
  generation: number;
  runnerState: string | null;
  last: number;
}

export interface AppendInput {
  jobId: string;
  generation: number;
  firstSequence: number;
  events: readonly JournalEvent[];
  /** The runner the job must be assigned to (runner uploads): anything else is `not_found`. */
  runnerId?: string;
}

export interface AppendOptions {
  /** Runs in the same transaction with the events just stored (not those a retry repeated). */
  onStored?: (tx: Db, stored: ReadonlyArray<{ sequence: number; event: JournalEvent }>, job: { id: string; taskId: string }) => Promise<void>;
}

/** A JavaScript array as one PostgreSQL array parameter (drizzle would spread it into a value list). */
function toArray(values: readonly (string | number)[]): SQL {
  return sql`${`{${values.map((value) => (typeof value === 'number' ? String(value) : `"${value.replace(/\\/g, '\\\\').replace(/"/g, '\\"')}"`)).join(',')}}`}`;
}

function digestOf(event: JournalEvent): string {
  return event.digest ?? createHash('sha256').update(JSON.stringify({ kind: event.kind, data: event.data })).digest('hex');
}

/**
 * Locks a job for an append and reads its last sequence: its task first, then the job, the order of every
 * task action. An upload that locked the job first would wait for the task's row (the journal's foreign
 * key takes a share of it) while a task action holding the task waits for the job: a deadlock.
 *
 * Two statements: the second one's snapshot is taken once the task is held, when nobody else can be
 * appending (every append holds the task), so the last sequence it reads is the last one committed. With
 * `runnerId`, another runner's job locks nothing: null, as for a job that does not exist.
 */
export async function lockJournal(tx: Db, jobId: string, runnerId?: string): Promise<JournalHead | null> {
  const owned = runnerId === undefined ? sql`true` : sql`j.runner_id = ${runnerId}::uuid`;
  const [task] = await queryRows<{ id: string }>(tx, sql`select t.id from tasks t where t.id = (select j.task_id from jobs j where j.id = ${jobId}::uuid and ${owned}) for update`);
  if (!task) return null;
  const [head] = await tx
    .select({
      jobId: jobs.id,
      taskId: jobs.taskId,
      status: jobs.status,
      generation: jobs.generation,
      runnerState: jobs.runnerState,
      // Qualified by hand: drizzle leaves the columns of a one-table select unqualified.
      last: sql<number>`(select coalesce(max(e.sequence), 0) from job_events e where e.job_id = "jobs"."id")::int`,
    })
    .from(jobs)
    .where(eq(jobs.id, jobId))
    .for('update');
  return head ?? null;
}

/**
 * What an append of `count` events at `firstSequence` would do to the locked journal: refused, or how many
 * of them repeat stored events (the rest are new). New events are accepted only from the generation that
 * holds the running job, and only right after the last stored one.
 */
export function planAppend(head: JournalHead, input: { generation: number; firstSequence: number; count: number }): AppendRefusal | { ok: true; repeated: number } {
  const expectedSequence = head.last + 1;
  const refuse = (reason: 'stale_generation' | 'not_running' | 'sequence_conflict', message: string): AppendRefusal => ({ ok: false, reason, message, expectedSequence });
  if (head.generation !== input.generation) {
    return refuse('stale_generation', `generation ${input.generation} no longer holds this job (now ${head.generation})`);
  }
  if (input.firstSequence > expectedSequence) return refuse('sequence_conflict', `events before sequence ${input.firstSequence} are missing`);
  const repeated = Math.min(input.count, expectedSequence - input.firstSequence);
  // A runner still delivers the output of a run cancelled under it (it holds the run until its receipt).
  if (repeated < input.count && head.status !== 'IN_PROGRESS' && !heldByRunner(head)) return refuse('not_running', `job is ${head.status}; it takes no new events`);
  return { ok: true, repeated };
}

/**
 * Appends `events` to a locked job's journal at `firstSequence` (1-based). A batch that repeats events
 * already stored with identical content is acknowledged again (a retry); a batch that differs from them,
 * or that would leave a gap, is refused with the sequence the journal expects next, since every event
 * before it is stored.
 */
export async function appendLocked(tx: Db, head: JournalHead, input: Omit<AppendInput, 'jobId' | 'runnerId'>, options: AppendOptions = {}): Promise<AppendResult> {
  const plan = planAppend(head, { generation: input.generation, firstSequence: input.firstSequence, count: input.events.length });
  if (!plan.ok) return plan;
  const expectedSequence = head.last + 1;
  const digests = input.events.map(digestOf);
  if (plan.repeated > 0) {
    const stored = await tx
      .select({ digest: jobEvents.digest })
      .from(jobEvents)
      .where(and(eq(jobEvents.jobId, head.jobId), gte(jobEvents.sequence, input.firstSequence)))
      .orderBy(asc(jobEvents.sequence))
      .limit(plan.repeated);
    if (stored.some((row, index) => row.digest !== digests[index])) {
      return { ok: false, reason: 'sequence_conflict', message: `a retried batch from sequence ${input.firstSequence} differs from the stored events`, expectedSequence };
    }
  }
  const fresh = input.events.slice(plan.repeated);
  if (fresh.length > 0) {
    // One statement for any number of events (arrays, not a value list) with its NOTIFY: a runner's
    // batches are large and frequent.
    await tx.execute(sql`
      with stored as (
        insert into ${jobEvents} (job_id, task_id, sequence, kind, data, digest)
        select ${head.jobId}::uuid, ${head.taskId}::uuid, e.sequence, e.kind, e.data::jsonb, e.digest
        from unnest(${toArray(fresh.map((_, index) => expectedSequence + index))}::int[], ${toArray(fresh.map((event) => event.kind))}::text[],
          ${toArray(fresh.map((event) => JSON.stringify(event.data ?? null)))}::text[], ${toArray(digests.slice(plan.repeated))}::text[]) as e(sequence, kind, data, digest)
        returning 1
      )
      select pg_notify(${EVENTS_CHANNEL}, ${head.taskId}) from (select count(*) from stored) as done`);
    await options.onStored?.(tx, fresh.map((event, index) => ({ sequence: expectedSequence + index, event })), { id: head.jobId, taskId: head.taskId });
  }
  return { ok: true, acknowledgedSequence: input.firstSequence + input.events.length - 1 };
}

/** Locks the job (appendLocked) and appends, in a transaction of its own. */
export async function appendEvents(db: Db, input: AppendInput, options: AppendOptions = {}): Promise<AppendResult> {
  return db.transaction(async (tx) => {
    const head = await lockJournal(tx, input.jobId, input.runnerId);
    if (!head) {
      if (input.runnerId !== undefined) return { ok: false, reason: 'not_found', message: 'Run not found' };
      throw new Error(`job ${input.jobId} does not exist`);
    }
    return appendLocked(tx, head, input, options);
  });
}

/** A task's events after the journal id `afterId`, in order. */
export async function readTaskEvents(db: Db, taskId: string, afterId: number, limit: number): Promise<EventRow[]> {
  return db
    .select()
    .from(jobEvents)
    .where(and(eq(jobEvents.taskId, taskId), gt(jobEvents.id, afterId)))
    .orderBy(asc(jobEvents.id))
    .limit(limit);
}
