/**
 * The task service: every task action of the REST API (and later of the CLI, integrations and the
 * scheduler) goes through here. Rules come from domain/, rows from store/; each action that changes a
 * task runs in one transaction holding that task's row lock.
 */
import { AppError, ConflictError, taskNotFound, ValidationError } from '../domain/errors.js';
import { effortError, jobTypeOfMode, modeOfIntent, parseAgentId, type AgentId } from '../domain/agents.js';
import { blobFilesError, parseFiles, type ParsedFile } from '../domain/files.js';
import { splitTrigger } from '../domain/routing.js';
import { makeSlug, titleFromMessage } from '../domain/slugs.js';
import { ACTIVE_JOB_STATUSES, TASK_ACTION_FROM, taskStatesInto } from '../domain/states.js';
import { decodeCursor, encodeCursor } from '../domain/cursor.js';
import type {
  LocalTarget,
  MessageMetadata,
  CreateTaskBody,
  Effort,
  JobType,
  ListJobsQuery,
  ListTasksQuery,
  SendMessageBody,
  TaskMode,
  TaskStatus,
  ApprovePlanBody,
} from '../protocol/rest.js';
import { TaskStatus as TaskStatusSchema } from '../protocol/rest.js';
import type { ValidationIssue } from '../protocol/errors.js';
import { notify, type Db } from '../store/db.js';
import { bumpWorkVersion } from '../store/runners.js';
import { resolveLocalTarget } from './runners/enrollment.js';
import { localJobQueued } from './runners/queue.js';
import { EVENTS_CHANNEL } from '../store/journal.js';
import { findRoutingConfigs } from '../store/routing.js';
import {
  cancelActiveJobs,
  findLatestJob,
  findTaskView,
  insertJob,
  insertMessage,
  insertTask,
  listJobs,
  listTasks,
  lockTask,
  readTaskView,
  updateJob,
  updateTask,
  type JobRow,
  type TaskListRow,
  type TaskRow,
  type TaskView,
} from '../store/tasks.js';

/** Who acts, and in which workspace: a workspace API key (`keyId`) or a signed-in user (`userId`). */
export interface Caller {
  workspaceId: string;
  keyId: string | null;
  userId: string | null;
}

export interface TaskAndJobRows {
  view: TaskView;
  job: JobRow;
}

function checkAgent(value: string, field: string, issues: ValidationIssue[]): AgentId | null {
  const parsed = parseAgentId(value);
  if ('error' in parsed) {
    issues.push({ field, message: parsed.error });
    return null;
  }
  return parsed;
}

function requireText(value: string, field: string, issues: ValidationIssue[]): void {
  if (value.trim().length === 0) issues.push({ field, message: 'must not be empty' });
}

function throwIfIssues(issues: ValidationIssue[]): void {
  if (issues.length > 0) throw new ValidationError(issues);
}

async function reload(db: Db, caller: Caller, taskId: string): Promise<TaskView> {
  const view = await findTaskView(db, caller, taskId);
  if (!view) throw taskNotFound();
  return view;
}

