/**
 * Cloud delegation of a local run (docs/runner-protocol.md "POST /runs/{runId}/delegate"): the local
 * agent hands its remaining work and its pushed branches to a cloud task in a workspace of its user.
 *
 * A handoff is recorded in two steps so that a failure between them is repaired by a retry:
 * 1. one transaction creates the cloud task with its handoff message (the first handoff only), links the
 *    local task to it and records the delegation (local task, invocation id, digest of the input);
 * 2. a second one queues the job of the handoff message and records its id (`dispatched_job_id`).
 * A request repeating an invocation id with the same input finds the delegation and answers the same,
 * doing step 2 if it never completed; with other input it is a conflict. Later handoffs of the local task
 * continue its linked cloud task: their message and job are queued together in step 2.
 *
 * The message carries the commit each branch pointed at when it was handed off
 * (`messages.metadata.handoff`); the cloud job checks out exactly those (job-run.ts).
 */
import { createHash } from 'node:crypto';
import { z } from 'zod';
import { effortError, jobTypeOfMode, parseAgentId, type AgentId } from '../../domain/agents.js';
import { AppError, ConflictError, NotFoundError, ValidationError } from '../../domain/errors.js';
import { runStateOf } from '../../domain/runners.js';
import { makeSlug } from '../../domain/slugs.js';
import { taskStatesInto } from '../../domain/states.js';
import type { ValidationIssue } from '../../protocol/errors.js';
import type { Effort, JobStatus, MessageMetadata, TaskMode, TaskStatus } from '../../protocol/rest.js';
import { RUNNER_LIMITS, type DelegateBody, type DelegateResponse } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import {
  connectedRepositories,
  findDelegation,
  findHandoffMessage,
  findJobOfMessage,
  findTask,
  insertDelegation,
  linkTask,
  markDelegationDispatched,
  type DelegationRow,
} from '../../store/delegations.js';
import { findRoutingConfigs } from '../../store/routing.js';
import { findRunnerProject, projectRepositories, type RunnerRow } from '../../store/runners.js';
import { findRunnerRun, lockRunnerRun } from '../../store/runs.js';
import { insertJob, insertMessage, insertTask, updateTask, type JobRow, type TaskRow } from '../../store/tasks.js';
import { findMembership, listUserWorkspaces, type UserWorkspace } from '../../store/users.js';
import { findWorkspace } from '../../store/workspaces.js';
import { queueFollowUp } from '../tasks.js';
import { RUN_NOT_FOUND } from './runs.js';

/**
 * What a handoff gives the cloud task along with its message (`messages.metadata.handoff`, the server's
 * own entry: never taken from a client, never shown to one): the commit each branch pointed at when it
 * was handed off, which the cloud job checks out (job-run.ts).
 */
export const Handoff = z.object({
  invocationId: z.string(),
  sourceTaskId: z.uuid(),
  branches: z.array(z.object({ repository: z.string(), branch: z.string(), commit: z.string().regex(/^[0-9a-f]{40}(?:[0-9a-f]{24})?$/) })),
});
export type Handoff = z.infer<typeof Handoff>;

export interface DelegationDeps {
  db: Db;
  /** The built-in code host, where handed-off branches must have been pushed. */
  codeHost: { resolve(workspaceId: string, fullName: string, ref: string): Promise<string | null> };
  publicUrl: string;
  /**
   * Runs after the handoff is recorded and before its job is queued. Nothing sets it in the service; tests
   * make it fail once to see a dispatch fail and a retry repair it, or move a branch right after the handoff.
   */
  beforeDispatch?: (delegation: DelegationRow) => Promise<void>;
  /** Told why a dispatch failed (the answer only says that it did). */
  onDispatchError?: (error: unknown) => void;
}

type Refusal = Extract<DelegateResponse, { ok: false }>;
type Branch = Handoff['branches'][number];

// ---- The calling run ----

/**
 * The run, when it is the runner's (404 otherwise), named at its current generation (409 with
 * `details.generation` otherwise) and executing (409 otherwise): only a live agent hands work over.
 * With `lock`, its task and then the run are locked (inside a transaction).
 */
