/**
 * Local runs (jobs assigned to a desktop runner), their controls, staged event parts, the requests they
 * put to their owner and the review requests put to them. The rules about them live in engine/runners.
 *
 * Lock order, for every transaction that takes more than one of these locks: a run's task, then the run
 * (its job row), then the runner's row (`bumpWorkVersion`, a reconnect's rotation, and an insert that
 * references the runner all take it). Several tasks are locked in order of id, all before any of their
 * runs (lockHeldRuns). A run, and its own rows (controls, staged parts, its owner's requests), change
 * only under its task's lock: no transaction can then hold one of a task's rows while another holds a
 * second and waits for the first.
 */
import { and, asc, desc, eq, gt, inArray, isNotNull, lt, or, sql, type SQL } from 'drizzle-orm';
import { notify, type Db } from './db.js';
import { RUNNER_CHANNEL } from './runners.js';
import { eventParts, jobEvents, jobs, localRequests, messages, reviewRequests, runControls, tasks } from './schema.js';
import type { JobRow, TaskRow } from './tasks.js';

export type ControlRow = typeof runControls.$inferSelect;
export type LocalRequestRow = typeof localRequests.$inferSelect;
export type ReviewRequestRow = typeof reviewRequests.$inferSelect;
export type MessageRow = typeof messages.$inferSelect;

/** Whether a runner holds a run: claimed (executing or syncing), or cancelled under it before its receipt. */
export function heldByRunner(job: { status: string; runnerState: string | null }): boolean {
  return job.runnerState !== null && (job.status === 'IN_PROGRESS' || job.status === 'CANCELLED');
}

/** Whether a runner executes a run now: claimed and not syncing (nor cancelled: those it only holds). */
export function executingOnRunner(job: { status: string; runnerState: string | null }): boolean {
  return job.status === 'IN_PROGRESS' && job.runnerState === 'executing';
}

/** heldByRunner as a condition on `jobs`. */
const held = and(isNotNull(jobs.runnerState), inArray(jobs.status, ['IN_PROGRESS', 'CANCELLED']));

/**
 * The runs a runner is to see, oldest first, with their tasks: every run it holds (never cut: a held run
 * missing from the list would look finished to it; a claim past `limit` held runs is refused, so they fit),
 * then queued runs up to `limit` runs in all. Two queries, whatever the number of runs.
 */
export async function listRunnerRuns(db: Db, runnerId: string, limit: number): Promise<Array<{ job: JobRow; task: TaskRow }>> {
  const runs = (condition: SQL | undefined) =>
    db
      .select({ job: jobs, task: tasks })
      .from(jobs)
      .innerJoin(tasks, eq(tasks.id, jobs.taskId))
      .where(and(eq(jobs.runnerId, runnerId), condition))
      .orderBy(asc(jobs.seq));
  const claimed = await runs(held);
  const room = limit - claimed.length;
  return room > 0 ? [...claimed, ...(await runs(eq(jobs.status, 'PENDING')).limit(room))] : claimed;
}

/** How many runs the runner holds (heldByRunner): claimed, or cancelled under it before its receipt. */
export async function countHeldRuns(db: Db, runnerId: string): Promise<number> {
  const [row] = await db.select({ n: sql<number>`count(*)::int` }).from(jobs).where(and(eq(jobs.runnerId, runnerId), held));
  return row?.n ?? 0;
}

/** One run of the runner, with its task; null when it is not the runner's (or does not exist). */
export async function findRunnerRun(db: Db, runnerId: string, runId: string): Promise<{ job: JobRow; task: TaskRow } | null> {
  const [row] = await db
    .select({ job: jobs, task: tasks })
    .from(jobs)
    .innerJoin(tasks, eq(tasks.id, jobs.taskId))
    .where(and(eq(jobs.id, runId), eq(jobs.runnerId, runnerId)));
  return row ?? null;
}

/** A task by its id (the caller holds its lock when it acts on it). */
export async function findTaskRow(db: Db, taskId: string): Promise<TaskRow | null> {
  const [row] = await db.select().from(tasks).where(eq(tasks.id, taskId));
  return row ?? null;
}

/** Locks a run's task, then the run (the order of every task action), and answers both. */
export async function lockRunnerRun(tx: Db, runnerId: string, runId: string): Promise<{ job: JobRow; task: TaskRow } | null> {
  const [owner] = await tx.select({ taskId: jobs.taskId }).from(jobs).where(and(eq(jobs.id, runId), eq(jobs.runnerId, runnerId)));
  if (!owner) return null;
  const [task] = await tx.select().from(tasks).where(eq(tasks.id, owner.taskId)).for('update');
  const [job] = await tx.select().from(jobs).where(eq(jobs.id, runId)).for('update');
  return task && job ? { job, task } : null;
}

