/** Rows to wire shapes: the only place that knows how a stored task or job is shown to clients. */
import type { Effort, Job, JobStatus, PullRequest, Task, TaskListItem, TaskMode, TaskStatus, JobType, PlanOutcome } from '../../protocol/rest.js';
import type { JobRow, PullRequestRow, TaskListRow, TaskRow, TaskView } from '../../store/tasks.js';
import type { RoutingConfigRow } from '../../store/routing.js';
import type { RepositoryRow } from '../../store/repositories.js';
import type { PullRequestDetail, Repository } from '../../protocol/rest.js';
import type { RoutingConfig, RoutingMode } from '../../protocol/rest.js';
import { DEFAULT_ROUTING_NAME } from '../../domain/routing.js';

const iso = (date: Date): string => date.toISOString();
const isoOrNull = (date: Date | null): string | null => (date ? date.toISOString() : null);

export function presentPullRequest(row: PullRequestRow): PullRequest {
  return { repoFullName: row.repoFullName, prNumber: row.prNumber, prUrl: row.prUrl, title: row.title, state: row.state };
}

export function presentTask(task: TaskRow, prs: PullRequestRow[], publicUrl: string): Task {
  return {
    id: task.id,
    slug: task.slug,
    title: task.title,
    url: `${publicUrl}/tasks/${task.slug}`,
    status: task.status as TaskStatus,
    mode: task.mode as TaskMode,
    agent: task.agent,
    effort: task.effort as Effort,
    archived: task.archivedAt !== null,
    createdAt: iso(task.createdAt),
    updatedAt: iso(task.updatedAt),
    prs: prs.map(presentPullRequest),
  };
}

export function presentView(view: TaskView, publicUrl: string): Task {
  return presentTask(view.task, view.prs, publicUrl);
}

export function presentListItem(row: TaskListRow, publicUrl: string): TaskListItem {
  return { ...presentTask(row.task, row.prs, publicUrl), latestJobStatus: (row.latestJobStatus as JobStatus | null) ?? null };
}

export function presentJob(job: JobRow): Job {
  return {
    id: job.id,
    status: job.status as JobStatus,
    type: job.type as JobType,
    agentProvider: job.agentProvider,
    agent: job.agent,
    input: job.input,
    finalAnswer: job.finalAnswer,
    plan: job.plan,
    planOutcome: job.planOutcome as PlanOutcome | null,
    error: job.error,
    createdAt: iso(job.createdAt),
    startedAt: isoOrNull(job.startedAt),
    completedAt: isoOrNull(job.completedAt),
  };
}

export function presentRoutingConfig(row: RoutingConfigRow): RoutingConfig {
  return {
    name: row.name,
    trigger: row.name === DEFAULT_ROUTING_NAME ? null : `/${row.name}`,
    mode: row.mode as RoutingMode,
    agent: row.agent,
    effort: row.effort as Effort,
    instructions: row.instructions,
    createdAt: iso(row.createdAt),
    updatedAt: iso(row.updatedAt),
  };
}

export function presentPullRequestDetail(row: PullRequestRow): PullRequestDetail {
  return {
    ...presentPullRequest(row),
    taskId: row.taskId,
    body: row.body,
    headBranch: row.headBranch,
    baseBranch: row.baseBranch,
    headSha: row.headSha,
    baseSha: row.baseSha,
    checks: row.checks ?? [],
    createdAt: iso(row.createdAt),
    updatedAt: iso(row.updatedAt),
    mergedAt: isoOrNull(row.mergedAt),
    closedAt: isoOrNull(row.closedAt),
  };
}

export function presentRepository(row: RepositoryRow): Repository {
  return { fullName: row.fullName, dir: row.dir, defaultBranch: row.defaultBranch, createdAt: iso(row.createdAt) };
}
