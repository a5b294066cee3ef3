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
import { isAgentCli, isReadOnlyMode, modeOfJobType, type AgentId } from '../domain/agents.js';
import type { Effort, JobType, TaskMode } from '../protocol/rest.js';
import { EFFORT } from '../agents/effort.js';
import { parseEnvironmentConfig, type CheckSpec, type EnvironmentConfig } from '../sandbox/environment.js';
import type { EnvironmentVersion } from '../sandbox/environment-versions.js';
import type { EnvironmentSnapshot, Fork } from '../sandbox/fork.js';
import { creditBalance } from '../store/credits.js';
import type { Db } from '../store/db.js';
import { recordPullRequestPush, taskPullRequests } from '../store/pull-requests.js';
import { listRepositories, type RepositoryRow } from '../store/repositories.js';
import type { CheckProof } from '../store/schema.js';
import { listMessages, type JobRow, type PullRequestRow, type TaskRow } from '../store/tasks.js';
import { findWorkspace } from '../store/workspaces.js';
import {
  bringBranch,
  clearTransfers,
  commitAndBundle,
  inspectRepositories,
  KNOWN_IN_FORK,
  proofMarkdown,
  READ_REPOSITORIES,
  restoreBranch,
  runChecks,
  targetArgument,
  TRANSFER_DIR,
  unreadableOf,
  type UnreadableRepository,
} from './delivery.js';
import { ENVIRONMENT_DIR, type Environments } from './environments.js';
import { Handoff } from './runners/delegation.js';
import { assertJobHeld, type JobResult } from './jobs.js';

/** Where a task's forks come from: the fork lifecycle keeps one per task between its jobs. */
export interface TaskForks {
  acquire(input: { workspaceId: string; taskId: string; name: string; jobId: string; environment: EnvironmentSnapshot }): Promise<{ fork: Fork; fresh: boolean; outdated: boolean }>;
  renew(fork: Fork, environment: EnvironmentSnapshot): Promise<Fork>;
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
  environments: Environments;
  publicUrl: string;
  forks: TaskForks;
  codeHost: LocalCodeHost;
  startDevServers?: StartDevServers;
  logger: Logger;
}

/** Extra agent rounds after failed checks in `agent` and `dev_env` mode. */
export const CHECK_FIX_ROUNDS = 2;
/**
 * Ignored directories that hold what installs and builds make again (dependencies, build output, caches):
 * a fresh fork has the environment's own, so what the agent left in them is not work a renewal loses.
 * Any other ignored file in a fork counts as work (docs/execution.md "Forks").
 */
const REGENERATED_DIRS = ['node_modules', 'dist', 'build', 'out', 'target', '.cache', '__pycache__', '.venv', 'venv', '.next', '.nuxt', '.turbo', '.parcel-cache', '.pytest_cache', '.mypy_cache', '.ruff_cache', '.tox', '.gradle', 'coverage', '.nyc_output'];
/** A goal's check, written on a line of the task: `check: npm test -- login`. */
const GOAL_CHECK = /^\s*(?:goal\s+)?check:\s*(.+?)\s*$/im;
/** The proofs key of a goal's own check (no repository directory is empty). */
const GOAL = '';

/** The goal's check: the latest one written in the thread (the new message first). */
export function goalCheckOf(messages: readonly string[]): string | null {
  for (const message of messages) {
    const check = GOAL_CHECK.exec(message)?.[1];
    if (check) return check;
  }
  return null;
}

/** What the last round of a run found: the changed repositories, their checks' proofs, whether all passed. */
interface Checked {
  proofs: Map<string, CheckProof[]>;
  changed: Target[];
  /** Repositories git could not read: whatever they hold is not delivered, and the job fails naming them. */
  unreadable: Array<{ target: Target; failure: UnreadableRepository }>;
  goalReached: boolean;
  rounds: number;
}

/** A repository of the workspace, its directory in the fork, and the commits the code host has of it. */
interface Target {
  repository: RepositoryRow;
  dir: string;
  known: string[];
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
  /** What the agent is told about the state its fork was found in (closed pull requests, say). */
  private readonly forkNotes: string[] = [];