/**
 * Locks the runs a runner holds — claimed (IN_PROGRESS), or cancelled under it before its receipt — for
 * a reconnect, in the lock order above: their task ids are read without a lock, the tasks locked in order
 * of id, then the runs. Answers the runs still held once locked, oldest first.
 */
export async function lockHeldRuns(tx: Db, runnerId: string): Promise<JobRow[]> {
  const ofRunner = and(eq(jobs.runnerId, runnerId), or(eq(jobs.status, 'IN_PROGRESS'), held));
  const owners = await tx.selectDistinct({ taskId: jobs.taskId }).from(jobs).where(ofRunner);
  if (owners.length === 0) return [];
  const taskIds = owners.map((owner) => owner.taskId);
  await tx.select({ id: tasks.id }).from(tasks).where(inArray(tasks.id, taskIds)).orderBy(asc(tasks.id)).for('update');
  return tx
    .select()
    .from(jobs)
    .where(and(ofRunner, inArray(jobs.taskId, taskIds)))
    .orderBy(asc(jobs.seq))
    .for('update');
}

/** Lets go of a cancelled run its runner held, which a reconnect ends; the caller locked its task and run. */
export async function releaseHeldRun(tx: Db, jobId: string): Promise<void> {
  await tx.update(jobs).set({ runnerState: null, updatedAt: sql`now()` }).where(eq(jobs.id, jobId));
}

/** How many events each run's journal holds (its last sequence), for the runs given; absent ones hold none. */
export async function storedEventCounts(db: Db, jobIds: readonly string[]): Promise<Map<string, number>> {
  if (jobIds.length === 0) return new Map();
  const rows = await db
    .select({ jobId: jobEvents.jobId, n: sql<number>`max(${jobEvents.sequence})::int` })
    .from(jobEvents)
    .where(inArray(jobEvents.jobId, [...jobIds]))
    .groupBy(jobEvents.jobId);
  return new Map(rows.map((row) => [row.jobId, row.n]));
}

/** How many events a run's journal holds (its last sequence). */
export async function storedEventCount(db: Db, jobId: string): Promise<number> {
  return (await storedEventCounts(db, [jobId])).get(jobId) ?? 0;
}

/** A message by its id (a run's own, whose metadata names the turn's mode). */
export async function findMessage(db: Db, id: string): Promise<MessageRow | null> {
  const [row] = await db.select().from(messages).where(eq(messages.id, id));
  return row ?? null;
}

/** The messages of the tasks given, each task's in order (the threads run manifests carry). */
export async function taskThreads(db: Db, taskIds: readonly string[]): Promise<Map<string, MessageRow[]>> {
  const threads = new Map<string, MessageRow[]>();
  if (taskIds.length === 0) return threads;
  const rows = await db.select().from(messages).where(inArray(messages.taskId, [...new Set(taskIds)])).orderBy(asc(messages.taskId), asc(messages.seq));
  for (const row of rows) {
    const thread = threads.get(row.taskId);
    if (thread) thread.push(row);
    else threads.set(row.taskId, [row]);
  }
  return threads;
}

/**
 * Whether another job of the task runs, is still held by its runner (cancelled, no receipt yet), or is
 * queued before this one: a run of a task waits its turn, and the next one may execute only after the
 * receipt of the one before.
 */
export async function taskHasEarlierWork(tx: Db, job: JobRow): Promise<boolean> {
  const [row] = await tx
    .select({ id: jobs.id })
    .from(jobs)
    .where(
      and(
        eq(jobs.taskId, job.taskId),
        sql`${jobs.id} <> ${job.id}`,
        or(eq(jobs.status, 'IN_PROGRESS'), held, and(eq(jobs.status, 'PENDING'), lt(jobs.seq, job.seq))),
      ),
    )
    .limit(1);
  return row !== undefined;
}

/**
 * Appends a control to a run (the next sequence) and wakes the runner's long polls; the run's row must
 * be locked by the caller. A second `finish_background_wait` of one run is dropped (the unique index):
 * null then, and nobody is woken.
 *
 * The NOTIFY carries the control itself when it fits (controlNotice), so that a waiting poll can answer
 * without going back to the database; a larger one sends the runner id alone and polls look it up.
 */
export async function insertControl(tx: Db, runnerId: string, jobId: string, message: { type: string } & Record<string, unknown>): Promise<ControlRow | null> {
  const [last] = await tx.select({ sequence: sql<number>`coalesce(max(${runControls.sequence}), 0)::int` }).from(runControls).where(eq(runControls.jobId, jobId));
  const [row] = await tx
    .insert(runControls)
    .values({ jobId, sequence: (last?.sequence ?? 0) + 1, type: message.type, message })
    .onConflictDoNothing()
    .returning();
  if (row) await notify(tx, RUNNER_CHANNEL, controlNotice(runnerId, row));
  return row ?? null;
}

