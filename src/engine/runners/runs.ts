/**
 * Local runs from the runner's side (docs/runner-protocol.md "Local tasks and runs"): listing them with
 * their manifests, claiming one under a new generation, `syncing`, the completion receipt, wakes of
 * parked sessions, and reading controls. Every move locks the run's task, then the run — the order of
 * every task action — and checks the generation it names, so that a report from an older execution is
 * refused and two requests never both move one run.
 */
import { eq, sql } from 'drizzle-orm';
import { parseAgentId } from '../../domain/agents.js';
import { ConflictError, NotFoundError } from '../../domain/errors.js';
import { runStateOf } from '../../domain/runners.js';
import { taskStatesInto } from '../../domain/states.js';
import type { JobStatus, JobType, TaskMode } from '../../protocol/rest.js';
import { RUNNER_LIMITS, type CompleteBody, type Control, type RunManifest, type RunStatusResponse, type WakeResponse } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { bumpWorkVersion, lockRunner, touchRunner, type RunnerRow } from '../../store/runners.js';
import {
  clearPendingPermissions,
  controlsAfter,
  countHeldRuns,
  dropEventPartsOfJob,
  executingOnRunner,
  findMessage,
  findRunnerRun,
  heldByRunner,
  listRunnerRuns,
  lockRunnerRun,
  storedEventCount,
  storedEventCounts,
  taskHasEarlierWork,
  taskThreads,
  type ControlRow,
  type MessageRow,
} from '../../store/runs.js';
import { jobs, tasks } from '../../store/schema.js';
import { findLatestJob, insertJob, updateTask, type JobRow, type TaskRow } from '../../store/tasks.js';
import { finishLockedJob, type JobResult } from '../jobs.js';

export const RUN_NOT_FOUND = 'Run not found';
/** The input of a run that resumes a parked CLI: a marker; nothing is sent to the CLI. */
export const RESUME_PARKED_INPUT = '[resume the parked session]';

const iso = (date: Date): string => date.toISOString();

/** A run as its runner sees it: everything to execute it, nothing of the server's. */
function manifestOf(job: JobRow, task: TaskRow, thread: readonly MessageRow[], eventsStored: number): RunManifest {
  const own = job.messageId ? thread.find((message) => message.id === job.messageId) : undefined;
  const earlier = own ? thread.filter((message) => message.seq < own.seq) : thread;
  const agent = parseAgentId(job.agent ?? task.agent);
  const [harness, model] = 'error' in agent ? [job.agentProvider ?? 'unknown', job.agent ?? task.agent] : [agent.provider, agent.model];
  return {
    runId: job.id,
    taskId: task.id,
    taskSlug: task.slug,
    title: task.title,
    state: runStateOf(job.status as JobStatus, job.runnerState),
    generation: job.generation,
    type: job.type as JobType,
    mode: task.mode as TaskMode,
    projectId: task.projectId ?? '00000000-0000-0000-0000-000000000000',
    harness,
    model,
    effort: (job.effort ?? task.effort) as RunManifest['effort'],
    permissionMode: (task.permissionMode ?? 'ask') as RunManifest['permissionMode'],
    nativeMode: own?.metadata?.nativeMode ?? (task.nativeMode as RunManifest['nativeMode']) ?? null,
    input: job.input ?? '',
    metadata: own?.metadata ?? null,
    history: earlier.map((message) => ({ role: message.role === 'agent' ? ('assistant' as const) : ('user' as const), content: message.body })),
    sessionId: task.sessionId,
    resumeParked: job.resumeParked,
    eventsStored,
    createdAt: iso(job.createdAt),
  };
}

/** The manifests of runs, with one query for all their threads and one for all their journals' counts. */
async function manifestsOf(db: Db, rows: ReadonlyArray<{ job: JobRow; task: TaskRow }>): Promise<RunManifest[]> {
  const [threads, counts] = await Promise.all([taskThreads(db, rows.map(({ task }) => task.id)), storedEventCounts(db, rows.map(({ job }) => job.id))]);
  return rows.map(({ job, task }) => manifestOf(job, task, threads.get(task.id) ?? [], counts.get(job.id) ?? 0));
}

/**
 * The runner's runs and its work version: every run it holds, then queued runs oldest first, at most
 * RUNNER_LIMITS.listedRuns in all. The rest shows as runs end: every receipt (and every new run) moves the
 * work version, so the runner lists again.
 *
 * The version is the one read when the runner was authenticated, before the runs: a change in between
 * shows in the runs and moves the version past the one answered, so the runner lists again rather than
 * miss it.
 */
