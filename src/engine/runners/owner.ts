/**
 * The owner's side of local work (docs/runner-protocol.md "Questions and permissions", "Review
 * requests"): answering what a run asks, and asking the runner for a file. Only the runner's owner gets
 * here: local tasks are invisible to everyone else (store/tasks.ts), so anyone else gets 404.
 */
import { randomUUID } from 'node:crypto';
import { eq } from 'drizzle-orm';
import { ConflictError, NotFoundError, taskNotFound, ValidationError } from '../../domain/errors.js';
import type { ValidationIssue } from '../../protocol/errors.js';
import {
  RUNNER_LIMITS,
  type Capabilities,
  type LocalRequest,
  type PermissionAnswerBody,
  type Question,
  type ReviewAnswerBody,
  type ReviewRequest,
} from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { findRunner, wakeRunner, type RunnerRow } from '../../store/runners.js';
import {
  answerLocalRequest,
  answerReviewRequest,
  executingOnRunner,
  findLocalRequest,
  findReviewRequest,
  insertControl,
  insertReviewRequest,
  listLocalRequests,
  pendingReviewRequests,
  type LocalRequestRow,
  type ReviewRequestRow,
} from '../../store/runs.js';
import { jobs } from '../../store/schema.js';
import { findLatestJob, lockTask, readTaskView, type TaskRow, type TaskScope } from '../../store/tasks.js';
import { queueFollowUp } from '../tasks.js';

export const REQUEST_NOT_FOUND = 'Request not found';
export const REVIEW_REQUEST_NOT_FOUND = 'Review request not found';

/** The owner, as the session names them (user and the workspace the request acts in). */
export interface Owner extends TaskScope {
  userId: string;
}

export function presentLocalRequest(row: LocalRequestRow): LocalRequest {
  const payload = row.payload as { questions?: Question[] };
  return {
    requestId: row.requestId,
    runId: row.jobId,
    kind: row.kind,
    status: row.status,
    tool: row.tool,
    questions: payload.questions ?? [],
    createdAt: row.createdAt.toISOString(),
  };
}

/** A local task of the owner, locked; 404 for anything else (cloud tasks included). */
async function lockLocalTask(tx: Db, owner: Owner, idOrSlug: string): Promise<TaskRow & { runnerId: string }> {
  const task = await lockTask(tx, owner, idOrSlug);
  if (!task?.runnerId) throw taskNotFound();
  return task as TaskRow & { runnerId: string };
}

export async function listRequests(db: Db, owner: Owner, idOrSlug: string): Promise<LocalRequest[]> {
  const view = await readTaskView(db, owner, idOrSlug);
  if (!view?.task.runnerId) throw taskNotFound();
  return (await listLocalRequests(db, view.task.id)).map(presentLocalRequest);
}

/**
 * Checks answers against their questions: every question answered, with one value unless `multiple`,
 * each an option's label unless `allowCustom`; no answers for questions that were not asked.
 */
export function answerIssues(questions: readonly Question[], answers: PermissionAnswerBody['answers']): ValidationIssue[] {
  const issues: ValidationIssue[] = [];
  const given = new Map((answers ?? []).map((answer) => [answer.questionId, answer.values]));
  for (const [questionId] of given) {
    if (!questions.some((question) => question.id === questionId)) issues.push({ field: 'answers', message: `no question ${questionId} was asked` });
  }
  for (const question of questions) {
    const values = given.get(question.id);
    if (!values) {
      issues.push({ field: 'answers', message: `question ${question.id} needs an answer` });
      continue;
    }
    if (!question.multiple && values.length !== 1) issues.push({ field: 'answers', message: `question ${question.id} takes one answer` });
    const labels = new Set(question.options.map((option) => option.label));
    for (const value of values) {
      if (!labels.has(value) && !question.allowCustom) issues.push({ field: 'answers', message: `"${value}" is not an option of question ${question.id}` });
    }
  }
  return issues;
}