export async function createTask(db: Db, caller: Caller, body: CreateTaskBody): Promise<TaskAndJobRows> {
  const issues: ValidationIssue[] = [];
  requireText(body.command, 'command', issues);
  const pinned = body.agent === undefined ? null : checkAgent(body.agent, 'agent', issues);
  const { files, issues: fileIssues } = parseFiles(body.files);
  issues.push(...fileIssues);
  throwIfIssues(issues);

  const { trigger, rest } = splitTrigger(body.command);
  const { matched, fallback } = await findRoutingConfigs(db, caller.workspaceId, trigger);
  const config = matched ?? fallback;
  if (!config) throw new AppError('internal_error', undefined, { cause: new Error('workspace has no default routing config') });
  // An unknown `/word` is not a trigger: the message stays as written.
  const input = matched ? rest : body.command;
  if (matched && input.trim().length === 0) {
    throw ValidationError.field('command', `has nothing after the trigger /${matched.name}`);
  }

  const mode: TaskMode = body.userIntent ? modeOfIntent(body.userIntent) : (config.mode as TaskMode);
  const agentId = body.agent ?? config.agent;
  const configured = parseAgentId(agentId);
  if ('error' in configured) {
    throw new AppError('internal_error', undefined, { cause: new Error(`routing config ${config.name} has an invalid agent: ${configured.error}`) });
  }
  const agent = pinned ?? configured;
  const effort = (body.effort ?? config.effort) as Effort;
  const effortProblem = effortError(effort, agent);
  if (effortProblem) throw ValidationError.field(body.effort ? 'effort' : 'agent', effortProblem);

  const blobError = blobFilesError(files);
  const title = body.title ?? titleFromMessage(input);
  const local = body.local ? await localTargetOf(db, caller, body.local, agent) : null;

  return db.transaction(async (tx) => {
    const task = await insertTask(
      tx,
      {
        workspaceId: caller.workspaceId,
        title,
        status: blobError ? 'FAILED' : 'PENDING',
        mode,
        agent: agentId,
        effort,
        createdByKeyId: caller.keyId,
        createdByUserId: caller.userId,
        ...local,
      },
      () => makeSlug(title),
    );
    const message = await insertMessage(tx, {
      taskId: task.id,
      role: 'user',
      body: body.command,
      userIntent: body.userIntent ?? null,
      files,
    });
    const job = await insertJob(tx, {
      taskId: task.id,
      workspaceId: caller.workspaceId,
      messageId: message.id,
      status: blobError ? 'FAILED' : 'PENDING',
      type: jobTypeOfMode(mode),
      agent: agentId,
      agentProvider: agent.provider,
      effort,
      input,
      // Local workers apply no custom system prompt (SPEC.md): routing instructions are for the cloud.
      instructions: task.runnerId ? null : config.instructions,
      error: blobError,
      completedAt: blobError ? new Date() : null,
      runnerId: task.runnerId,
    });
    await localJobQueued(tx, task, job);
    return { view: await reload(tx, caller, task.id), job };
  });
}

/**
 * A local target as the task row keeps it, once checked: only a signed-in user starts local work, on a
 * runner of theirs that works for the workspace the request acts in, in one of its projects, with a
 * harness and model its catalog offers.
 */
async function localTargetOf(db: Db, caller: Caller, target: LocalTarget, agent: AgentId) {
  if (!caller.userId || caller.keyId) {
    throw new AppError('forbidden', 'Local work can only be started by a signed-in user; workspace API keys cannot start it');
  }
  const { runner } = await resolveLocalTarget(db, { userId: caller.userId, runnerId: target.runnerId, projectId: target.projectId, agent });
  if (runner.workspaceId !== caller.workspaceId) {
    throw ValidationError.field('local.runnerId', `the runner works for workspace ${runner.workspaceId}; send X-Svc-Workspace: ${runner.workspaceId}`);
  }
  return { runnerId: runner.id, projectId: target.projectId, permissionMode: target.permissionMode, nativeMode: target.nativeMode ?? null };
}

export async function getTask(db: Db, caller: Caller, idOrSlug: string): Promise<TaskView> {
  const view = await readTaskView(db, caller, idOrSlug);
  if (!view) throw taskNotFound();
  return view;
}

function parseStatuses(value: string | undefined): TaskStatus[] | null {
  if (value === undefined) return null;
  const parts = value.split(',').map((part) => part.trim().toUpperCase()).filter(Boolean);
  const unknown = parts.filter((part) => !TaskStatusSchema.safeParse(part).success);
  if (parts.length === 0 || unknown.length > 0) {
    throw new ValidationError(
      [{ field: 'status', message: `must be one or more of ${TaskStatusSchema.options.join(', ')} separated by commas` }],
      'Invalid query parameters',
    );
  }
  return parts as TaskStatus[];
}

export async function listWorkspaceTasks(
  db: Db,
  caller: Caller,
  query: ListTasksQuery,
): Promise<{ rows: TaskListRow[]; nextCursor: string | null }> {
  const statuses = parseStatuses(query.status);
  const beforeSeq = decodeCursor('tasks', query.cursor);
  const { rows, hasMore } = await listTasks(db, caller, {
    limit: query.limit,
    beforeSeq,
    statuses,
    archived: query.archived,
  });
  const last = rows[rows.length - 1];
  return { rows, nextCursor: hasMore && last ? encodeCursor('tasks', last.task.seq) : null };
}