export async function listRuns(db: Db, runner: RunnerRow): Promise<{ runs: RunManifest[]; version: string }> {
  await touchRunner(db, runner.id);
  const rows = await listRunnerRuns(db, runner.id, RUNNER_LIMITS.listedRuns);
  return { runs: await manifestsOf(db, rows), version: String(runner.workVersion) };
}

/** Refuses a request that names a generation other than the run's current one. */
function checkGeneration(job: JobRow, generation: number): void {
  if (job.generation !== generation) {
    throw new ConflictError(`generation ${generation} no longer holds this run (it is at ${job.generation})`, { generation: job.generation });
  }
}

/**
 * Claims a queued run (the task's turn: nothing of it runs, nothing older waits; and the runner holds
 * fewer than RUNNER_LIMITS.listedRuns runs), or claims again an executing run of this runner (a restarted
 * runner whose process died): a new generation either way, and whatever parts an older generation staged
 * are dropped. A syncing run must not start again; a finished or cancelled one cannot be claimed.
 */
export async function claimRun(db: Db, runner: RunnerRow, runId: string): Promise<RunManifest> {
  const claimed = await db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { job, task } = locked;
    if (job.status === 'PENDING') {
      if (await taskHasEarlierWork(tx, job)) throw new ConflictError('an earlier run of this task has not finished yet');
      // Held runs are always listed (GET /runs): their number is bounded here, so that the list is. Counted
      // under the runner's row (after the task and job: the lock order of store/runs.ts), so that two claims
      // of other tasks cannot both take the last place.
      await lockRunner(tx, runner.id);
      if ((await countHeldRuns(tx, runner.id)) >= RUNNER_LIMITS.listedRuns) {
        throw new ConflictError(`this runner holds ${RUNNER_LIMITS.listedRuns} runs already: send a receipt before claiming another`);
      }
    } else if (!executingOnRunner(job)) {
      const state = runStateOf(job.status as JobStatus, job.runnerState);
      throw new ConflictError(state === 'syncing' ? 'the run is syncing: it may not start again' : `the run is ${state}; it cannot be claimed`, { state });
    }
    const [updated] = await tx
      .update(jobs)
      .set({
        status: 'IN_PROGRESS',
        runnerState: 'executing',
        generation: sql`${jobs.generation} + 1`,
        startedAt: sql`coalesce(${jobs.startedAt}, now())`,
        updatedAt: sql`now()`,
      })
      .where(eq(jobs.id, job.id))
      .returning();
    await dropEventPartsOfJob(tx, job.id);
    if (job.status === 'PENDING') await updateTask(tx, task.id, { status: 'IN_PROGRESS' }, taskStatesInto('IN_PROGRESS'));
    return { job: updated!, task };
  });
  return (await manifestsOf(db, [claimed]))[0]!;
}

function statusOf(job: JobRow): RunStatusResponse {
  return { runId: job.id, state: runStateOf(job.status as JobStatus, job.runnerState), status: job.status as JobStatus, generation: job.generation };
}

/**
 * The run's process group stopped and its output is pending: `syncing`. Pending permission prompts are
 * cleared; the claim stays. Idempotent.
 */
export async function markSyncing(db: Db, runner: RunnerRow, runId: string, generation: number): Promise<RunStatusResponse> {
  return db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { job } = locked;
    checkGeneration(job, generation);
    if (!heldByRunner(job)) throw new ConflictError(`the run is ${runStateOf(job.status as JobStatus, job.runnerState)}; it is not executing`);
    if (job.runnerState === 'syncing') return statusOf(job);
    const [updated] = await tx.update(jobs).set({ runnerState: 'syncing', updatedAt: sql`now()` }).where(eq(jobs.id, job.id)).returning();
    await clearPendingPermissions(tx, job.id);
    return statusOf(updated!);
  });
}

/** What the runner's outcome makes of the job (see docs/runner-protocol.md, the completion receipt). */
function resultOf(outcome: CompleteBody['outcome'], nativeMode: string | null): JobResult {
  switch (outcome.status) {
    case 'completed':
      if (outcome.question) return { status: 'COMPLETED', finalAnswer: outcome.question, awaitingInput: true };
      if (outcome.plan) return { status: 'COMPLETED', plan: outcome.plan, planOutcome: outcome.planOutcome ?? (nativeMode === 'plan' ? 'NATIVE' : 'READY') };
      return { status: 'COMPLETED', finalAnswer: outcome.finalAnswer ?? '' };
    case 'failed':
      return { status: 'FAILED', error: outcome.error ?? 'the runner reported the run failed' };
    case 'cancelled':
      // The task was not cancelled here: the run was stopped on the computer.
      return { status: 'FAILED', error: outcome.error ?? 'the run was stopped on the computer' };
  }
}