  constructor(
    private readonly deps: JobRunDeps,
    private readonly input: RunInput,
  ) {
    this.mode = modeOfJobType(input.job.type as JobType);
    this.readOnly = isReadOnlyMode(this.mode);
  }

  async execute(): Promise<JobResult> {
    const { db, environments, forks } = this.deps;
    const { job, task } = this.input;
    const workspace = await findWorkspace(db, job.workspaceId);
    if (!workspace) return { status: 'FAILED', error: 'the workspace of this job no longer exists' };
    const environment = await environments.ensure(workspace);
    const repositories = await listRepositories(db, job.workspaceId);
    const acquired = await forks.acquire({ workspaceId: job.workspaceId, taskId: task.id, name: task.slug, jobId: job.id, environment });
    let { fork, fresh } = acquired;
    let devServers: DevServers | null = null;
    try {
      const pullRequests = await taskPullRequests(this.deps.db, task.id);
      const open = pullRequests.filter((pr) => pr.state === 'open');
      const targets = await this.targetsOf(repositories, open);
      if (acquired.outdated) ({ fork, fresh } = await this.renewIfSafe(fork, environment, targets));
      if (fresh) await this.restoreBranches(fork, repositories, open);
      else if (!this.readOnly) await this.setClosedWorkAside(fork, repositories, pullRequests);
      const handoffProblem = await this.checkOutHandoff(fork, repositories);
      if (handoffProblem) return { status: 'FAILED', error: handoffProblem };
      const config = await this.readConfig(environment);
      devServers = (await this.deps.startDevServers?.(fork, config, { network: config.network, signal: this.input.signal })) ?? null;
      const { outcome, checks } = await this.agentRounds(fork, config, targets, devServers);
      if (this.readOnly || outcome.status !== 'completed') return resultOf(outcome);
      const delivered = await this.deliver(fork, checks, outcome.answer);
      const result = resultOf(outcome);
      if (checks.unreadable.length > 0) {
        const others = delivered > 0 ? `; the pull requests of the other repositories (${delivered}) were pushed` : '';
        return { ...result, status: 'FAILED', error: `${checks.unreadable.map(undeliveredText).join('; ')}${others}` };
      }
      if (this.mode === 'goal' && !checks.goalReached) {
        return { ...result, status: 'FAILED', error: `the goal's check did not hold after ${checks.rounds} iterations${delivered ? '; the pull requests hold the last attempt' : ''}` };
      }
      return result;
    } finally {
      await devServers?.stop().catch((error: unknown) => this.deps.logger.warn({ err: error }, 'stopping dev servers failed'));
      await clearTransfers(fork).catch(() => undefined);
      // A read-only run leaves nothing, so its own fresh fork goes at once; the task's kept fork stays.
      if (this.readOnly && fresh) await forks.discard(fork);
      else await forks.release(fork);
    }
  }

  /**
   * A kept fork of an older environment version (merges or setups landed since) is replaced with a fresh
   * fork of the current one when that loses nothing (`unsavedWork`; what its open pull requests hold
   * comes back with their branches). Otherwise the task goes on in its fork as it is, and the journal
   * says why.
   */
  private async renewIfSafe(fork: Fork, environment: EnvironmentVersion, targets: Target[]): Promise<{ fork: Fork; fresh: boolean }> {
    const unsaved = await this.unsavedWork(fork, targets);
    if (unsaved.size === 0) return { fork: await this.deps.forks.renew(fork, environment), fresh: true };
    const nameOf = (dir: string) => targets.find((target) => target.dir === dir)?.repository.fullName ?? dir;
    const details = [...unsaved].map(([dir, what]) => `${nameOf(dir)} has ${what.join(', ')}`);
    await this.input.emit({
      kind: 'message',
      data: {
        text:
          `The environment changed since this task's fork was made (version ${fork.info.lower.version}, now ${environment.version}), but the fork holds work ` +
          `that is in no pull request yet (${[...unsaved.keys()].map(nameOf).join(', ')}), so the task goes on in it as it is: ${details.join('; ')}.`,
      },
    });
    return { fork, fresh: false };
  }