export async function activeRun(db: Db, runner: RunnerRow, runId: string, generation: number, lock = false): Promise<{ job: JobRow; task: TaskRow }> {
  const run = lock ? await lockRunnerRun(db, runner.id, runId) : await findRunnerRun(db, runner.id, runId);
  if (!run) throw new NotFoundError(RUN_NOT_FOUND);
  const { job } = run;
  if (job.generation !== generation) {
    throw new ConflictError(`generation ${generation} no longer holds this run (it is at ${job.generation})`, { generation: job.generation });
  }
  if (!(job.status === 'IN_PROGRESS' && job.runnerState === 'executing')) {
    const state = runStateOf(job.status as JobStatus, job.runnerState);
    throw new ConflictError(`the run is ${state}; only an executing run may do this`, { state });
  }
  return run;
}

// ---- Destinations ----

/** Setup guidance the web app renders as a card; the agent includes it verbatim, outside a code fence. */
export function cloudSetupMarkdown(sourceTaskId: string, repositories: readonly string[], lead: string): string {
  const names = repositories.length > 0 ? repositories.join(', ') : '(none)';
  return [
    lead,
    '',
    'Connect each one to a workspace of yours under that name (an operator runs `svc admin repo add <git URL> --workspace <workspace> --name <owner/repo>`, ' +
      'or the workspace calls `POST /api/v1/repos`), then ask again.',
    '',
    '[[CLOUD_SETUP]]',
    `taskId: ${sourceTaskId}`,
    `repositories: ${names}`,
    '[[/CLOUD_SETUP]]',
  ].join('\n');
}

export type Destination =
  | { kind: 'chosen'; workspace: { id: string; name: string } }
  | { kind: 'refused'; message: string; choices?: Array<{ id: string; name: string }>; markdown?: string };

/**
 * Where work of `repositories` may go: a workspace of the user (any membership; the personal one too,
 * though it rarely has repositories connected) where every one of them is connected. `workspaceId`
 * picks one; otherwise a single match is chosen, several are offered, and none gets setup guidance.
 */
export async function chooseDestination(
  db: Db,
  input: { userId: string; repositories: readonly string[]; workspaceId?: string | undefined; sourceTaskId: string },
): Promise<Destination> {
  const workspaces = await listUserWorkspaces(db, input.userId);
  const connected = await connectedRepositories(
    db,
    workspaces.map((workspace) => workspace.id),
    input.repositories,
  );
  const missingIn = (workspace: UserWorkspace) => input.repositories.filter((name) => !connected.get(workspace.id)?.has(name));
  const choice = (workspace: UserWorkspace) => ({ id: workspace.id, name: workspace.name });
  if (input.workspaceId !== undefined) {
    const picked = workspaces.find((workspace) => workspace.id === input.workspaceId);
    if (!picked) return { kind: 'refused', message: `Workspace ${input.workspaceId} is not one of yours; call again without workspaceId or with one of your workspaces.` };
    const missing = missingIn(picked);
    if (missing.length === 0) return { kind: 'chosen', workspace: choice(picked) };
    const message = `The workspace "${picked.name}" does not have ${missing.join(', ')} connected.`;
    return { kind: 'refused', message, markdown: cloudSetupMarkdown(input.sourceTaskId, missing, message) };
  }
  const matching = workspaces.filter((workspace) => missingIn(workspace).length === 0);
  const [only] = matching;
  if (only && matching.length === 1) return { kind: 'chosen', workspace: choice(only) };
  if (matching.length > 1) {
    return {
      kind: 'refused',
      message: `Several of your workspaces have ${input.repositories.join(', ') || 'what this needs'}: ${matching.map((workspace) => `"${workspace.name}" (${workspace.id})`).join(', ')}. Call again with the workspaceId of one of them.`,
      choices: matching.map(choice),
    };
  }
  const message = `None of your workspaces has ${input.repositories.join(', ')} connected.`;
  return { kind: 'refused', message, markdown: cloudSetupMarkdown(input.sourceTaskId, input.repositories, message) };
}

