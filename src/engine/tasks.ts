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

export interface Caller {
  workspaceId: string;
  keyId: string | null;
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
  const view = await findTaskView(db, caller.workspaceId, taskId);
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
      instructions: config.instructions,
      error: blobError,
      completedAt: blobError ? new Date() : null,
    });
    return { view: await reload(tx, caller, task.id), job };
  });
}

export async function getTask(db: Db, caller: Caller, idOrSlug: string): Promise<TaskView> {
  const view = await readTaskView(db, caller.workspaceId, idOrSlug);
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
  const { rows, hasMore } = await listTasks(db, caller.workspaceId, {
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
  const view = await readTaskView(db, caller.workspaceId, idOrSlug);
  if (!view) throw taskNotFound();
  const { rows, hasMore } = await listJobs(db, view.task.id, { limit: query.limit, beforeSeq });
  const oldest = rows[0];
  return { rows, nextCursor: hasMore && oldest ? encodeCursor('jobs', oldest.seq) : null };
}

/** Runs `action` with the task locked; 404 when the caller's workspace has no such task. */
async function withLockedTask<T>(db: Db, caller: Caller, idOrSlug: string, action: (tx: Db, task: TaskRow) => Promise<T>): Promise<T> {
  return db.transaction(async (tx) => {
    const task = await lockTask(tx, caller.workspaceId, idOrSlug);
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
    const message = await insertMessage(tx, { taskId: task.id, role: 'user', body: body.message, userIntent: body.userIntent ?? null, files });
    const agent = parseAgentId(task.agent) as AgentId;
    const job = await insertJob(tx, {
      taskId: task.id,
      workspaceId: caller.workspaceId,
      messageId: message.id,
      status: blobError ? 'FAILED' : 'PENDING',
      type: followUpType(task, body.userIntent),
      agent: task.agent,
      agentProvider: agent.provider,
      effort: task.effort,
      input: body.message,
      error: blobError,
      completedAt: blobError ? new Date() : null,
    });
    // A follow-up on a waiting, finished or cancelled task resumes it on the same thread (and unarchives
    // it); on a task that is already queued or running it simply waits its turn. A follow-up that failed
    // at once (a blob: file) leaves the task where it was: its job says why.
    const resumes = !blobError && status !== 'PENDING' && status !== 'IN_PROGRESS';
    await updateTask(tx, task.id, resumes ? { status: 'PENDING', archivedAt: null } : { archivedAt: null }, resumes ? taskStatesInto('PENDING') : [status]);
    return { view: await reload(tx, caller, task.id), job };
  });
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
    });
    await updateTask(tx, task.id, { status: 'PENDING' }, TASK_ACTION_FROM.approvePlan);
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
  const view = await readTaskView(db, caller.workspaceId, taskId);
  return view !== null && (view.task.status === 'PENDING' || view.task.status === 'IN_PROGRESS');
}

export type { ParsedFile };