/** NOTIFY payloads stay below PostgreSQL's 8000 bytes. */
const NOTICE_LIMIT = 7_500;

/** The payload announcing a control: `{ runnerId, runId, sequence, message }`, or the runner id when too large. */
export function controlNotice(runnerId: string, row: ControlRow): string {
  const notice = JSON.stringify({ runnerId, runId: row.jobId, sequence: row.sequence, message: row.message });
  return Buffer.byteLength(notice) <= NOTICE_LIMIT ? notice : runnerId;
}

/** A RUNNER_CHANNEL payload read back: the runner to wake, and the control it announces, if any. */
export function readRunnerNotice(payload: string): { runnerId: string; control: { runId: string; sequence: number; message: unknown } | null } {
  if (!payload.startsWith('{')) return { runnerId: payload, control: null };
  try {
    const notice = JSON.parse(payload) as { runnerId: string; runId: string; sequence: number; message: unknown };
    return { runnerId: notice.runnerId, control: { runId: notice.runId, sequence: notice.sequence, message: notice.message } };
  } catch {
    return { runnerId: payload, control: null };
  }
}

/** Controls after each run's cursor, in order, for the runs given (already checked to be the runner's). */
export async function controlsAfter(db: Db, cursors: ReadonlyArray<{ runId: string; after: number }>): Promise<ControlRow[]> {
  if (cursors.length === 0) return [];
  const conditions = cursors.map(({ runId, after }) => and(eq(runControls.jobId, runId), gt(runControls.sequence, after)));
  return db
    .select()
    .from(runControls)
    .where(or(...conditions))
    .orderBy(asc(runControls.jobId), asc(runControls.sequence))
    .limit(1_000);
}

// ---- Event parts ----

export type EventPartRow = typeof eventParts.$inferSelect;

/**
 * Stages one part; a repeat with identical bytes is fine. Answers what is staged for the event after
 * it, or `conflict` when the part (or the event's reference) differs from what was staged before.
 */
export async function stageEventPart(
  tx: Db,
  part: { jobId: string; generation: number; sequence: number; part: number; digest: string; sizeBytes: number; data: Buffer },
): Promise<{ kind: 'staged'; receivedBytes: number } | { kind: 'conflict'; message: string }> {
  const key = and(eq(eventParts.jobId, part.jobId), eq(eventParts.generation, part.generation), eq(eventParts.sequence, part.sequence));
  const staged = await tx
    .select({ part: eventParts.part, digest: eventParts.digest, sizeBytes: eventParts.sizeBytes, length: sql<number>`length(${eventParts.data})::int`, same: sql<boolean>`${eventParts.data} = ${part.data}` })
    .from(eventParts)
    .where(key)
    .for('update');
  const other = staged.find((row) => row.digest !== part.digest || row.sizeBytes !== part.sizeBytes);
  if (other) return { kind: 'conflict', message: `parts of event ${part.sequence} were staged for another reference` };
  const same = staged.find((row) => row.part === part.part);
  if (same && !same.same) return { kind: 'conflict', message: `part ${part.part} of event ${part.sequence} was staged with other bytes` };
  const received = staged.reduce((sum, row) => sum + row.length, 0);
  if (same) return { kind: 'staged', receivedBytes: received };
  if (received + part.data.length > part.sizeBytes) return { kind: 'conflict', message: `the parts of event ${part.sequence} are larger than its reference says (${part.sizeBytes} bytes)` };
  await tx.insert(eventParts).values(part);
  return { kind: 'staged', receivedBytes: received + part.data.length };
}

export async function stagedParts(tx: Db, jobId: string, generation: number, sequence: number): Promise<EventPartRow[]> {
  return tx
    .select()
    .from(eventParts)
    .where(and(eq(eventParts.jobId, jobId), eq(eventParts.generation, generation), eq(eventParts.sequence, sequence)))
    .orderBy(asc(eventParts.part));
}

/** Drops the parts of one event of a run: it is stored now, or its parts did not make it. */
export async function dropEventParts(tx: Db, jobId: string, sequence: number): Promise<void> {
  await tx.delete(eventParts).where(and(eq(eventParts.jobId, jobId), eq(eventParts.sequence, sequence)));
}

/**
 * Drops every part staged for a run, of any event and generation: a new generation claimed the run, or
 * the run ended (its receipt, or a reconnect that finalized it), and nothing staged before can become an
 * event. Wherever a local run finishes or is finalized, its parts go with this.
 */
