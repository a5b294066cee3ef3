/**
 * The job queue: the jobs table itself. Executors claim the oldest runnable job with
 * `FOR UPDATE SKIP LOCKED`, hold it under a lease that they renew, and are woken by NOTIFY on
 * `JOBS_CHANNEL` when a job is queued (`insertJob` sends it). Nothing here assumes one process: a job is
 * owned only through its claim, generation and lease in the database.
 *
 * A job whose lease expires (its executor died or lost the database) is FAILED with an error saying so,
 * not retried: an agent run has side effects (pushed branches, opened pull requests) that a blind
 * re-run could duplicate. A follow-up message runs the task again deliberately.
 */
import { and, asc, eq, isNull, lt, sql } from 'drizzle-orm';
import type { Db } from '../store/db.js';
import { jobs, tasks } from '../store/schema.js';
import { updateTask, type JobRow } from '../store/tasks.js';
import { finishJob, StaleGenerationError } from './jobs.js';

export { JOBS_CHANNEL } from '../store/tasks.js';

export interface ClaimOptions {
  /** Names the executor in `lease_owner`, for operators. */
  owner: string;
  leaseMs: number;
}

/**
 * Claims the oldest pending job whose task is runnable: the task is PENDING (so none of its jobs runs)
 * and no older job of the task waits. Locks the job and its task row, skipping rows another executor
 * holds; PostgreSQL re-checks the task's status on the locked row, so two executors never run two jobs
 * of one task. Returns the job IN_PROGRESS under its new generation, or null when nothing is runnable.
 */
export async function claimNextJob(db: Db, options: ClaimOptions): Promise<JobRow | null> {
  return db.transaction(async (tx) => {
    const [candidate] = await tx
      .select({ id: jobs.id, taskId: jobs.taskId })
      .from(jobs)
      .innerJoin(tasks, eq(tasks.id, jobs.taskId))
      .where(
        and(
          eq(jobs.status, 'PENDING'),
          eq(tasks.status, 'PENDING'),
          // Local runs are their runner's to claim (the runner protocol), never an executor's.
          isNull(jobs.runnerId),
          sql`not exists (select 1 from jobs earlier where earlier.task_id = ${jobs.taskId} and earlier.status = 'PENDING' and earlier.seq < ${jobs.seq})`,
        ),
      )
      .orderBy(asc(jobs.seq))
      .limit(1)
      .for('update', { of: [jobs, tasks], skipLocked: true });
    if (!candidate) return null;
    const [job] = await tx
      .update(jobs)
      .set({
        status: 'IN_PROGRESS',
        generation: sql`${jobs.generation} + 1`,
        startedAt: sql`now()`,
        leaseOwner: options.owner,
        leaseExpiresAt: sql`now() + ${options.leaseMs} * interval '1 millisecond'`,
        updatedAt: sql`now()`,
      })
      .where(and(eq(jobs.id, candidate.id), eq(jobs.status, 'PENDING')))
      .returning();
    if (!job) return null;
    await updateTask(tx, candidate.taskId, { status: 'IN_PROGRESS' }, ['PENDING']);
    return job;
  });
}

/** Extends the lease of a job the caller still holds; false when it no longer does (stop working on it). */
export async function renewLease(db: Db, jobId: string, generation: number, leaseMs: number): Promise<boolean> {
  const rows = await db
    .update(jobs)
    .set({ leaseExpiresAt: sql`now() + ${leaseMs} * interval '1 millisecond'`, updatedAt: sql`now()` })
    .where(and(eq(jobs.id, jobId), eq(jobs.generation, generation), eq(jobs.status, 'IN_PROGRESS')))
    .returning({ id: jobs.id });
  return rows.length > 0;
}

export const LEASE_EXPIRED_ERROR =
  'The executor running this job stopped renewing its lease (it crashed or lost the database); the job was ' +
  'stopped. Send a follow-up message to run it again.';

/** Fails every running job whose lease has expired; returns those jobs. */
export async function failExpiredLeases(db: Db): Promise<JobRow[]> {
  const expired = await db
    .select({ id: jobs.id, generation: jobs.generation })
    .from(jobs)
    .where(and(eq(jobs.status, 'IN_PROGRESS'), lt(jobs.leaseExpiresAt, sql`now()`)));
  const failed: JobRow[] = [];
  for (const { id, generation } of expired) {
    try {
      failed.push(await finishJob(db, id, generation, { status: 'FAILED', error: LEASE_EXPIRED_ERROR }));
    } catch (error) {
      // Its executor finished it, or renewed the lease under the same generation, meanwhile.
      if (!(error instanceof StaleGenerationError)) throw error;
    }
  }
  return failed;
}
