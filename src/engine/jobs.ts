/**
 * Job lifecycle moves used by executors: start (claim) and finish. Every move is a conditional UPDATE on
 * the job's status and generation, so a report from an executor that lost the job is refused.
 */
import { and, eq, sql } from 'drizzle-orm';
import { ConflictError } from '../domain/errors.js';
import { jobStatesInto, taskStatusAfterJob, taskStatesInto } from '../domain/states.js';
import type { PlanOutcome } from '../protocol/rest.js';
import { notify, type Db } from '../store/db.js';
import { EVENTS_CHANNEL } from '../store/journal.js';
import { jobs, pullRequests, tasks } from '../store/schema.js';
import { countJobs, updateJob, updateTask, type JobRow } from '../store/tasks.js';

/**
 * Locks the task of a job, then the job: the same order as every task action (cancel, follow-up,
 * approve), so that an executor's move and a person's action never deadlock, and a follow-up queued
 * while a job ends is seen by it.
 */
async function lockJobAndTask(tx: Db, jobId: string) {
  const [owner] = await tx.select({ taskId: jobs.taskId }).from(jobs).where(eq(jobs.id, jobId));
  if (!owner) return null;
  await tx.select({ id: tasks.id }).from(tasks).where(eq(tasks.id, owner.taskId)).for('update');
  const [job] = await tx.select().from(jobs).where(eq(jobs.id, jobId)).for('update');
  return job ?? null;
}

/** Moves a PENDING job to IN_PROGRESS under a new generation; null when it was not pending. */
export async function startJob(db: Db, jobId: string): Promise<JobRow | null> {
  return db.transaction(async (tx) => {
    const current = await lockJobAndTask(tx, jobId);
    if (!current || current.status !== 'PENDING') return null;
    const [job] = await tx
      .update(jobs)
      .set({ status: 'IN_PROGRESS', generation: sql`${jobs.generation} + 1`, startedAt: sql`now()`, updatedAt: sql`now()` })
      .where(and(eq(jobs.id, jobId), eq(jobs.status, 'PENDING')))
      .returning();
    if (!job) return null;
    await updateTask(tx, job.taskId, { status: 'IN_PROGRESS' }, taskStatesInto('IN_PROGRESS'));
    return job;
  });
}

export interface JobResult {
  status: 'COMPLETED' | 'FAILED';
  finalAnswer?: string | null;
  plan?: string | null;
  planOutcome?: PlanOutcome | null;
  error?: string | null;
  /** The agent asked a clarifying question (in finalAnswer) and waits for a reply. */
  awaitingInput?: boolean;
}

export class StaleGenerationError extends ConflictError {
  constructor(jobId: string, generation: number) {
    super(`job ${jobId} is no longer held by generation ${generation}`);
    this.name = 'StaleGenerationError';
  }
}

/** Ends an IN_PROGRESS job held by `generation` and moves its task on. */
export async function finishJob(db: Db, jobId: string, generation: number, result: JobResult): Promise<JobRow> {
  return db.transaction(async (tx) => {
    const current = await lockJobAndTask(tx, jobId);
    if (!current || current.generation !== generation) throw new StaleGenerationError(jobId, generation);
    return finishLockedJob(tx, current, result);
  });
}

/**
 * finishJob's move for a job whose task and row the caller has locked (in that order) and whose
 * generation it checked: the runner's completion receipt ends its run this way.
 */
export async function finishLockedJob(tx: Db, current: JobRow, result: JobResult, extra: Partial<Pick<JobRow, 'runnerState' | 'parked'>> = {}): Promise<JobRow> {
  const job = await updateJob(
    tx,
    current.id,
    {
      status: result.status,
      finalAnswer: result.finalAnswer ?? null,
      plan: result.plan ?? null,
      planOutcome: result.planOutcome ?? null,
      error: result.error ?? null,
      completedAt: new Date(),
      ...extra,
    },
    jobStatesInto(result.status).filter((from) => from === 'IN_PROGRESS'),
  );
  if (!job) throw new StaleGenerationError(current.id, current.generation);
  const [open] = await tx
    .select({ n: sql<number>`count(*)::int` })
    .from(pullRequests)
    .where(and(eq(pullRequests.taskId, job.taskId), eq(pullRequests.state, 'open')));
  const next = taskStatusAfterJob({
    status: result.status,
    planReady: result.planOutcome === 'READY',
    awaitingInput: result.awaitingInput ?? false,
    hasOpenPullRequests: (open?.n ?? 0) > 0,
    moreQueued: (await countJobs(tx, job.taskId, ['PENDING'])) > 0,
  });
  // A task cancelled meanwhile stays cancelled: the move is conditional on the task still running.
  await updateTask(tx, job.taskId, { status: next }, ['IN_PROGRESS']);
  // Log streams that follow the task learn that it may have gone idle.
  await notify(tx, EVENTS_CHANNEL, job.taskId);
  return job;
}

/**
 * Throws StaleGenerationError unless the job still runs under `generation`: checked before a job's side
 * effects (a push, a pull request), so a cancelled job or one whose lease another executor expired does
 * nothing more. With `lock`, the job row stays locked for the rest of the transaction.
 */
export async function assertJobHeld(db: Db, jobId: string, generation: number, lock = false): Promise<void> {
  const query = db
    .select({ id: jobs.id })
    .from(jobs)
    .where(and(eq(jobs.id, jobId), eq(jobs.generation, generation), eq(jobs.status, 'IN_PROGRESS')));
  const [held] = lock ? await query.for('update') : await query;
  if (!held) throw new StaleGenerationError(jobId, generation);
}