export async function listTaskJobs(
  db: Db,
  caller: Caller,
  idOrSlug: string,
  query: ListJobsQuery,
): Promise<{ rows: JobRow[]; nextCursor: string | null }> {
  const beforeSeq = decodeCursor('jobs', query.cursor);
  const view = await readTaskView(db, caller, idOrSlug);
  if (!view) throw taskNotFound();
  const { rows, hasMore } = await listJobs(db, view.task.id, { limit: query.limit, beforeSeq });
  const oldest = rows[0];
  return { rows, nextCursor: hasMore && oldest ? encodeCursor('jobs', oldest.seq) : null };
}

/** Runs `action` with the task locked; 404 when the caller's workspace has no such task. */
async function withLockedTask<T>(db: Db, caller: Caller, idOrSlug: string, action: (tx: Db, task: TaskRow) => Promise<T>): Promise<T> {
  return db.transaction(async (tx) => {
    const task = await lockTask(tx, caller, idOrSlug);
    if (!task) throw taskNotFound();
    return action(tx, task);
  });
}

/** The run type a follow-up gets: the switch it asks for, or the task's own mode (SPEC "Routing" rule 3). */
function followUpType(task: TaskRow, intent: SendMessageBody['userIntent']): JobType {
  return intent ? jobTypeOfMode(modeOfIntent(intent)) : jobTypeOfMode(task.mode as TaskMode);
}

export async function sendMessage(db: Db, caller: Caller, idOrSlug: string, body: SendMessageBody): Promise<TaskAndJobRows> {
  const issues: ValidationIssue[] = [];
  requireText(body.message, 'message', issues);
  const { files, issues: fileIssues } = parseFiles(body.files);
  issues.push(...fileIssues);
  throwIfIssues(issues);
  const blobError = blobFilesError(files);

  return withLockedTask(db, caller, idOrSlug, async (tx, task) => {
    const status = task.status as TaskStatus;
    if (!TASK_ACTION_FROM.message.includes(status)) throw new ConflictError(`Task is ${status}; it takes no messages`);
    if (body.metadata && !task.runnerId) throw ValidationError.field('metadata', 'applies to local tasks only');
    const job = await queueFollowUp(tx, task, {
      body: body.message,
      userIntent: body.userIntent ?? null,
      files,
      metadata: body.metadata ?? null,
      error: blobError,
    });
    return { view: await reload(tx, caller, task.id), job };
  });
}

/**
 * Queues a follow-up on a task the caller has locked: the message joins the thread and a job of the
 * task's mode (or the one `userIntent` switches to) is queued. A follow-up on a waiting, finished or
 * cancelled task resumes it on the same thread (and unarchives it); on a task that is already queued or
 * running it simply waits its turn. A follow-up that failed at once (a blob: file) leaves the task where
 * it was: its job says why. Also for answers that a local run could not take (an undelivered async answer).
 */
export async function queueFollowUp(
  tx: Db,
  task: TaskRow,
  input: { body: string; userIntent: SendMessageBody['userIntent'] | null; files?: readonly ParsedFile[]; metadata?: MessageMetadata | null; error?: string | null },
): Promise<JobRow> {
  const status = task.status as TaskStatus;
  const message = await insertMessage(tx, { taskId: task.id, role: 'user', body: input.body, userIntent: input.userIntent ?? null, files: input.files ?? [], metadata: input.metadata ?? null });
  const agent = parseAgentId(task.agent) as AgentId;
  const failed = input.error ?? null;
  const job = await insertJob(tx, {
    taskId: task.id,
    workspaceId: task.workspaceId,
    messageId: message.id,
    status: failed ? 'FAILED' : 'PENDING',
    type: followUpType(task, input.userIntent ?? undefined),
    agent: task.agent,
    agentProvider: agent.provider,
    effort: task.effort,
    input: input.body,
    error: failed,
    completedAt: failed ? new Date() : null,
    runnerId: task.runnerId,
  });
  const resumes = !failed && status !== 'PENDING' && status !== 'IN_PROGRESS';
  await updateTask(tx, task.id, resumes ? { status: 'PENDING', archivedAt: null } : { archivedAt: null }, resumes ? taskStatesInto('PENDING') : [status]);
  await localJobQueued(tx, task, job);
  return job;
}