  /**
   * What a fresh fork would lose, by repository directory: uncommitted changes, commits the code host lacks
   * on HEAD, a stash, any other branch or tag with commits the code host lacks, work set aside from a
   * closed pull request (`svc-closed/*`, kept whatever it points at: the agent was told it is there), and
   * ignored files outside dependency and build directories (`REGENERATED_DIRS`: a `.env.local` the agent
   * wrote). A repository whose HEAD is unborn is looked at all the same. Refs or a working tree that
   * cannot be read count as work too.
   */
  private async unsavedWork(fork: Fork, targets: Target[]): Promise<Map<string, string[]>> {
    const unsaved = new Map<string, string[]>();
    const add = (dir: string, what: string) => unsaved.set(dir, [...(unsaved.get(dir) ?? []), what]);
    // It skips a repository whose HEAD is unborn: the script below looks at that one's working tree.
    const unreadable = new Map<string, string>();
    for (const state of await inspectRepositories(fork, targets, this.input.signal)) {
      if ('what' in state) {
        unreadable.set(state.dir, state.what);
        continue;
      }
      if (state.dirty) add(state.dir, 'uncommitted changes');
      if (state.ahead > 0) add(state.dir, `${state.ahead} commit${state.ahead === 1 ? '' : 's'} the code host lacks`);
    }
    if (targets.length === 0) return unsaved;
    const regenerated = REGENERATED_DIRS.flatMap((name) => [`*/${name}`, `*/${name}/*`]).join('|');
    const script = [
      READ_REPOSITORIES,
      'for t in "$@"; do',
      '  d=${t%%:*}; shas=${t#*:}',
      '  enter || continue',
      `  ${KNOWN_IN_FORK}`,
      // Captured first: the status of a pipeline is its last command's, which would hide git's failure.
      '  refs=$(git for-each-ref --format="%(refname)" refs/heads refs/tags 2>"$e") || { unreadable "refs that could not be read"; continue; }',
      '  st=$(git -c core.quotePath=false status --porcelain --ignored=matching 2>"$e") || { unreadable "a working tree that could not be read"; continue; }',
      '  git rev-parse -q --verify HEAD >/dev/null || { printf "%s\n" "$st" | grep -q "^[^!]" && printf "%s\tuncommitted changes\n" "$d"; }',
      '  printf "%s\n" "$st" | while IFS= read -r l; do',
      '    case "$l" in "!! "*) p=${l#"!! "};; *) continue;; esac',
      `    case "/$p" in ${regenerated}) continue;; esac`,
      // The environment's root ignores svc's transfers and the working copies, each looked at on its own.
      `    [ "$d" = '${ENVIRONMENT_DIR}' ] && { [ "$p" = '${TRANSFER_DIR}/' ] || [ -e "$p.git" ]; } && continue`,
      '    printf "%s\tignored %s %s\n" "$d" "$(case "$p" in */) echo directory;; *) echo file;; esac)" "${p%/}"',
      '  done',
      '  git rev-parse -q --verify refs/stash >/dev/null && printf "%s\tstash\n" "$d"',
      // The checked-out branch is HEAD, counted above.
      '  h=$(git symbolic-ref -q HEAD)',
      '  printf "%s\n" "$refs" | while read -r r; do',
      '    case "$r" in "") continue;; refs/heads/svc-closed/*) printf "%s\tset-aside branch %s\n" "$d" "${r#refs/heads/}"; continue;; esac',
      '    [ "$r" = "$h" ] && continue',
      '    n=$(git rev-list --count "$r" --not $nots 2>/dev/null) || n=unknown',
      '    [ "$n" = 0 ] || printf "%s\t%s %s\n" "$d" "$(case "$r" in refs/tags/*) echo tag;; *) echo branch;; esac)" "${r#refs/*/}"',
      '  done',
      'done',
    ].join('\n');
    const result = await fork.run(['sh', '-c', script, 'sh', ...targets.map(targetArgument)], { timeoutMs: 120_000, signal: this.input.signal });
    if (result.exitCode !== 0) {
      for (const target of targets) add(target.dir, 'refs that could not be read');
      return unsaved;
    }
    for (const line of result.stdout.split('\n').filter(Boolean)) {
      const failure = unreadableOf(line);
      if (failure) unreadable.delete(failure.dir);
      const [dir, what] = failure ? [failure.dir, failure.what] : line.split('\t');
      if (dir && what) add(dir, what);
    }
    // What the script did not find unreadable itself (a broken HEAD, say).
    for (const [dir, what] of unreadable) add(dir, what);
    return unsaved;
  }