// ---- The handoff ----

/** What git takes as a branch name, minus the odd corners (`@{`, `..`, a leading `-`, `.lock`). */
const BRANCH = /^(?![-./])(?!.*\.\.)(?!.*\/\/)(?!.*\/\.)(?!.*@\{)[A-Za-z0-9._/+@-]{1,255}(?<!\.lock)(?<![./])$/;

/** The input as canonical JSON (keys sorted at every level): what a retry must repeat exactly. */
export function inputDigest(input: DelegateBody['input']): string {
  const canonical = (value: unknown): unknown =>
    Array.isArray(value)
      ? value.map(canonical)
      : value !== null && typeof value === 'object'
        ? Object.fromEntries(
            Object.entries(value)
              .filter(([, item]) => item !== undefined)
              .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))
              .map(([key, item]) => [key, canonical(item)]),
          )
        : value;
  return createHash('sha256').update(JSON.stringify(canonical(input))).digest('hex');
}

/** The checks that make a request invalid (400), whatever the state of workspaces and branches. */
function checkInput(input: DelegateBody['input']): { title: string | null; agent: AgentId | null } {
  const issues: ValidationIssue[] = [];
  const title = input.title === undefined ? null : input.title.trim();
  if (title !== null && title.length === 0) issues.push({ field: 'input.title', message: 'must not be empty' });
  if (title !== null && [...title].length > RUNNER_LIMITS.delegationTitle) {
    issues.push({ field: 'input.title', message: `must be at most ${RUNNER_LIMITS.delegationTitle} characters (it has ${[...title].length})` });
  }
  if (input.instructions.trim().length === 0) issues.push({ field: 'input.instructions', message: 'must not be empty' });
  let agent: AgentId | null = null;
  if (input.agent !== undefined) {
    const parsed = parseAgentId(input.agent);
    if ('error' in parsed) issues.push({ field: 'input.agent', message: parsed.error });
    else agent = parsed;
  }
  const seen = new Set<string>();
  input.repositories.forEach((entry, index) => {
    if (seen.has(entry.repository)) issues.push({ field: `input.repositories.${index}.repository`, message: `${entry.repository} is listed twice` });
    seen.add(entry.repository);
  });
  if (issues.length > 0) throw new ValidationError(issues);
  return { title, agent };
}

/** Every repository of the run's project must be handed off: the cloud task works on all of them. */
async function uncovered(db: Db, runner: RunnerRow, local: TaskRow, input: DelegateBody['input']): Promise<string[]> {
  const project = local.projectId ? await findRunnerProject(db, runner.id, local.projectId) : null;
  const names = project ? projectRepositories(project).map((repository) => repository.name) : [];
  return names.filter((name) => !input.repositories.some((entry) => entry.repository === name));
}

/** The commit of each branch on the destination's code host now; a refusal names what is wrong. */
async function resolveBranches(deps: DelegationDeps, workspace: { id: string; name: string }, input: DelegateBody['input']): Promise<Branch[] | Refusal> {
  const branches: Branch[] = [];
  for (const { repository, branch } of input.repositories) {
    if (!BRANCH.test(branch)) return { ok: false, message: `"${branch}" (of ${repository}) is not a valid branch name; no cloud task was made.` };
    const commit = await deps.codeHost.resolve(workspace.id, repository, `refs/heads/${branch}`);
    if (!commit) {
      return {
        ok: false,
        message: `The branch ${branch} of ${repository} is not on the code host of the workspace "${workspace.name}": push it there first, then call again. No cloud task was made.`,
      };
    }
    branches.push({ repository, branch, commit });
  }
  return branches;
}

/** The handoff message: the instructions, and where the cloud run starts from. */
function handoffBody(instructions: string, local: TaskRow, branches: readonly Branch[]): string {
  const lines = [instructions.trim(), '', '---', `Handed off from the local task "${local.title}".`];
  if (branches.length > 0) {
    lines.push('Your workspace starts from these branches, checked out at the commits they had at the handoff:');
    for (const branch of branches) lines.push(`- ${branch.repository}: \`${branch.branch}\` at ${branch.commit}`);
  }
  return lines.join('\n');
}

