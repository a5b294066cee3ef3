/**
 * One job, from a claimed row to its result: fork the workspace environment (or continue in the task's
 * fork), start its dev servers, run the harness in the job's mode, verify the change with the
 * repositories' checks (feeding failures back to the agent a bounded number of times, or iterating on a
 * goal's check), then deliver one pull request per changed repository with the proof.
 */
import { rm } from 'node:fs/promises';
import { dirname } from 'node:path';
import type { Logger } from 'pino';
import { forkWorkspace } from '../agents/fork-workspace.js';
import type { AgentEvent, Harness, RunManifest, RunOutcome } from '../agents/types.js';
import type { LocalCodeHost } from '../codehost/local.js';
import type { AgentId } from '../domain/agents.js';
import type { Effort, TaskMode } from '../protocol/rest.js';
import { CONFIG_FILE, parseEnvironmentConfig, type CheckSpec, type EnvironmentConfig } from '../sandbox/environment.js';
import type { Fork } from '../sandbox/fork.js';
import { creditBalance } from '../store/credits.js';
import type { Db } from '../store/db.js';
import { recordPullRequestPush, taskPullRequests } from '../store/pull-requests.js';
import { listRepositories, type RepositoryRow } from '../store/repositories.js';
import type { CheckProof } from '../store/schema.js';
import { listMessages, type JobRow, type TaskRow } from '../store/tasks.js';
import { findWorkspace } from '../store/workspaces.js';
import { clearTransfers, commitAndBundle, inspectRepositories, proofMarkdown, restoreBranch, runChecks, type RepositoryState } from './delivery.js';
import type { JobResult } from './jobs.js';
import { ensureEnvironment } from './repositories.js';

/** Where a task's forks come from: the fork lifecycle keeps one per task between its jobs. */
export interface TaskForks {
  acquire(input: { workspaceId: string; taskId: string; name: string; jobId: string; environment: string }): Promise<{ fork: Fork; fresh: boolean }>;
  release(fork: Fork): Promise<void>;
  discard(fork: Fork): Promise<void>;
}

/** Dev servers running in a fork while the agent works. */
export interface DevServers {
  servers: Array<{ name: string; port: number; url: string; healthy: boolean; error?: string }>;
  env(): Record<string, string>;
  stop(): Promise<void>;
}

export type StartDevServers = (fork: Fork, config: EnvironmentConfig, options: { network: boolean; signal: AbortSignal }) => Promise<DevServers | null>;

export interface JobRunDeps {
  db: Db;
  dataDir: string;
  publicUrl: string;
  forks: TaskForks;
  codeHost: LocalCodeHost;
  startDevServers?: StartDevServers;
  logger: Logger;
}

/** Extra agent rounds after failed checks in `agent` and `dev_env` mode. */
export const CHECK_FIX_ROUNDS = 2;
/** Iterations of a `goal` run by effort: agent, then the goal's check. */
export const GOAL_ITERATIONS: Record<Effort, number> = { low: 2, medium: 3, high: 5, xhigh: 8, ultracode: 10 };
/** A goal's check, written on a line of the task: `check: npm test -- login`. */
const GOAL_CHECK = /^\s*(?:goal\s+)?check:\s*(.+?)\s*$/im;

export function modeOfJob(type: string, taskMode: TaskMode): TaskMode {
  switch (type) {
    case 'PLAN':
      return 'plan';
    case 'ASK':
      return 'ask';
    case 'GOAL':
      return 'goal';
    case 'DEV_ENVIRONMENT':
      return 'dev_env';
    case 'SWE':
    case 'IMPLEMENT_PLAN':
      return 'agent';
    default:
      return taskMode;
  }
}

export function resultOf(outcome: RunOutcome): JobResult {
  switch (outcome.status) {
    case 'completed':
      return { status: 'COMPLETED', finalAnswer: outcome.answer };
    case 'question':
      return { status: 'COMPLETED', finalAnswer: outcome.question, awaitingInput: true };
    case 'plan':
      return { status: 'COMPLETED', plan: outcome.plan, planOutcome: 'READY' };
    case 'failed':
      return { status: 'FAILED', error: outcome.error };
  }
}

export const branchOf = (task: TaskRow): string => `svc/${task.slug}`;

