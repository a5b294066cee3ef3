/**
 * Pull requests a local run reports (docs/runner-protocol.md "POST /runs/{runId}/pull-requests"): the
 * runner opened them on a code host the service does not see, so the report is all the service knows.
 * Records are keyed by the repository and number read from the URL, so a refresh updates, never adds.
 */
import { AppError, NotFoundError, ValidationError } from '../../domain/errors.js';
import type { PullRequestReportBody } from '../../protocol/runner.js';
import type { ValidationIssue } from '../../protocol/errors.js';
import type { Db } from '../../store/db.js';
import { taskPullRequests } from '../../store/pull-requests.js';
import type { RunnerRow } from '../../store/runners.js';
import { lockRunnerRun } from '../../store/runs.js';
import { upsertPullRequests, type PullRequestRow } from '../../store/tasks.js';
import { findMembership } from '../../store/users.js';
import { RUN_NOT_FOUND } from './runs.js';

/** The largest number the column holds. */
const MAX_NUMBER = 2_147_483_647;

/**
 * The repository and number of a pull request URL: GitHub's `…/owner/repo/pull/N`, GitLab's
 * `…/group[/subgroup…]/repo/-/merge_requests/N`, the built-in code host's `…/repos/owner/repo/pulls/N`.
 * Null for anything else.
 */
export function parsePullRequestUrl(value: string): { repoFullName: string; prNumber: number } | null {
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    return null;
  }
  if (url.protocol !== 'https:' && url.protocol !== 'http:') return null;
  const path = url.pathname.replace(/\/+$/, '');
  const segment = '[A-Za-z0-9_.-]+';
  const forms = [
    new RegExp(`/repos/(${segment}/${segment})/pulls/(\\d+)$`),
    new RegExp(`^/((?:${segment}/)+${segment})/-/merge_requests/(\\d+)$`),
    new RegExp(`/(${segment}/${segment})/pull/(\\d+)$`),
  ];
  for (const form of forms) {
    const match = form.exec(path);
    if (!match) continue;
    const prNumber = Number(match[2]);
    const repoFullName = match[1]!;
    if (!Number.isSafeInteger(prNumber) || prNumber < 1 || prNumber > MAX_NUMBER) return null;
    if (repoFullName.split('/').some((part) => part === '.' || part === '..')) return null;
    return { repoFullName, prNumber };
  }
  return null;
}

/**
 * Upserts the reported pull requests of the run's task and answers all of its records. Any run of the
 * task counts, whatever its state: a pull request merged after the run completed is still reported.
 */
export async function reportPullRequests(db: Db, runner: RunnerRow, runId: string, body: PullRequestReportBody): Promise<PullRequestRow[]> {
  const issues: ValidationIssue[] = [];
  const byKey = new Map<string, { repoFullName: string; prNumber: number; prUrl: string; title: string; state: 'open' | 'merged' | 'closed' }>();
  body.pullRequests.forEach((report, index) => {
    const parsed = parsePullRequestUrl(report.prUrl);
    if (!parsed) {
      issues.push({
        field: `pullRequests.${index}.prUrl`,
        message: `${report.prUrl} is not a pull request URL (…/owner/repo/pull/N, …/owner/repo/-/merge_requests/N or …/repos/owner/repo/pulls/N)`,
      });
      return;
    }
    // One statement may not update a row twice: a pull request named twice keeps its last report.
    byKey.set(`${parsed.repoFullName}#${parsed.prNumber}`, { ...parsed, prUrl: report.prUrl, title: report.title, state: report.state });
  });
  if (issues.length > 0) throw new ValidationError(issues);

  return db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { task } = locked;
    if (!(await findMembership(tx, task.workspaceId, runner.userId))) {
      throw new AppError('forbidden', "the runner's user is no longer a member of the task's workspace");
    }
    await upsertPullRequests(tx, task.id, [...byKey.values()]);
    return taskPullRequests(tx, task.id);
  });
}
