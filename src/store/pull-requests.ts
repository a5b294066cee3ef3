/** Pull requests on the built-in code host: opened and updated by jobs, merged or closed by people. */
import { and, asc, desc, eq, type SQL } from 'drizzle-orm';
import type { Db } from './db.js';
import { nextPullRequestNumber } from './repositories.js';
import { pullRequests, repositories, tasks, type CheckProof } from './schema.js';
import type { PullRequestRow } from './tasks.js';

export interface PullRequestPush {
  taskId: string;
  repositoryId: string;
  repoFullName: string;
  jobId: string;
  title: string;
  body: string;
  headBranch: string;
  baseBranch: string;
  headSha: string;
  baseSha: string;
  checks: CheckProof[];
  /** Builds the pull request's address from its number. */
  url: (number: number) => string;
}

/** Updates the task's open pull request in the repository, or opens one under the next number. */
export async function recordPullRequestPush(tx: Db, push: PullRequestPush): Promise<{ pullRequest: PullRequestRow; opened: boolean }> {
  const fields = {
    title: push.title,
    body: push.body,
    headBranch: push.headBranch,
    baseBranch: push.baseBranch,
    headSha: push.headSha,
    baseSha: push.baseSha,
    checks: push.checks,
    jobId: push.jobId,
  };
  const [open] = await tx
    .select()
    .from(pullRequests)
    .where(and(eq(pullRequests.taskId, push.taskId), eq(pullRequests.repositoryId, push.repositoryId), eq(pullRequests.state, 'open')))
    .for('update');
  if (open) {
    const [updated] = await tx.update(pullRequests).set({ ...fields, updatedAt: new Date() }).where(eq(pullRequests.id, open.id)).returning();
    return { pullRequest: updated!, opened: false };
  }
  const number = await nextPullRequestNumber(tx, push.repositoryId);
  const [created] = await tx
    .insert(pullRequests)
    .values({ ...fields, taskId: push.taskId, repositoryId: push.repositoryId, repoFullName: push.repoFullName, prNumber: number, prUrl: push.url(number), state: 'open' })
    .returning();
  return { pullRequest: created!, opened: true };
}

/** The task's pull requests on the code host, oldest first. */
export async function taskPullRequests(db: Db, taskId: string): Promise<PullRequestRow[]> {
  return db.select().from(pullRequests).where(eq(pullRequests.taskId, taskId)).orderBy(asc(pullRequests.createdAt), asc(pullRequests.prNumber));
}

/** One pull request of the workspace by repository and number, locked when `forUpdate`. */
export async function findPullRequest(db: Db, workspaceId: string, fullName: string, number: number, forUpdate = false): Promise<PullRequestRow | null> {
  const query = db
    .select({ pr: pullRequests })
    .from(pullRequests)
    .innerJoin(repositories, eq(repositories.id, pullRequests.repositoryId))
    .where(and(eq(repositories.workspaceId, workspaceId), eq(repositories.fullName, fullName), eq(pullRequests.prNumber, number)));
  const [row] = forUpdate ? await query.for('update', { of: pullRequests }) : await query;
  return row?.pr ?? null;
}

export async function listPullRequests(
  db: Db,
  workspaceId: string,
  filter: { fullName?: string; state?: 'open' | 'merged' | 'closed'; taskId?: string; limit: number },
): Promise<PullRequestRow[]> {
  const conditions: SQL[] = [eq(tasks.workspaceId, workspaceId)];
  if (filter.fullName) conditions.push(eq(pullRequests.repoFullName, filter.fullName));
  if (filter.state) conditions.push(eq(pullRequests.state, filter.state));
  if (filter.taskId) conditions.push(eq(pullRequests.taskId, filter.taskId));
  const rows = await db
    .select({ pr: pullRequests })
    .from(pullRequests)
    .innerJoin(tasks, eq(tasks.id, pullRequests.taskId))
    .where(and(...conditions))
    .orderBy(desc(pullRequests.createdAt))
    .limit(filter.limit);
  return rows.map((row) => row.pr);
}

export async function setPullRequestState(tx: Db, id: string, state: 'merged' | 'closed'): Promise<PullRequestRow | null> {
  const now = new Date();
  const [row] = await tx
    .update(pullRequests)
    .set({ state, updatedAt: now, ...(state === 'merged' ? { mergedAt: now } : { closedAt: now }) })
    .where(and(eq(pullRequests.id, id), eq(pullRequests.state, 'open')))
    .returning();
  return row ?? null;
}