interface RunInput {
  job: JobRow;
  task: TaskRow;
  agent: AgentId;
  harness: Harness;
  emit: (event: AgentEvent) => Promise<void>;
  signal: AbortSignal;
}

export class JobRun {
  private readonly mode: TaskMode;
  private readonly readOnly: boolean;

  constructor(
    private readonly deps: JobRunDeps,
    private readonly input: RunInput,
  ) {
    this.mode = modeOfJob(input.job.type, input.task.mode as TaskMode);
    this.readOnly = this.mode === 'ask' || this.mode === 'plan';
  }

  async execute(): Promise<JobResult> {
    const { db, dataDir, forks } = this.deps;
    const { job, task } = this.input;
    const workspace = await findWorkspace(db, job.workspaceId);
    if (!workspace) return { status: 'FAILED', error: 'the workspace of this job no longer exists' };
    const environment = await ensureEnvironment(db, dataDir, workspace);
    const repositories = await listRepositories(db, job.workspaceId);
    const { fork, fresh } = await forks.acquire({ workspaceId: job.workspaceId, taskId: task.id, name: task.slug, jobId: job.id, environment });
    let devServers: DevServers | null = null;
    try {
      if (fresh && !this.readOnly) await this.restoreBranches(fork, repositories);
      const config = await this.readConfig(fork);
      const start = await inspectRepositories(fork, repositories.map((repository) => repository.dir), this.input.signal);
      devServers = (await this.deps.startDevServers?.(fork, config, { network: config.network, signal: this.input.signal })) ?? null;
      const { outcome, checks } = await this.agentRounds(fork, config, repositories, start, devServers);
      if (this.readOnly || outcome.status !== 'completed') return resultOf(outcome);
      const delivered = await this.deliver(fork, repositories, start, checks, outcome.answer);
      const result = resultOf(outcome);
      if (this.mode === 'goal' && !checks.goalReached) {
        return { ...result, status: 'FAILED', error: `the goal's check did not hold after ${checks.rounds} iterations${delivered ? '; the pull requests hold the last attempt' : ''}` };
      }
      return result;
    } finally {
      await devServers?.stop().catch((error: unknown) => this.deps.logger.warn({ err: error }, 'stopping dev servers failed'));
      await clearTransfers(fork).catch(() => undefined);
      if (!this.readOnly) await forks.release(fork);
      else await forks.discard(fork);
    }
  }

  /** The config as this fork has it (a `dev_env` run may be repairing it, so a broken one is not fatal there). */
  private async readConfig(fork: Fork): Promise<EnvironmentConfig> {
    const result = await fork.run(['cat', '--', CONFIG_FILE], { timeoutMs: 30_000, signal: this.input.signal });
    const text = result.exitCode === 0 ? result.stdout : null;
    try {
      return parseEnvironmentConfig(text);
    } catch (error) {
      if (this.mode !== 'dev_env') throw error;
      await this.input.emit({ kind: 'message', data: { text: `The environment config is broken: ${(error as Error).message}` } });
      return parseEnvironmentConfig(null);
    }
  }

  /** A fresh fork of a task with open pull requests continues from their branches. */
  private async restoreBranches(fork: Fork, repositories: RepositoryRow[]): Promise<void> {
    const open = (await taskPullRequests(this.deps.db, this.input.task.id)).filter((pr) => pr.state === 'open' && pr.repositoryId);
    for (const pr of open) {
      const repository = repositories.find((candidate) => candidate.id === pr.repositoryId);
      if (!repository || !pr.headBranch || !pr.baseSha) continue;
      await restoreBranch(fork, this.deps.codeHost, {
        workspaceId: repository.workspaceId,
        fullName: repository.fullName,
        dir: repository.dir,
        branch: pr.headBranch,
        base: pr.baseSha,
        bundleName: `in-${repository.id}.bundle`,
      });
    }
  }