/**
 * Answers a permission (or a question asked through one): a valid answer becomes the run's next
 * `permission` control; an invalid one is refused and the request stays pending.
 */
export async function answerPermission(db: Db, owner: Owner, idOrSlug: string, requestId: string, body: PermissionAnswerBody): Promise<LocalRequest> {
  return db.transaction(async (tx) => {
    const task = await lockLocalTask(tx, owner, idOrSlug);
    const request = await findLocalRequest(tx, task.id, requestId, true);
    if (!request) throw new NotFoundError(REQUEST_NOT_FOUND);
    if (request.kind === 'async_question') throw new ConflictError('This is an async question: answer it with POST …/questions/{requestId}');
    if (request.status !== 'pending') throw new ConflictError(`The request is ${request.status}`, { status: request.status });
    const questions = (request.payload as { questions?: Question[] }).questions ?? [];
    if (body.decision === 'deny' && body.answers !== undefined) throw ValidationError.field('answers', 'a denial takes no answers');
    if (body.decision === 'allow') {
      if (request.kind === 'question') {
        const issues = answerIssues(questions, body.answers);
        if (issues.length > 0) throw new ValidationError(issues);
      } else if (body.answers !== undefined) {
        throw ValidationError.field('answers', 'an ordinary permission takes no answers');
      }
    }
    const [job] = await tx.select().from(jobs).where(eq(jobs.id, request.jobId)).for('update');
    if (!job || !executingOnRunner(job)) throw new ConflictError('The run that asked has stopped; the request was cleared');
    const message = { type: 'permission', requestId, decision: body.decision, ...(body.answers ? { answers: body.answers } : {}) };
    await insertControl(tx, task.runnerId, job.id, message);
    await answerLocalRequest(tx, request.id, message, owner.userId);
    return presentLocalRequest({ ...request, status: 'answered' });
  });
}

/**
 * Whether an answer that cannot reach its run becomes a follow-up of the task: not for a cancelled task,
 * since an answer never restarts work its owner stopped (a message does). The same rule holds when the
 * owner answers and when a runner reports that it could not deliver the answer.
 */
export function answerRestartsTask(task: TaskRow): boolean {
  return task.status !== 'CANCELLED';
}

/**
 * Answers an async question: a runner whose harness takes async answers gets an `async_question_answer`
 * control for the run that asked (if it still executes); otherwise the answer is a normal follow-up
 * (refused for a cancelled task, answerRestartsTask: the request stays pending).
 */
export async function answerAsyncQuestion(db: Db, owner: Owner, idOrSlug: string, requestId: string, text: string): Promise<LocalRequest> {
  return db.transaction(async (tx) => {
    const task = await lockLocalTask(tx, owner, idOrSlug);
    const request = await findLocalRequest(tx, task.id, requestId, true);
    if (!request) throw new NotFoundError(REQUEST_NOT_FOUND);
    if (request.kind !== 'async_question') throw new ConflictError('This request pauses its run: answer it with POST …/permissions/{requestId}');
    if (request.status !== 'pending') throw new ConflictError(`The request is ${request.status}`, { status: request.status });
    const [job] = await tx.select().from(jobs).where(eq(jobs.id, request.jobId)).for('update');
    const runner = await findRunner(tx, task.runnerId);
    const takesAnswers = job?.agentProvider ? (runner?.capabilities as Capabilities | undefined)?.nativeControls?.[job.agentProvider]?.asyncQuestions === true : false;
    const id = randomUUID();
    if (job && takesAnswers && executingOnRunner(job)) {
      await insertControl(tx, task.runnerId, job.id, { type: 'async_question_answer', id, requestId, text });
      await answerLocalRequest(tx, request.id, { id, text, via: 'control' }, owner.userId);
    } else {
      if (!answerRestartsTask(task)) throw new ConflictError('The task was cancelled: send a message to continue it', { status: task.status });
      await queueFollowUp(tx, task, { body: text, userIntent: null });
      await answerLocalRequest(tx, request.id, { id, text, via: 'follow-up' }, owner.userId);
    }
    return presentLocalRequest({ ...request, status: 'answered' });
  });
}