/**
 * `messages.metadata` is typed for what clients may send (MessageMetadata); the handoff is the server's
 * own entry beside those, never accepted from a client and never shown to one.
 */
export function handoffMetadata(handoff: Handoff): MessageMetadata {
  return { handoff } as unknown as MessageMetadata;
}

const taskUrl = (publicUrl: string, task: TaskRow) => `${publicUrl}/tasks/${task.slug}`;
const oneLine = (text: string) => text.replace(/\s+/g, ' ').trim();

/** The `[[TASK]]` block the web app shows as a live card of the cloud task. */
function taskMarkdown(publicUrl: string, task: TaskRow): string {
  const url = taskUrl(publicUrl, task);
  return [
    `The work continues in the cloud task "${oneLine(task.title)}": ${url}`,
    '',
    '[[TASK]]',
    `id: ${task.id}`,
    `slug: ${task.slug}`,
    `title: ${oneLine(task.title)}`,
    `url: ${url}`,
    '[[/TASK]]',
  ].join('\n');
}

function succeeded(publicUrl: string, cloud: TaskRow): DelegateResponse {
  return { ok: true, taskId: cloud.id, url: taskUrl(publicUrl, cloud), markdown: taskMarkdown(publicUrl, cloud) };
}

/** A refusal that still points at the cloud task (it exists; its job does not yet). */
function withTask(publicUrl: string, cloud: TaskRow, message: string): Refusal {
  return { ok: false, message, taskId: cloud.id, url: taskUrl(publicUrl, cloud), markdown: taskMarkdown(publicUrl, cloud) };
}

/** The cloud task of a first handoff, with its message; its job comes in the dispatch step. */
async function createCloudTask(
  tx: Db,
  input: { workspaceId: string; title: string; agent: AgentId | null; userId: string; body: string; handoff: Handoff },
): Promise<TaskRow> {
  const { fallback: config } = await findRoutingConfigs(tx, input.workspaceId, null);
  if (!config) throw new AppError('internal_error', undefined, { cause: new Error(`workspace ${input.workspaceId} has no default routing config`) });
  const agentId = input.agent ? `${input.agent.provider}/${input.agent.model}` : config.agent;
  const agent = input.agent ?? parseAgentId(config.agent);
  if ('error' in agent) throw new AppError('internal_error', undefined, { cause: new Error(`routing config default has an invalid agent: ${agent.error}`) });
  const effort = config.effort as Effort;
  const problem = effortError(effort, agent);
  if (problem) throw ValidationError.field('input.agent', `${problem} (the workspace's default effort is ${effort})`);
  const task = await insertTask(
    tx,
    { workspaceId: input.workspaceId, title: input.title, status: 'PENDING', mode: config.mode, agent: agentId, effort, createdByKeyId: null, createdByUserId: input.userId },
    () => makeSlug(input.title),
  );
  await insertMessage(tx, { taskId: task.id, role: 'user', body: input.body, userIntent: null, metadata: handoffMetadata(input.handoff) });
  return task;
}

/** Queues the job of a handoff message stored with its task (a first handoff), as task creation would. */
async function queueStoredMessage(tx: Db, cloud: TaskRow, message: { id: string; body: string }): Promise<JobRow> {
  const { fallback: config } = await findRoutingConfigs(tx, cloud.workspaceId, null);
  const agent = parseAgentId(cloud.agent) as AgentId;
  const job = await insertJob(tx, {
    taskId: cloud.id,
    workspaceId: cloud.workspaceId,
    messageId: message.id,
    status: 'PENDING',
    type: jobTypeOfMode(cloud.mode as TaskMode),
    agent: cloud.agent,
    agentProvider: agent.provider,
    effort: cloud.effort,
    input: message.body,
    instructions: config?.instructions ?? null,
  });
  const status = cloud.status as TaskStatus;
  // Cancelled (or finished) between the two steps: the handoff brings it back, as a follow-up would.
  if (status !== 'PENDING' && status !== 'IN_PROGRESS') await updateTask(tx, cloud.id, { status: 'PENDING', archivedAt: null }, taskStatesInto('PENDING'));
  return job;
}