  private async manifest(fork: Fork, config: EnvironmentConfig, devServers: DevServers | null): Promise<RunManifest> {
    const { job, task, agent, signal } = this.input;
    const thread = await listMessages(this.deps.db, task.id);
    const history = thread
      .filter((message) => message.id !== job.messageId)
      .map((message) => ({ role: message.role === 'agent' ? ('assistant' as const) : ('user' as const), content: message.body }));
    const notes = [job.instructions, environmentNotes(config, devServers)].filter(Boolean).join('\n\n');
    return {
      input: job.input ?? '',
      history,
      mode: this.mode,
      agent,
      effort: (job.effort ?? task.effort) as Effort,
      instructions: notes || null,
      workspace: forkWorkspace(fork, { network: config.network, signal, readOnly: this.readOnly, ...(devServers ? { env: devServers.env() } : {}) }),
      signal,
    };
  }

  /**
   * Runs the agent, then the checks; failed checks go back to the agent as a new turn until they pass or
   * the rounds run out (a goal run's rounds are its iterations, each one's evidence in the journal).
   */
  private async agentRounds(
    fork: Fork,
    config: EnvironmentConfig,
    repositories: RepositoryRow[],
    start: RepositoryState[],
    devServers: DevServers | null,
  ): Promise<{ outcome: RunOutcome; checks: { proofs: Map<string, CheckProof[]>; goalReached: boolean; rounds: number } }> {
    const { harness, emit, job, signal } = this.input;
    const manifest = await this.manifest(fork, config, devServers);
    const effort = manifest.effort;
    const goalCheck = this.mode === 'goal' ? GOAL_CHECK.exec(job.input ?? '')?.[1] ?? null : null;
    const rounds = this.mode === 'goal' ? GOAL_ITERATIONS[effort] : 1 + CHECK_FIX_ROUNDS;
    let proofs = new Map<string, CheckProof[]>();
    let outcome: RunOutcome = { status: 'failed', error: 'the agent did not run' };
    for (let round = 1; round <= rounds; round++) {
      outcome = await harness.run(manifest, emit);
      if (outcome.status !== 'completed' || this.readOnly) return { outcome, checks: { proofs, goalReached: false, rounds: round } };
      const changed = await this.changedRepositories(fork, repositories, start);
      proofs = await this.verify(fork, config, changed, goalCheck, round, devServers);
      const failed = [...proofs.values()].flat().filter((proof) => !proof.passed);
      const goalReached = failed.length === 0;
      if (goalReached || round === rounds || signal.aborted) return { outcome, checks: { proofs, goalReached, rounds: round } };
      if (this.mode === 'goal' && (await creditBalance(this.deps.db, job.workspaceId)) <= 0) {
        await emit({ kind: 'message', data: { text: 'The workspace ran out of credits; the goal iterations stop here.' } });
        return { outcome, checks: { proofs, goalReached, rounds: round } };
      }
      manifest.history = [...manifest.history, { role: 'user', content: manifest.input }, { role: 'assistant', content: outcome.answer }];
      manifest.input = failureReport(failed, this.mode === 'goal');
    }
    return { outcome, checks: { proofs, goalReached: false, rounds } };
  }

  private async changedRepositories(fork: Fork, repositories: RepositoryRow[], start: RepositoryState[]): Promise<Array<{ repository: RepositoryRow; state: RepositoryState }>> {
    const now = await inspectRepositories(fork, repositories.map((repository) => repository.dir), this.input.signal);
    return repositories.flatMap((repository) => {
      const state = now.find((entry) => entry.dir === repository.dir);
      const before = start.find((entry) => entry.dir === repository.dir);
      return state && (state.dirty || state.head !== before?.head) ? [{ repository, state }] : [];
    });
  }

  /** The checks of every changed repository (or, in a goal run, the goal's own check), journaled. */
  private async verify(
    fork: Fork,
    config: EnvironmentConfig,
    changed: Array<{ repository: RepositoryRow }>,
    goalCheck: string | null,
    round: number,
    devServers: DevServers | null,
  ): Promise<Map<string, CheckProof[]>> {
    const options = { network: config.network, signal: this.input.signal, ...(devServers ? { env: devServers.env() } : {}) };
    const proofs = new Map<string, CheckProof[]>();
    const targets: Array<{ key: string; dir: string; checks: CheckSpec[] }> = goalCheck
      ? [{ key: 'goal', dir: '.', checks: [{ name: 'goal', command: goalCheck, timeoutSeconds: 600 }] }]
      : (this.mode === 'goal' ? config.repositories : changed.map(({ repository }) => config.repositories.find((spec) => spec.dir === repository.dir)))
          .filter((spec) => spec !== undefined)
          .map((spec) => ({ key: spec.name, dir: spec.dir, checks: spec.checks }));
    for (const target of targets) {
      const results = await runChecks(fork, target.dir, target.checks, options);
      proofs.set(target.key, results);
      for (const proof of results) await this.input.emit({ kind: 'check', data: { round, repository: target.key, ...proof } });
    }
    return proofs;
  }

