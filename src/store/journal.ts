/**
 * The job journal: one ordered, idempotent log of events per job, read by `svc task logs`, the web
 * timeline and pull-request proof, and written by the cloud executor and the runner's POST /events.
 */
import { createHash } from 'node:crypto';
import { and, asc, eq, gt, gte, sql } from 'drizzle-orm';
import { notify, type Db } from './db.js';
import { jobEvents, jobs } from './schema.js';

/** NOTIFY channel for appended events; the payload is the task id. */
export const EVENTS_CHANNEL = 'svc_events';

export interface JournalEvent {
  kind: string;
  data: unknown;
}

export type EventRow = typeof jobEvents.$inferSelect;

export type AppendResult =
  | { ok: true; acknowledgedSequence: number }
  | { ok: false; reason: 'stale_generation' | 'not_running' | 'sequence_conflict'; message: string; expectedSequence: number };

function digestOf(event: JournalEvent): string {
  return createHash('sha256').update(JSON.stringify({ kind: event.kind, data: event.data })).digest('hex');
}

/**
 * Appends `events` to a job's journal at `firstSequence` (1-based). A batch that repeats events already
 * stored with identical content is acknowledged again (a retry); a batch that differs from them, or that
 * would leave a gap, is refused with the sequence the journal expects next, since every event before it
 * is stored. New events are accepted only from the generation that holds the running job.
 */
export async function appendEvents(
  db: Db,
  input: { jobId: string; generation: number; firstSequence: number; events: readonly JournalEvent[] },
): Promise<AppendResult> {
  return db.transaction(async (tx) => {
    const [job] = await tx
      .select({ taskId: jobs.taskId, status: jobs.status, generation: jobs.generation })
      .from(jobs)
      .where(eq(jobs.id, input.jobId))
      .for('update');
    if (!job) throw new Error(`job ${input.jobId} does not exist`);
    const [last] = await tx
      .select({ sequence: sql<number>`coalesce(max(${jobEvents.sequence}), 0)::int` })
      .from(jobEvents)
      .where(eq(jobEvents.jobId, input.jobId));
    const expectedSequence = (last?.sequence ?? 0) + 1;
    const refuse = (reason: Extract<AppendResult, { ok: false }>['reason'], message: string): AppendResult => ({
      ok: false,
      reason,
      message,
      expectedSequence,
    });
    if (job.generation !== input.generation) {
      return refuse('stale_generation', `generation ${input.generation} no longer holds this job (now ${job.generation})`);
    }
    if (input.firstSequence > expectedSequence) {
      return refuse('sequence_conflict', `events before sequence ${input.firstSequence} are missing`);
    }
    const digests = input.events.map(digestOf);
    const repeated = Math.min(input.events.length, expectedSequence - input.firstSequence);
    if (repeated > 0) {
      const stored = await tx
        .select({ sequence: jobEvents.sequence, digest: jobEvents.digest })
        .from(jobEvents)
        .where(and(eq(jobEvents.jobId, input.jobId), gte(jobEvents.sequence, input.firstSequence)))
        .orderBy(asc(jobEvents.sequence))
        .limit(repeated);
      if (stored.some((row, index) => row.digest !== digests[index])) {
        return refuse('sequence_conflict', `a retried batch from sequence ${input.firstSequence} differs from the stored events`);
      }
    }
    const fresh = input.events.slice(repeated);
    if (fresh.length > 0) {
      if (job.status !== 'IN_PROGRESS') return refuse('not_running', `job is ${job.status}; it takes no new events`);
      await tx.insert(jobEvents).values(
        fresh.map((event, index) => ({
          jobId: input.jobId,
          taskId: job.taskId,
          sequence: expectedSequence + index,
          kind: event.kind,
          data: event.data ?? null,
          digest: digests[repeated + index]!,
        })),
      );
      await notify(tx, EVENTS_CHANNEL, job.taskId);
    }
    return { ok: true, acknowledgedSequence: input.firstSequence + input.events.length - 1 };
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