interface Plan {
  body: string;
  handoff: Handoff;
}

/**
 * Step 2: the handoff message gets its job (a first handoff's message is stored already; a later one's
 * is queued with its job now) and the delegation records it. Done once: a delegation that has its job
 * answers as it is. A failure leaves the delegation without a job, which the same request retried repairs.
 */
async function dispatch(deps: DelegationDeps, delegation: DelegationRow, cloud: TaskRow, plan: Plan | null): Promise<DelegateResponse> {
  const { db, publicUrl } = deps;
  try {
    await deps.beforeDispatch?.(delegation);
    const dispatched = await db.transaction(async (tx) => {
      const task = await findTask(tx, cloud.id, true);
      if (!task) return false;
      const current = await findDelegation(tx, delegation.localTaskId, delegation.invocationId, true);
      if (current?.dispatchedJobId) return true;
      const message = await findHandoffMessage(tx, task.id, delegation.localTaskId, delegation.invocationId);
      let job: JobRow;
      if (message) {
        job = (await findJobOfMessage(tx, message.id)) ?? (await queueStoredMessage(tx, task, message));
      } else {
        if (!plan) throw new Error('a later handoff lost its message before it was queued');
        job = await queueFollowUp(tx, task, { body: plan.body, userIntent: null, metadata: handoffMetadata(plan.handoff) });
      }
      await markDelegationDispatched(tx, delegation.id, job.id);
      return true;
    });
    if (!dispatched) return { ok: false, message: 'The cloud task of this handoff no longer exists; no work was queued.' };
    return succeeded(publicUrl, cloud);
  } catch (error) {
    deps.onDispatchError?.(error);
    const reason = error instanceof AppError ? error.message : 'a server error';
    return withTask(publicUrl, cloud, `The cloud task was created but its work could not be queued (${reason}); send the same request again to queue it.`);
  }
}

/**
 * A request repeating an invocation: the same answer for the same input, a conflict for other input.
 * A delegation whose dispatch failed is dispatched now (a later handoff's branches are resolved again:
 * its message was never stored).
 */
async function replay(deps: DelegationDeps, local: TaskRow, delegation: DelegationRow, digest: string, input: DelegateBody['input']): Promise<DelegateResponse> {
  if (delegation.inputDigest !== digest) {
    throw new ConflictError(`invocation ${delegation.invocationId} of this task was already handed off with other input; a retry must repeat the input exactly`);
  }
  const cloud = delegation.cloudTaskId ? await findTask(deps.db, delegation.cloudTaskId) : null;
  if (!cloud) return { ok: false, message: 'The cloud task of this handoff no longer exists.' };
  if (delegation.dispatchedJobId) return succeeded(deps.publicUrl, cloud);
  if (await findHandoffMessage(deps.db, cloud.id, local.id, delegation.invocationId)) return dispatch(deps, delegation, cloud, null);
  const workspace = { id: cloud.workspaceId, name: (await findWorkspace(deps.db, cloud.workspaceId))?.name ?? cloud.workspaceId };
  const branches = await resolveBranches(deps, workspace, input);
  if (!Array.isArray(branches)) return withTask(deps.publicUrl, cloud, branches.message);
  return dispatch(deps, delegation, cloud, { body: handoffBody(input.instructions, local, branches), handoff: { invocationId: delegation.invocationId, sourceTaskId: local.id, branches } });
}