  /** Commits, pushes and opens or updates a pull request for each repository the run changed. */
  private async deliver(fork: Fork, repositories: RepositoryRow[], start: RepositoryState[], checks: { proofs: Map<string, CheckProof[]> }, summary: string): Promise<number> {
    const { db, codeHost, publicUrl } = this.deps;
    const { job, task, emit, signal } = this.input;
    const open = (await taskPullRequests(db, task.id)).filter((pr) => pr.state === 'open');
    const branch = branchOf(task);
    let delivered = 0;
    for (const { repository } of await this.changedRepositories(fork, repositories, start)) {
      const existing = open.find((pr) => pr.repositoryId === repository.id);
      const baseSha = await codeHost.resolve(repository.workspaceId, repository.fullName, `refs/heads/${repository.defaultBranch}`);
      if (!baseSha) throw new Error(`${repository.fullName} has no ${repository.defaultBranch} branch on the code host`);
      const bundled = await commitAndBundle(fork, {
        dir: repository.dir,
        since: existing?.headSha ?? start.find((entry) => entry.dir === repository.dir)?.head ?? baseSha,
        message: task.title,
        bundleName: `out-${repository.id}.bundle`,
        signal,
      });
      if (!bundled) continue;
      try {
        await codeHost.receiveBranch(repository.workspaceId, repository.fullName, bundled.bundle, branch, bundled.head);
      } finally {
        await rm(dirname(bundled.bundle), { recursive: true, force: true });
      }
      const files = await codeHost.diffStat(repository.workspaceId, repository.fullName, baseSha, bundled.head);
      const proofs = checks.proofs.get(repository.fullName) ?? checks.proofs.get('goal') ?? [];
      const { pullRequest, opened } = await db.transaction((tx) =>
        recordPullRequestPush(tx, {
          taskId: task.id,
          repositoryId: repository.id,
          repoFullName: repository.fullName,
          jobId: job.id,
          title: task.title,
          body: proofMarkdown({ summary, files, checks: proofs, taskUrl: `${publicUrl}/tasks/${task.slug}` }),
          headBranch: branch,
          baseBranch: repository.defaultBranch,
          headSha: bundled.head,
          baseSha,
          checks: proofs,
          url: (number) => `${publicUrl}/repos/${repository.fullName}/pulls/${number}`,
        }),
      );
      delivered += 1;
      await emit({
        kind: 'pull_request',
        data: { repository: repository.fullName, number: pullRequest.prNumber, url: pullRequest.prUrl, branch, head: bundled.head, opened },
      });
    }
    return delivered;
  }
}

function environmentNotes(config: EnvironmentConfig, devServers: DevServers | null): string {
  const lines: string[] = [];
  if (config.repositories.length > 0) {
    lines.push('Repositories under /workspace (checks run after you finish):');
    for (const repository of config.repositories) {
      const checks = repository.checks.map((check) => `${check.name}: \`${check.command}\``).join(', ');
      lines.push(`- ${repository.dir}/ (${repository.name})${checks ? ` — ${checks}` : ''}`);
    }
  }
  for (const server of devServers?.servers ?? []) {
    lines.push(server.healthy ? `Dev server ${server.name} is running at ${server.url}.` : `Dev server ${server.name} did not start: ${server.error ?? 'unknown reason'}.`);
  }
  return lines.join('\n');
}

function failureReport(failed: CheckProof[], goal: boolean): string {
  const parts = failed.map((proof) => `### ${proof.name}: \`${proof.command}\` ${proof.timedOut ? 'timed out' : `exited ${proof.exitCode}`}\n\`\`\`text\n${proof.outputTail}\n\`\`\``);
  const lead = goal ? "The goal's check does not hold yet. Keep working towards the goal, then finish again." : 'The checks failed on your change. Fix the failures, then finish again.';
  return `${lead}\n\n${parts.join('\n\n')}`;
}