/**
 * The completion receipt: accepted once every event is delivered (the journal holds exactly
 * `lastSequence`) and the process group has stopped. It ends the job as a cloud job ends and lets the
 * task's next run execute. A receipt repeated after it was accepted gets the same answer.
 */
export async function completeRun(db: Db, runner: RunnerRow, runId: string, body: CompleteBody): Promise<RunStatusResponse> {
  return db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { job, task } = locked;
    checkGeneration(job, body.generation);
    if (!heldByRunner(job)) {
      // Received already (or the run was finalized, by a reconnect say): the same answer again.
      if (job.status === 'COMPLETED' || job.status === 'FAILED' || job.status === 'CANCELLED') return statusOf(job);
      throw new ConflictError('the run was never claimed');
    }
    const stored = await storedEventCount(tx, job.id);
    if (stored !== body.lastSequence) {
      throw new ConflictError(`the journal holds ${stored} events of this run, not ${body.lastSequence}: deliver every event before the receipt`, {
        expectedSequence: stored + 1,
      });
    }
    const sessionId = body.outcome.sessionId ?? task.sessionId;
    if (sessionId !== task.sessionId) await tx.update(tasks).set({ sessionId }).where(eq(tasks.id, task.id));
    let ended: JobRow;
    if (job.status === 'CANCELLED') {
      const [updated] = await tx.update(jobs).set({ runnerState: null, updatedAt: sql`now()` }).where(eq(jobs.id, job.id)).returning();
      ended = updated!;
    } else {
      const message = job.messageId ? await findMessage(tx, job.messageId) : null;
      const nativeMode = body.outcome.nativeMode ?? message?.metadata?.nativeMode ?? task.nativeMode;
      ended = await finishLockedJob(tx, job, resultOf(body.outcome, nativeMode), { runnerState: null, parked: body.outcome.parked ?? false });
    }
    await dropEventPartsOfJob(tx, job.id);
    await bumpWorkVersion(tx, runner.id);
    return statusOf(ended);
  });
}

/**
 * A parked CLI started a turn by itself: queue a run that resumes it (`resumeParked`, a marker input)
 * when the run that parked it is still the task's latest and nothing of the task is queued or runs. A
 * wake never queues behind a running job: `retry` says whether asking again later may succeed.
 */
export async function wakeRun(db: Db, runner: RunnerRow, runId: string, body: { generation: number }): Promise<WakeResponse> {
  return db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { job, task } = locked;
    if (job.generation !== body.generation) return { started: false, reason: `generation ${body.generation} no longer holds this run`, retry: false };
    if (task.status === 'CANCELLED') return { started: false, reason: 'the task was cancelled', retry: false };
    const latest = await findLatestJob(tx, task.id);
    if (latest && latest.id !== job.id) {
      // A cancelled run its runner still holds (no receipt yet) is still at work in the task's folder.
      const busy = latest.status === 'PENDING' || latest.status === 'IN_PROGRESS' || heldByRunner(latest);
      return { started: false, reason: busy ? 'another run of the task is queued, executing or still held by the runner' : 'a later run of the task replaced this session', retry: busy };
    }
    if (job.status !== 'COMPLETED' || !job.parked) return { started: false, reason: 'this run did not park its session', retry: false };
    await tx.update(jobs).set({ parked: false, updatedAt: sql`now()` }).where(eq(jobs.id, job.id));
    const woken = await insertJob(tx, {
      taskId: task.id,
      workspaceId: task.workspaceId,
      status: 'PENDING',
      type: job.type,
      agent: job.agent,
      agentProvider: job.agentProvider,
      effort: job.effort,
      input: RESUME_PARKED_INPUT,
      runnerId: runner.id,
      resumeParked: true,
    });
    await updateTask(tx, task.id, { status: 'PENDING' }, taskStatesInto('PENDING'));
    await bumpWorkVersion(tx, runner.id);
    return { started: true, jobId: woken.id };
  });
}

export function presentControl(row: ControlRow): Control {
  return { runId: row.jobId, sequence: row.sequence, message: row.message as Control['message'] };
}

/** The legacy control poll (runners that predate signals). */
export async function readControls(db: Db, runner: RunnerRow, runId: string, after: number): Promise<Control[]> {
  if (!(await findRunnerRun(db, runner.id, runId))) throw new NotFoundError(RUN_NOT_FOUND);
  await touchRunner(db, runner.id);
  return (await controlsAfter(db, [{ runId, after }])).map(presentControl);
}