  /**
   * The environment's config as the environment has it, not as the fork does: the agent may edit the
   * fork's copy, but its network policy and checks apply only once a person merged the change. A broken
   * config is not fatal to a `dev_env` run, which is there to repair it.
   */
  private async readConfig(environment: EnvironmentVersion): Promise<EnvironmentConfig> {
    try {
      return parseEnvironmentConfig(environment.record.config);
    } catch (error) {
      if (this.mode !== 'dev_env') throw error;
      await this.input.emit({ kind: 'message', data: { text: `The environment config is broken: ${(error as Error).message}` } });
      return parseEnvironmentConfig(null);
    }
  }

  /**
   * A fresh fork of a task with open pull requests continues from their branches. A branch that cannot be
   * restored is said in the journal; the run goes on from the environment as it is.
   */
  private async restoreBranches(fork: Fork, repositories: RepositoryRow[], open: PullRequestRow[]): Promise<void> {
    for (const pr of open) {
      const repository = repositories.find((candidate) => candidate.id === pr.repositoryId);
      if (!repository || !pr.headBranch || !pr.baseSha) continue;
      try {
        await restoreBranch(fork, this.deps.codeHost, {
          workspaceId: repository.workspaceId,
          fullName: repository.fullName,
          dir: repository.dir,
          branch: pr.headBranch,
          base: pr.baseSha,
          bundleName: `in-${repository.id}.bundle`,
        });
      } catch (error) {
        this.deps.logger.warn({ err: error, repository: repository.fullName }, 'restoring a task branch failed');
        await this.input.emit({ kind: 'message', data: { text: `The branch ${pr.headBranch} of ${repository.fullName} could not be restored: ${(error as Error).message}` } });
      }
    }
  }

  /**
   * Work handed off from a local run (its message's `metadata.handoff`, engine/runners/delegation.ts)
   * starts from exactly the commits handed off: each branch is brought from the code host and checked out.
   * A branch that moved since, or a checkout that is not that commit, fails the job naming the branch
   * rather than let the agent work on other code than the one handed over. Answers the failure, if any.
   */
  private async checkOutHandoff(fork: Fork, repositories: RepositoryRow[]): Promise<string | null> {
    const { db, codeHost, environments } = this.deps;
    const { job, signal } = this.input;
    if (!job.messageId) return null;
    const message = (await listMessages(db, job.taskId)).find((candidate) => candidate.id === job.messageId);
    const handoff = Handoff.safeParse((message?.metadata as { handoff?: unknown } | null | undefined)?.handoff);
    if (!handoff.success) return null;
    const heads = environments.store(job.workspaceId).read(fork.info.lower.version)?.record.heads ?? {};
    for (const { repository: fullName, branch, commit } of handoff.data.branches) {
      const repository = repositories.find((candidate) => candidate.fullName === fullName);
      if (!repository) return `the handed-off repository ${fullName} is not connected to this workspace any more`;
      const moved = (now: string | null) =>
        `the branch ${branch} of ${fullName} moved since the handoff (handed off at ${commit}, now ${now ?? 'deleted'}); hand the work off again from the local task`;
      const head = await codeHost.resolve(job.workspaceId, fullName, `refs/heads/${branch}`);
      if (head !== commit) return moved(head);
      const start = heads[repository.dir] ?? null;
      try {
        if (start === commit) {
          // The environment's working copy is at that commit already: the code host has nothing to send.
          const result = await fork.run(['sh', '-c', 'cd "/workspace/$1" && git checkout --quiet -B "$2" "$3"', 'sh', repository.dir, branch, commit], { timeoutMs: 120_000, signal });
          if (result.exitCode !== 0) throw new Error(result.stderr.trim() || `git checkout exited ${result.exitCode}`);
        } else {
          // Only a commit the code host has can bound the bundle (the working copy may hold an operator's own).
          const base = start && (await codeHost.resolve(job.workspaceId, fullName, start)) ? start : null;
          await bringBranch(fork, codeHost, { workspaceId: job.workspaceId, fullName, dir: repository.dir, branch, base, bundleName: `handoff-${repository.id}.bundle`, apply: 'checkout' });
        }
      } catch (error) {
        return `the handed-off branch ${branch} of ${fullName} could not be checked out: ${(error as Error).message}`;
      }
      const checkedOut = (await fork.run(['git', 'rev-parse', 'HEAD'], { cwd: repository.dir, timeoutMs: 60_000, signal })).stdout.trim();
      if (checkedOut !== commit) return moved(await codeHost.resolve(job.workspaceId, fullName, `refs/heads/${branch}`));
      await this.input.emit({ kind: 'message', data: { text: `Checked out the handed-off branch ${branch} of ${fullName} at ${commit}.` } });
    }
    return null;
  }