export async function dropEventPartsOfJob(tx: Db, jobId: string): Promise<void> {
  await tx.delete(eventParts).where(eq(eventParts.jobId, jobId));
}

// ---- Requests to the owner ----

export async function insertLocalRequest(
  tx: Db,
  values: { jobId: string; taskId: string; requestId: string; kind: 'permission' | 'question' | 'async_question'; tool: string | null; payload: unknown },
): Promise<void> {
  await tx.insert(localRequests).values({ ...values, status: 'pending' }).onConflictDoNothing();
}

export async function findLocalRequest(db: Db, taskId: string, requestId: string, forUpdate = false): Promise<LocalRequestRow | null> {
  const query = db
    .select()
    .from(localRequests)
    .where(and(eq(localRequests.taskId, taskId), eq(localRequests.requestId, requestId)))
    .orderBy(desc(localRequests.createdAt))
    .limit(1);
  const [row] = forUpdate ? await query.for('update') : await query;
  return row ?? null;
}

/**
 * Settles the answer an `async_question_answer` control carried (by its id), once the runner reports what
 * became of it: `delivered` to the run, or not delivered and so sent as a `follow-up`, or `dropped`. Only
 * an answer still marked as sent by control is settled, and the first report settles it: a repeated or
 * contradicting report of the same answer id finds nothing (null), so that no answer is delivered twice.
 */
export async function settleControlAnswer(tx: Db, taskId: string, answerId: string, via: 'delivered' | 'follow-up' | 'dropped'): Promise<LocalRequestRow | null> {
  const [row] = await tx
    .update(localRequests)
    .set({ answer: sql`${localRequests.answer} || jsonb_build_object('via', ${via}::text)` })
    .where(and(eq(localRequests.taskId, taskId), sql`${localRequests.answer}->>'id' = ${answerId}`, sql`${localRequests.answer}->>'via' = 'control'`))
    .returning();
  return row ?? null;
}

export async function listLocalRequests(db: Db, taskId: string): Promise<LocalRequestRow[]> {
  return db.select().from(localRequests).where(eq(localRequests.taskId, taskId)).orderBy(asc(localRequests.createdAt));
}

export async function answerLocalRequest(tx: Db, id: string, answer: unknown, userId: string): Promise<boolean> {
  const rows = await tx
    .update(localRequests)
    .set({ status: 'answered', answer, answeredByUserId: userId, answeredAt: sql`now()` })
    .where(and(eq(localRequests.id, id), eq(localRequests.status, 'pending')))
    .returning({ id: localRequests.id });
  return rows.length > 0;
}

/** Syncing clears the run's permissions and questions still pending (async questions stay). */
export async function clearPendingPermissions(tx: Db, jobId: string): Promise<void> {
  await tx
    .update(localRequests)
    .set({ status: 'cleared' })
    .where(and(eq(localRequests.jobId, jobId), eq(localRequests.status, 'pending'), inArray(localRequests.kind, ['permission', 'question'])));
}

// ---- Review requests ----

export async function insertReviewRequest(
  tx: Db,
  values: { runnerId: string; taskId: string; jobId: string | null; path: string; createdByUserId: string },
): Promise<ReviewRequestRow> {
  const [row] = await tx.insert(reviewRequests).values({ ...values, status: 'pending' }).returning();
  return row!;
}

export async function pendingReviewRequests(db: Db, runnerId: string): Promise<ReviewRequestRow[]> {
  return db
    .select()
    .from(reviewRequests)
    .where(and(eq(reviewRequests.runnerId, runnerId), eq(reviewRequests.status, 'pending')))
    .orderBy(asc(reviewRequests.createdAt))
    .limit(100);
}

export async function markReviewRequestsDelivered(db: Db, ids: readonly string[]): Promise<void> {
  if (ids.length > 0) await db.update(reviewRequests).set({ deliveredAt: sql`now()` }).where(inArray(reviewRequests.id, [...ids]));
}

export async function findReviewRequest(db: Db, id: string): Promise<ReviewRequestRow | null> {
  const [row] = await db.select().from(reviewRequests).where(eq(reviewRequests.id, id));
  return row ?? null;
}

export async function answerReviewRequest(
  tx: Db,
  id: string,
  runnerId: string,
  answer: { status: 'answered' | 'failed'; content: Buffer | null; message: string | null },
): Promise<ReviewRequestRow | null> {
  const [row] = await tx
    .update(reviewRequests)
    .set({ ...answer, answeredAt: sql`now()` })
    .where(and(eq(reviewRequests.id, id), eq(reviewRequests.runnerId, runnerId), eq(reviewRequests.status, 'pending')))
    .returning();
  return row ?? null;
}