/** The workspace a handoff goes to: the linked cloud task's, or one chosen by the rules of a first handoff. */
async function destinationOf(db: Db, runner: RunnerRow, local: TaskRow, input: DelegateBody['input'], linked: TaskRow | null): Promise<Destination> {
  const repositories = input.repositories.map((entry) => entry.repository);
  if (!linked) return chooseDestination(db, { userId: runner.userId, repositories, workspaceId: input.workspaceId, sourceTaskId: local.id });
  if (!(await findMembership(db, linked.workspaceId, runner.userId))) {
    return { kind: 'refused', message: `You are no longer a member of the workspace of the linked cloud task ${linked.slug}; nothing was handed off.` };
  }
  const connected = (await connectedRepositories(db, [linked.workspaceId], repositories)).get(linked.workspaceId) ?? new Set<string>();
  const missing = repositories.filter((name) => !connected.has(name));
  const [workspace] = (await listUserWorkspaces(db, runner.userId)).filter((candidate) => candidate.id === linked.workspaceId);
  const name = workspace?.name ?? linked.workspaceId;
  if (missing.length === 0) return { kind: 'chosen', workspace: { id: linked.workspaceId, name } };
  const message = `The workspace "${name}" of the linked cloud task does not have ${missing.join(', ')} connected.`;
  return { kind: 'refused', message, markdown: cloudSetupMarkdown(local.id, missing, message) };
}

const RESTART = Symbol('restart');

async function delegateOnce(deps: DelegationDeps, runner: RunnerRow, runId: string, body: DelegateBody): Promise<DelegateResponse | typeof RESTART> {
  const { db } = deps;
  const { input, invocationId } = body;
  const digest = inputDigest(input);
  const { task: local } = await activeRun(db, runner, runId, body.generation);
  const earlier = await findDelegation(db, local.id, invocationId);
  if (earlier) return replay(deps, local, earlier, digest, input);

  const { title, agent } = checkInput(input);
  const missing = await uncovered(db, runner, local, input);
  if (missing.length > 0) {
    return { ok: false, message: `Every repository of the project must be handed off, with its pushed branch: add ${missing.join(', ')} and call again.` };
  }
  const linked = local.linkedTaskId ? await findTask(db, local.linkedTaskId) : null;
  const destination = await destinationOf(db, runner, local, input, linked);
  if (destination.kind === 'refused') {
    const { kind: _kind, choices, ...refusal } = destination;
    return { ok: false, ...refusal, ...(choices ? { workspaces: choices } : {}) };
  }
  const branches = await resolveBranches(deps, destination.workspace, input);
  if (!Array.isArray(branches)) return branches;
  const plan: Plan = { body: handoffBody(input.instructions, local, branches), handoff: { invocationId, sourceTaskId: local.id, branches } };

  const recorded = await db.transaction(async (tx) => {
    const { task: locked } = await activeRun(tx, runner, runId, body.generation, true);
    const again = await findDelegation(tx, local.id, invocationId, true);
    if (again) return { kind: 'replay' as const, delegation: again };
    // Another handoff of this task linked (or its cloud task went) since we looked: decide again.
    if ((locked.linkedTaskId ?? null) !== (linked?.id ?? null)) return { kind: 'restart' as const };
    const cloud =
      linked ??
      (await createCloudTask(tx, { workspaceId: destination.workspace.id, title: title ?? local.title, agent, userId: runner.userId, body: plan.body, handoff: plan.handoff }));
    if (!linked) await linkTask(tx, local.id, cloud.id);
    const delegation = await insertDelegation(tx, { localTaskId: local.id, invocationId, inputDigest: digest, cloudTaskId: cloud.id });
    if (!delegation) throw new Error('the delegation was recorded meanwhile although its task was locked');
    return { kind: 'recorded' as const, delegation, cloud };
  });
  if (recorded.kind === 'restart') return RESTART;
  if (recorded.kind === 'replay') return replay(deps, local, recorded.delegation, digest, input);
  return dispatch(deps, recorded.delegation, recorded.cloud, plan);
}

/** POST /runs/{runId}/delegate. */
export async function delegate(deps: DelegationDeps, runner: RunnerRow, runId: string, body: DelegateBody): Promise<DelegateResponse> {
  for (let attempt = 0; attempt < 3; attempt++) {
    const answer = await delegateOnce(deps, runner, runId, body);
    if (answer !== RESTART) return answer;
  }
  throw new ConflictError('other handoffs of this task kept being recorded at the same time; send the request again');
}