  /**
   * A person closed the task's pull request in a repository without merging it: the work it held was
   * turned down, so the task's fork puts it aside (on a branch `svc-closed/<number>`) and the repository
   * goes back to where the fork started, so that the next pull request does not carry it again. Only
   * done when the repository holds nothing uncommitted, which it keeps otherwise (and says so).
   */
  private async setClosedWorkAside(fork: Fork, repositories: RepositoryRow[], pullRequests: PullRequestRow[]): Promise<void> {
    const version = this.deps.environments.store(this.input.job.workspaceId).read(fork.info.lower.version);
    for (const repository of repositories) {
      const latest = pullRequests.filter((pr) => pr.repositoryId === repository.id).at(-1);
      const start = version?.record.heads[repository.dir];
      if (!latest || latest.state !== 'closed' || !latest.headSha || !start) continue;
      const script = [
        'cd "/workspace/$1" || exit 0',
        'git merge-base --is-ancestor "$2" HEAD 2>/dev/null || exit 0',
        '[ -z "$(git status --porcelain)" ] || { echo dirty; exit 0; }',
        'git branch -f "svc-closed/$4" HEAD && git reset --quiet --hard "$3" && echo reset',
      ].join('\n');
      const result = await fork.run(['sh', '-c', script, 'sh', repository.dir, latest.headSha, start, String(latest.prNumber)], { timeoutMs: 60_000, signal: this.input.signal });
      const said = result.stdout.trim();
      const text =
        said === 'reset'
          ? `Pull request #${latest.prNumber} of ${repository.fullName} was closed without being merged, so its work was set aside on the branch svc-closed/${latest.prNumber} and ${repository.dir}/ was reset to where this task started.`
          : said === 'dirty'
            ? `Pull request #${latest.prNumber} of ${repository.fullName} was closed without being merged, but ${repository.dir}/ has uncommitted changes, so its work is still checked out.`
            : null;
      if (result.exitCode !== 0) this.deps.logger.warn({ repository: repository.fullName, stderr: result.stderr }, 'setting closed work aside failed');
      if (!text) continue;
      this.forkNotes.push(text);
      await this.input.emit({ kind: 'message', data: { text } });
    }
  }

  /** Each repository with the commits the code host has of it: its default branch's recent history and the task's open branch. */
  private async targetsOf(repositories: RepositoryRow[], open: PullRequestRow[]): Promise<Target[]> {
    return Promise.all(
      repositories.map(async (repository) => {
        const pr = open.find((candidate) => candidate.repositoryId === repository.id);
        const branches = [repository.defaultBranch, ...(pr?.headBranch ? [pr.headBranch] : [])];
        const known = await this.deps.codeHost.knownCommits(repository.workspaceId, repository.fullName, branches);
        return { repository, dir: repository.dir, known };
      }),
    );
  }