export async function approvePlan(db: Db, caller: Caller, idOrSlug: string, body: ApprovePlanBody): Promise<TaskAndJobRows> {
  return withLockedTask(db, caller, idOrSlug, async (tx, task) => {
    const latest = await findLatestJob(tx, task.id);
    const ready =
      latest && latest.status === 'COMPLETED' && latest.planOutcome === 'READY' && latest.plan !== null
        ? latest
        : null;
    if (!ready || !TASK_ACTION_FROM.approvePlan.includes(task.status as TaskStatus)) {
      throw new ConflictError('Task has no plan awaiting approval', { status: task.status });
    }
    await updateJob(tx, ready.id, { planOutcome: 'APPROVED' }, ['COMPLETED']);
    const extra = body.message?.trim();
    const input = extra ? `${ready.plan}\n\n${extra}` : (ready.plan as string);
    const message = await insertMessage(tx, { taskId: task.id, role: 'user', body: extra ? `Plan approved.\n\n${extra}` : 'Plan approved.', userIntent: 'SWE' });
    const agent = parseAgentId(task.agent) as AgentId;
    const job = await insertJob(tx, {
      taskId: task.id,
      workspaceId: caller.workspaceId,
      messageId: message.id,
      status: 'PENDING',
      type: 'IMPLEMENT_PLAN',
      agent: task.agent,
      agentProvider: agent.provider,
      effort: task.effort,
      input,
      plan: ready.plan,
      runnerId: task.runnerId,
    });
    await updateTask(tx, task.id, { status: 'PENDING' }, TASK_ACTION_FROM.approvePlan);
    await localJobQueued(tx, task, job);
    return { view: await reload(tx, caller, task.id), job };
  });
}

export async function cancelTask(db: Db, caller: Caller, idOrSlug: string): Promise<{ view: TaskView; cancelled: JobRow[] }> {
  return withLockedTask(db, caller, idOrSlug, async (tx, task) => {
    const status = task.status as TaskStatus;
    // Cancelling a cancelled task changes nothing and says so by cancelling no jobs.
    if (status === 'CANCELLED') return { view: await reload(tx, caller, task.id), cancelled: [] };
    if (!TASK_ACTION_FROM.cancel.includes(status)) throw new ConflictError(`Task is ${status}; it has no active runs to cancel`, { status });
    const cancelled = await cancelActiveJobs(tx, task.id, ACTIVE_JOB_STATUSES);
    await updateTask(tx, task.id, { status: 'CANCELLED' }, TASK_ACTION_FROM.cancel);
    await notify(tx, EVENTS_CHANNEL, task.id);
    // A runner holding a cancelled run learns of it from its work version: it stops the run.
    if (task.runnerId) await bumpWorkVersion(tx, task.runnerId);
    return { view: await reload(tx, caller, task.id), cancelled };
  });
}

export async function archiveTask(db: Db, caller: Caller, idOrSlug: string): Promise<TaskView> {
  return withLockedTask(db, caller, idOrSlug, async (tx, task) => {
    if (task.archivedAt) return reload(tx, caller, task.id);
    const status = task.status as TaskStatus;
    if (!TASK_ACTION_FROM.archive.includes(status)) {
      throw new ConflictError(`Task is ${status}; cancel it before archiving`, { status });
    }
    await updateTask(tx, task.id, { archivedAt: new Date() }, TASK_ACTION_FROM.archive);
    return reload(tx, caller, task.id);
  });
}

/** Whether the task has a queued or running job (a log stream that follows it stays open while so). */
export async function isTaskActive(db: Db, caller: Caller, taskId: string): Promise<boolean> {
  const view = await readTaskView(db, caller, taskId);
  return view !== null && (view.task.status === 'PENDING' || view.task.status === 'IN_PROGRESS');
}

export type { ParsedFile };
