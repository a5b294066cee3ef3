/**
 * Pull requests on the built-in code host, as people see them through the API: list, read with the
 * diff, merge, close. Merging is always a person's act; it completes the task (SPEC.md "States and
 * transitions": a linked pull request merged → the task becomes Completed) and brings the environment up
 * to date (a new version: forks made from now on start from the merged code; running ones keep theirs).
 */
import type { Logger } from 'pino';
import { BaseMovedError, MergeConflictError } from '../codehost/local.js';
import { taskStatesInto } from '../domain/states.js';
import { ConflictError, NotFoundError } from '../domain/errors.js';
import type { Db } from '../store/db.js';
import { findPullRequest, listPullRequests, setPullRequestState, taskPullRequests } from '../store/pull-requests.js';
import { listRepositories, type RepositoryRow } from '../store/repositories.js';
import { updateTask, type PullRequestRow } from '../store/tasks.js';
import type { Environments } from './environments.js';
import type { Caller } from './tasks.js';

export interface PullRequestDeps {
  db: Db;
  environments: Environments;
  logger: Pick<Logger, 'warn'>;
}

const pullRequestNotFound = (): NotFoundError => new NotFoundError('Pull request not found');

export async function listWorkspaceRepositories(db: Db, caller: Caller): Promise<RepositoryRow[]> {
  return listRepositories(db, caller.workspaceId);
}

export async function listWorkspacePullRequests(
  db: Db,
  caller: Caller,
  filter: { repository?: string; state?: 'open' | 'merged' | 'closed'; limit: number },
): Promise<PullRequestRow[]> {
  return listPullRequests(db, caller.workspaceId, { limit: filter.limit, ...(filter.repository ? { fullName: filter.repository } : {}), ...(filter.state ? { state: filter.state } : {}) });
}

export async function getPullRequest(deps: PullRequestDeps, caller: Caller, fullName: string, number: number): Promise<{ pullRequest: PullRequestRow; diff: string }> {
  const pullRequest = await findPullRequest(deps.db, caller.workspaceId, fullName, number);
  if (!pullRequest) throw pullRequestNotFound();
  const host = deps.environments.codeHost;
  const diff = pullRequest.baseSha && pullRequest.headSha ? await host.diff(caller.workspaceId, fullName, pullRequest.baseSha, pullRequest.headSha) : '';
  return { pullRequest, diff };
}

/**
 * Merges an open pull request into its base branch. The row is locked while the code host merges, so two
 * merges (or a merge and a close) of one pull request cannot both happen.
 */
export async function mergePullRequest(deps: PullRequestDeps, caller: Caller, fullName: string, number: number): Promise<PullRequestRow> {
  const merged = await deps.db.transaction(async (tx) => {
    const pullRequest = await findPullRequest(tx, caller.workspaceId, fullName, number, true);
    if (!pullRequest) throw pullRequestNotFound();
    if (pullRequest.state !== 'open') throw new ConflictError(`Pull request is ${pullRequest.state}`, { state: pullRequest.state });
    if (!pullRequest.headBranch || !pullRequest.baseBranch) throw new ConflictError('Pull request has no branches to merge');
    if (!pullRequest.headSha) throw new ConflictError('Pull request has no commit to merge');
    const host = deps.environments.codeHost;
    try {
      // The commit the pull request shows, not whatever its branch holds now: only reviewed code lands.
      await host.merge(caller.workspaceId, fullName, pullRequest.baseBranch, pullRequest.headSha, `Merge pull request #${number}: ${pullRequest.title}`);
    } catch (error) {
      if (error instanceof MergeConflictError) throw new ConflictError(`Pull request cannot be merged: ${error.message}`, { files: error.files });
      if (error instanceof BaseMovedError) throw new ConflictError(`Pull request cannot be merged now: ${error.message}`);
      throw error;
    }
    const row = (await setPullRequestState(tx, pullRequest.id, 'merged'))!;
    // SPEC.md: a linked pull request merged completes the task, whatever it waited for; a task that is
    // running again (a follow-up) goes on, and its job's end decides.
    await updateTask(tx, pullRequest.taskId, { status: 'COMPLETED' }, taskStatesInto('COMPLETED').filter((from) => from !== 'IN_PROGRESS' && from !== 'PENDING'));
    return row;
  });
  // The merge is done on the code host either way; an environment that could not catch up now does at
  // the scheduler's next sweep.
  await deps.environments.afterMerge(caller.workspaceId).catch((error: unknown) => deps.logger.warn({ err: error }, 'the environment could not catch up with a merge yet'));
  return merged;
}

export async function closePullRequest(deps: PullRequestDeps, caller: Caller, fullName: string, number: number): Promise<PullRequestRow> {
  return deps.db.transaction(async (tx) => {
    const pullRequest = await findPullRequest(tx, caller.workspaceId, fullName, number, true);
    if (!pullRequest) throw pullRequestNotFound();
    if (pullRequest.state !== 'open') throw new ConflictError(`Pull request is ${pullRequest.state}`, { state: pullRequest.state });
    const row = (await setPullRequestState(tx, pullRequest.id, 'closed'))!;
    // A task that waited only for this review is done with once nothing of it is open any more.
    const stillOpen = (await taskPullRequests(tx, pullRequest.taskId)).some((pr) => pr.state === 'open');
    if (!stillOpen) await updateTask(tx, pullRequest.taskId, { status: 'COMPLETED' }, ['IN_REVIEW']);
    return row;
  });
}