  private async manifest(fork: Fork, config: EnvironmentConfig, devServers: DevServers | null): Promise<RunManifest> {
    const { job, task, agent, signal } = this.input;
    const thread = await listMessages(this.deps.db, task.id);
    const history = thread
      .filter((message) => message.id !== job.messageId)
      .map((message) => ({ role: message.role === 'agent' ? ('assistant' as const) : ('user' as const), content: message.body }));
    const notes = [job.instructions, environmentNotes(config, devServers, agent), ...this.forkNotes].filter(Boolean).join('\n\n');
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
    targets: Target[],
    devServers: DevServers | null,
  ): Promise<{ outcome: RunOutcome; checks: Checked }> {
    const { harness, emit, job, signal } = this.input;
    const manifest = await this.manifest(fork, config, devServers);
    const effort = manifest.effort;
    const goalCheck = this.mode === 'goal' ? goalCheckOf([manifest.input, ...manifest.history.filter((turn) => turn.role === 'user').map((turn) => turn.content).reverse()]) : null;
    const rounds = this.mode === 'goal' ? EFFORT[effort].goalIterations : 1 + CHECK_FIX_ROUNDS;
    let outcome: RunOutcome = { status: 'failed', error: 'the agent did not run' };
    for (let round = 1; ; round++) {
      outcome = await harness.run(manifest, emit);
      if (outcome.status !== 'completed' || this.readOnly) return { outcome, checks: { proofs: new Map(), changed: [], unreadable: [], goalReached: false, rounds: round } };
      const { changed, unreadable } = await this.changedRepositories(fork, targets);
      const proofs = await this.verify(fork, config, changed, goalCheck, round, devServers);
      const failed = [...proofs.values()].flat().filter((proof) => !proof.passed);
      const checks = { proofs, changed, unreadable, goalReached: failed.length === 0, rounds: round };
      if (checks.goalReached || round >= rounds || signal.aborted) return { outcome, checks };
      if (this.mode === 'goal' && (await creditBalance(this.deps.db, job.workspaceId)) <= 0) {
        await emit({ kind: 'message', data: { text: 'The workspace ran out of credits; the goal iterations stop here.' } });
        return { outcome, checks };
      }
      manifest.history = [...manifest.history, { role: 'user', content: manifest.input }, { role: 'assistant', content: outcome.answer }];
      manifest.input = failureReport(failed, this.mode === 'goal');
    }
  }

  /** The repositories whose fork has uncommitted changes or commits the code host does not have, and those git could not read. */
  private async changedRepositories(fork: Fork, targets: Target[]): Promise<Pick<Checked, 'changed' | 'unreadable'>> {
    const states = await inspectRepositories(fork, targets, this.input.signal);
    const changed: Target[] = [];
    const unreadable: Checked['unreadable'] = [];
    for (const target of targets) {
      const state = states.find((candidate) => candidate.dir === target.dir);
      if (!state) continue;
      if ('what' in state) unreadable.push({ target, failure: state });
      else if (state.dirty || state.ahead > 0) changed.push(target);
    }
    return { changed, unreadable };
  }

  /** The checks of every changed repository (or, in a goal run, the goal's own check), journaled. */
  private async verify(
    fork: Fork,
    config: EnvironmentConfig,
    changed: Target[],
    goalCheck: string | null,
    round: number,
    devServers: DevServers | null,
  ): Promise<Map<string, CheckProof[]>> {
    const options = { network: config.network, signal: this.input.signal, ...(devServers ? { env: devServers.env() } : {}) };
    const proofs = new Map<string, CheckProof[]>();
    // Proofs are keyed by the repository's directory (GOAL for a goal's own check).
    const targets: Array<{ dir: string; name: string; checks: CheckSpec[] }> = goalCheck
      ? [{ dir: GOAL, name: 'goal', checks: [{ name: 'goal', command: goalCheck, timeoutSeconds: 600 }] }]
      : (this.mode === 'goal' ? config.repositories : changed.map(({ dir }) => config.repositories.find((spec) => spec.dir === dir)))
          .filter((spec) => spec !== undefined)
          .map((spec) => ({ dir: spec.dir, name: spec.name, checks: spec.checks }));
    for (const target of targets) {
      const results = await runChecks(fork, target.dir === GOAL ? '.' : target.dir, target.checks, options);
      proofs.set(target.dir, results);
      for (const proof of results) await this.input.emit({ kind: 'check', data: { round, repository: target.name, ...proof } });
    }
    return proofs;
  }