export function presentReviewRequest(row: ReviewRequestRow): ReviewRequest {
  return { id: row.id, runId: row.jobId, taskId: row.taskId, path: row.path, createdAt: row.createdAt.toISOString() };
}

export function presentReviewDetail(row: ReviewRequestRow) {
  return {
    id: row.id,
    path: row.path,
    status: row.status,
    content: row.content ? row.content.toString('base64') : null,
    message: row.message,
    createdAt: row.createdAt.toISOString(),
    answeredAt: row.answeredAt ? row.answeredAt.toISOString() : null,
  };
}

/** A relative path inside the task's worktree: no absolute paths, no `..`. */
function checkedPath(path: string): string {
  const normalized = path.replace(/\\/g, '/').replace(/^\.\//, '');
  if (normalized.startsWith('/') || /^[A-Za-z]:/.test(normalized) || normalized.split('/').includes('..') || normalized.includes('\0')) {
    throw ValidationError.field('path', 'must be a relative path inside the task');
  }
  return normalized;
}

/** The owner asks the runner for a file of a local task (its browser cannot reach the computer). */
export async function createReviewRequest(db: Db, owner: Owner, idOrSlug: string, path: string) {
  return db.transaction(async (tx) => {
    const task = await lockLocalTask(tx, owner, idOrSlug);
    const latest = await findLatestJob(tx, task.id);
    const row = await insertReviewRequest(tx, { runnerId: task.runnerId, taskId: task.id, jobId: latest?.id ?? null, path: checkedPath(path), createdByUserId: owner.userId });
    await wakeRunner(tx, task.runnerId);
    return presentReviewDetail(row);
  });
}

export async function getReviewRequest(db: Db, owner: Owner, idOrSlug: string, id: string) {
  const view = await readTaskView(db, owner, idOrSlug);
  if (!view?.task.runnerId) throw taskNotFound();
  const row = await findReviewRequest(db, id);
  if (!row || row.taskId !== view.task.id) throw new NotFoundError(REVIEW_REQUEST_NOT_FOUND);
  return presentReviewDetail(row);
}

/** The legacy poll of review requests (runners that predate signals). */
export async function listReviewRequests(db: Db, runner: RunnerRow): Promise<ReviewRequest[]> {
  return (await pendingReviewRequests(db, runner.id)).map(presentReviewRequest);
}

/** A base64 field decoded; anything else is a 400 naming `field`. */
export function decodeBase64(value: string, field: string): Buffer {
  if (!/^[A-Za-z0-9+/]*={0,2}$/.test(value) || value.length % 4 !== 0) throw ValidationError.field(field, 'must be base64');
  return Buffer.from(value, 'base64');
}

/** The runner answers a review request with the file (base64) or why it could not. */
export async function answerReview(db: Db, runner: RunnerRow, id: string, body: ReviewAnswerBody): Promise<void> {
  let content: Buffer | null = null;
  if (body.status === 'ok') {
    if (body.content === undefined) throw ValidationError.field('content', 'is required with status ok');
    content = decodeBase64(body.content, 'content');
    if (content.length > RUNNER_LIMITS.reviewAnswerBytes) throw ValidationError.field('content', `holds at most ${RUNNER_LIMITS.reviewAnswerBytes} bytes`);
  }
  await db.transaction(async (tx) => {
    const row = await findReviewRequest(tx, id);
    if (!row || row.runnerId !== runner.id) throw new NotFoundError(REVIEW_REQUEST_NOT_FOUND);
    const answered = await answerReviewRequest(tx, id, runner.id, { status: body.status === 'ok' ? 'answered' : 'failed', content, message: body.message ?? null });
    if (!answered) throw new ConflictError(`The review request is ${row.status}`);
  });
}

