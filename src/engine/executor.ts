/**
 * The cloud executor: claims jobs from the queue and runs each one — fork the workspace environment,
 * run the harness with the mode's instructions, stream its events into the journal, charge its model
 * usage, and complete the job. Several executors (processes, or slots in one) may run against one
 * database: a job is owned only through its claim, generation and lease.
 *
 * Not yet here (issue 3): verification, commits and pull requests, dev servers, fork lifecycle.
 */
import { mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { eq } from 'drizzle-orm';
import type { Logger } from 'pino';
import { BuiltinHarness } from '../agents/builtin.js';
import { forkWorkspace } from '../agents/fork-workspace.js';
import { resolveModel } from '../agents/models.js';
import type { AgentEvent, Harness, RunOutcome } from '../agents/types.js';
import { parseAgentId, type AgentId } from '../domain/agents.js';
import { priceOf } from '../domain/pricing.js';
import type { Effort, TaskMode } from '../protocol/rest.js';
import { ForkManager } from '../sandbox/fork.js';
import { creditBalance, recordUsage } from '../store/credits.js';
import type { Database } from '../store/db.js';
import { appendEvents, EVENTS_CHANNEL } from '../store/journal.js';
import { tasks } from '../store/schema.js';
import { insertMessage, listMessages, type JobRow } from '../store/tasks.js';
import { finishJob, StaleGenerationError, type JobResult } from './jobs.js';
import { claimNextJob, failExpiredLeases, JOBS_CHANNEL, renewLease } from './queue.js';

export interface ExecutorOptions {
  database: Database;
  /** Holds `environments/<workspace id>` and `forks/`. */
  dataDir: string;
  /** Names this executor in job leases. */
  owner: string;
  concurrency: number;
  leaseMs: number;
  /** Fallback wake-up for notifications missed while a LISTEN connection was down. */
  pollMs: number;
  allowUnsandboxed: boolean;
  /** Where model keys and base URLs come from (process.env by default). */
  modelEnv?: NodeJS.ProcessEnv;
  logger: Logger;
}

export class Executor {
  private readonly forks: ForkManager;
  private stopped = false;
  private wake: (() => void) | null = null;
  private readonly unlisten: Array<() => Promise<void>> = [];
  private readonly slots: Promise<void>[] = [];
  private readonly running = new Map<string, { job: JobRow; controller: AbortController }>();

  constructor(private readonly options: ExecutorOptions) {
    this.forks = new ForkManager(
      join(options.dataDir, 'forks'),
      { hiddenPaths: [options.dataDir], allowUnsandboxed: options.allowUnsandboxed },
      (message) => options.logger.info(message),
    );
  }

  async start(): Promise<void> {
    this.unlisten.push(await this.options.database.listen(JOBS_CHANNEL, () => this.wake?.()));
    // A task's events channel also carries cancel: check the lease of its running job at once, so a
    // cancelled run stops (its process group killed) within moments rather than at the next renewal.
    this.unlisten.push(await this.options.database.listen(EVENTS_CHANNEL, (taskId) => this.recheck(taskId)));
    for (let slot = 0; slot < this.options.concurrency; slot++) this.slots.push(this.loop());
  }

  /** Stops claiming, aborts running jobs (they end FAILED or stay with a new owner's lease) and waits. */
  async stop(): Promise<void> {
    this.stopped = true;
    for (const { controller } of this.running.values()) controller.abort();
    this.wake?.();
    await Promise.all(this.slots);
    await Promise.all(this.unlisten.map((stop) => stop()));
  }

  private recheck(taskId: string): void {
    for (const { job, controller } of this.running.values()) {
      if (job.taskId !== taskId || controller.signal.aborted) continue;
      renewLease(this.options.database.db, job.id, job.generation, this.options.leaseMs).then(
        (held) => held || controller.abort(),
        (error: unknown) => this.options.logger.warn({ err: error, jobId: job.id }, 'checking a lease failed'),
      );
    }
  }

  private async loop(): Promise<void> {
    const db = this.options.database.db;
    while (!this.stopped) {
      let job: JobRow | null = null;
      try {
        await failExpiredLeases(db);
        job = await claimNextJob(db, { owner: this.options.owner, leaseMs: this.options.leaseMs });
      } catch (error) {
        this.options.logger.error({ err: error }, 'claiming a job failed');
      }
      if (job) {
        await this.execute(job);
        continue;
      }
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, this.options.pollMs);
        this.wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.wake = null;
    }
  }

  private async execute(job: JobRow): Promise<void> {
    const db = this.options.database.db;
    const log = this.options.logger.child({ jobId: job.id, taskId: job.taskId, generation: job.generation });
    const controller = new AbortController();
    this.running.set(job.id, { job, controller });
    // Renew the lease while the job runs; a refused renewal (cancelled, or taken over) stops the run.
    const renewal = setInterval(() => {
      renewLease(db, job.id, job.generation, this.options.leaseMs).then(
        (held) => held || controller.abort(),
        (error: unknown) => log.warn({ err: error }, 'lease renewal failed'),
      );
    }, Math.max(1000, Math.floor(this.options.leaseMs / 3)));
    let sequence = 0;
    let agent: AgentId | null = null;
    const emit = async (event: AgentEvent) => {
      const result = await appendEvents(db, { jobId: job.id, generation: job.generation, firstSequence: sequence + 1, events: [event] });
      if (!result.ok) {
        controller.abort();
        throw new Error(`journal refused the event: ${result.message}`);
      }
      sequence += 1;
      if (event.kind === 'usage' && agent) {
        await recordUsage(db, { workspaceId: job.workspaceId, jobId: job.id, agentId: job.agent ?? '', agent, ...event.data });
      }
    };
    try {
      const result = await this.run(job, emit, controller.signal, (parsed) => (agent = parsed));
      await finishJob(db, job.id, job.generation, result);
      if (result.status === 'COMPLETED' && (result.finalAnswer ?? result.plan)) {
        await insertMessage(db, { taskId: job.taskId, role: 'agent', body: result.plan ?? result.finalAnswer ?? '' });
      }
      log.info({ status: result.status }, 'job finished');
    } catch (error) {
      if (error instanceof StaleGenerationError || controller.signal.aborted) {
        log.info('job was cancelled or taken over; its result is dropped');
      } else {
        log.error({ err: error }, 'job failed');
        await finishJob(db, job.id, job.generation, { status: 'FAILED', error: `executor error: ${(error as Error).message}` }).catch(() => undefined);
      }
    } finally {
      clearInterval(renewal);
      this.running.delete(job.id);
    }
  }

  private async run(
    job: JobRow,
    emit: (event: AgentEvent) => Promise<void>,
    signal: AbortSignal,
    setAgent: (agent: AgentId) => void,
  ): Promise<JobResult> {
    const db = this.options.database.db;
    const [task] = await db.select().from(tasks).where(eq(tasks.id, job.taskId));
    if (!task) return { status: 'FAILED', error: 'the task of this job no longer exists' };
    const parsed = parseAgentId(job.agent ?? task.agent);
    if ('error' in parsed) return { status: 'FAILED', error: `agent ${job.agent}: ${parsed.error}` };
    setAgent(parsed);
    const billed = priceOf(parsed).input > 0 || priceOf(parsed).output > 0;
    if (billed && (await creditBalance(db, job.workspaceId)) <= 0) {
      return { status: 'FAILED', error: 'the workspace has no credits left; an operator can add some with `svc admin credits grant`' };
    }
    let harness: Harness;
    try {
      const model = resolveModel(parsed, this.options.modelEnv ?? process.env);
      harness = new BuiltinHarness({ model: () => model });
    } catch (error) {
      return { status: 'FAILED', error: (error as Error).message };
    }

    const environment = join(this.options.dataDir, 'environments', job.workspaceId);
    await mkdir(environment, { recursive: true });
    const fork = await this.forks.create(`job-${job.id}-${job.generation}`, environment);
    const mode = modeOfJob(job.type, task.mode as TaskMode);
    // Read-only runs leave nothing worth keeping. A changing run's fork holds its work, which must outlive
    // the job: until the fork lifecycle and pull requests exist (issue 3), it is kept where the log says.
    const keepFork = mode !== 'ask' && mode !== 'plan';
    try {
      const thread = await listMessages(db, task.id);
      const history = thread
        .filter((message) => message.id !== job.messageId)
        .map((message) => ({ role: message.role === 'agent' ? ('assistant' as const) : ('user' as const), content: message.body }));
      const outcome = await harness.run(
        {
          input: job.input ?? '',
          history,
          mode,
          agent: parsed,
          effort: (job.effort ?? task.effort) as Effort,
          instructions: job.instructions,
          workspace: forkWorkspace(fork, { network: false, signal }),
          signal,
        },
        emit,
      );
      return resultOf(outcome);
    } finally {
      if (keepFork) this.options.logger.info({ jobId: job.id, fork: fork.info.dir }, 'fork kept with the job\'s changes');
      else await this.forks.remove(fork);
    }
  }
}

function modeOfJob(type: string, taskMode: TaskMode): TaskMode {
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

function resultOf(outcome: RunOutcome): JobResult {
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