  /**
   * Commits, pushes and opens or updates a pull request for each repository the last round found changed;
   * the journal says which repositories git could not read, and so were not delivered.
   */
  private async deliver(fork: Fork, checks: Checked, summary: string): Promise<number> {
    const { db, codeHost, publicUrl } = this.deps;
    const { job, task, emit, signal } = this.input;
    const branch = branchOf(task);
    let delivered = 0;
    for (const target of checks.changed) {
      const { repository } = target;
      const baseSha = await codeHost.resolve(repository.workspaceId, repository.fullName, `refs/heads/${repository.defaultBranch}`);
      if (!baseSha) throw new Error(`${repository.fullName} has no ${repository.defaultBranch} branch on the code host`);
      const bundled = await commitAndBundle(fork, { ...target, message: task.title, bundleName: `out-${repository.id}.bundle`, signal });
      if (!bundled) continue;
      // A job that was cancelled or lost its lease meanwhile pushes nothing.
      await assertJobHeld(db, job.id, job.generation);
      try {
        await codeHost.receiveBranch(repository.workspaceId, repository.fullName, bundled.bundle, branch, bundled.head);
      } finally {
        await rm(dirname(bundled.bundle), { recursive: true, force: true });
      }
      const files = await codeHost.diffStat(repository.workspaceId, repository.fullName, baseSha, bundled.head);
      const proofs = checks.proofs.get(repository.dir) ?? checks.proofs.get(GOAL) ?? [];
      const { pullRequest, opened } = await db.transaction(async (tx) => {
        await assertJobHeld(tx, job.id, job.generation, true);
        return recordPullRequestPush(tx, {
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
        });
      });
      delivered += 1;
      await emit({
        kind: 'pull_request',
        data: { repository: repository.fullName, number: pullRequest.prNumber, url: pullRequest.prUrl, branch, head: bundled.head, opened },
      });
    }
    for (const unreadable of checks.unreadable) await emit({ kind: 'message', data: { text: `${undeliveredText(unreadable)}.` } });
    return delivered;
  }
}

/**
 * What the agent is told about its environment. An agent CLI in a fork with network access cannot reach
 * the dev servers (they run on the fork's network, which reaches the outside; the CLI's reaches only its
 * provider), so it is told they run for the checks rather than given a URL it cannot open.
 */
export function environmentNotes(config: EnvironmentConfig, devServers: DevServers | null, agent: AgentId): string {
  const unreachable = config.network && isAgentCli(agent.provider);
  const lines: string[] = [];
  if (config.repositories.length > 0) {
    lines.push('Repositories under /workspace (checks run after you finish):');
    for (const repository of config.repositories) {
      const checks = repository.checks.map((check) => `${check.name}: \`${check.command}\``).join(', ');
      lines.push(`- ${repository.dir}/ (${repository.name})${checks ? ` — ${checks}` : ''}`);
    }
  }
  for (const server of devServers?.servers ?? []) {
    if (!server.healthy) lines.push(`Dev server ${server.name} did not start: ${server.error ?? 'unknown reason'}.`);
    else if (unreachable) lines.push(`Dev server ${server.name} is running for the checks; your sandbox cannot reach it.`);
    else lines.push(`Dev server ${server.name} is running at ${server.url}.`);
  }
  return lines.join('\n');
}

/** Why a repository git could not read was not delivered, naming it and quoting git. */
function undeliveredText({ target, failure }: Checked['unreadable'][number]): string {
  return `${target.repository.fullName} has ${failure.what} in the fork, so nothing of it was delivered${failure.detail ? ` (git: ${failure.detail})` : ''}`;
}

function failureReport(failed: CheckProof[], goal: boolean): string {
  const parts = failed.map((proof) => `### ${proof.name}: \`${proof.command}\` ${proof.timedOut ? 'timed out' : `exited ${proof.exitCode}`}\n\`\`\`text\n${proof.outputTail}\n\`\`\``);
  const lead = goal ? "The goal's check does not hold yet. Keep working towards the goal, then finish again." : 'The checks failed on your change. Fix the failures, then finish again.';
  return `${lead}\n\n${parts.join('\n\n')}`;
}
