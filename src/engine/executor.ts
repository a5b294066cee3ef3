/**
 * The cloud executor: claims jobs from the queue and runs each one — fork the workspace environment,
 * run the harness with the mode's instructions, stream its events into the journal, charge its model
 * usage, and complete the job. Several executors (processes, or slots in one) may run against one
 * database: a job is owned only through its claim, generation and lease.
 *
 * What a job does inside its fork is JobRun's (job-run.ts); this file is the claiming, leases and journal.
 */
import { eq } from 'drizzle-orm';
import type { Logger } from 'pino';
import { CredentialProxy } from '../agents/credential-proxy.js';
import { harnessFor } from '../agents/registry.js';
import type { AgentEvent, Harness } from '../agents/types.js';
import { parseAgentId, type AgentId } from '../domain/agents.js';
import { priceOf } from '../domain/pricing.js';
import { creditBalance, recordUsage } from '../store/credits.js';
import type { Database } from '../store/db.js';
import { appendEvents, EVENTS_CHANNEL } from '../store/journal.js';
import { tasks } from '../store/schema.js';
import { insertMessage, type JobRow } from '../store/tasks.js';
import type { Environments } from './environments.js';
import { JobRun, type JobRunDeps, type StartDevServers, type TaskForks } from './job-run.js';
import { finishJob, StaleGenerationError, type JobResult } from './jobs.js';
import { claimNextJob, failExpiredLeases, JOBS_CHANNEL, renewLease } from './queue.js';

export interface ExecutorOptions {
  database: Database;
  /** The workspace environments jobs fork. */
  environments: Environments;
  /** Names this executor in job leases. */
  owner: string;
  concurrency: number;
  leaseMs: number;
  /** Fallback wake-up for notifications missed while a LISTEN connection was down. */
  pollMs: number;
  /** The address people reach the service at: task and pull request links. */
  publicUrl: string;
  /** The task forks (the fork lifecycle). */
  forks: TaskForks;
  startDevServers?: StartDevServers;
  /** Where model keys and base URLs come from (process.env by default). */
  modelEnv?: NodeJS.ProcessEnv;
  /** Where the credential proxy keeps its socket: `<data dir>/run` (CredentialProxyOptions.runDir). */
  runDir?: string;
  logger: Logger;
}

export const SHUTDOWN_ERROR = 'The service shut down while this job ran; it was stopped. Send a follow-up message to run it again.';

export class Executor {
  /** One for every run of this executor: agent CLIs reach their providers through it, never with the key. */
  private readonly credentialProxy: CredentialProxy;
  private stopped = false;
  private stopping: Promise<void> | null = null;
  private wake: (() => void) | null = null;
  private readonly unlisten: Array<() => Promise<void>> = [];
  private readonly slots: Promise<void>[] = [];
  private readonly running = new Map<string, { job: JobRow; controller: AbortController }>();

  constructor(private readonly options: ExecutorOptions) {
    this.credentialProxy = new CredentialProxy({ logger: options.logger, runDir: options.runDir });
  }

  async start(): Promise<void> {
    this.unlisten.push(await this.options.database.listen(JOBS_CHANNEL, () => this.wake?.()));
    // A task's events channel also carries cancel: check the lease of its running job at once, so a
    // cancelled run stops (its process group killed) within moments rather than at the next renewal.
    this.unlisten.push(await this.options.database.listen(EVENTS_CHANNEL, (taskId) => this.recheck(taskId)));
    for (let slot = 0; slot < this.options.concurrency; slot++) this.slots.push(this.loop());
  }

  /**
   * Stops claiming, stops the running jobs (each ends FAILED, saying the service shut down) and waits.
   * Calling it again waits for the same stop.
   */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.stopped = true;
      for (const { controller } of this.running.values()) controller.abort();
      this.wake?.();
      await Promise.all(this.slots);
      await Promise.all(this.unlisten.map((stop) => stop()));
      await this.credentialProxy.close();
    })();
    return this.stopping;
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
      const ran = await this.run(job, emit, controller.signal, (parsed) => (agent = parsed));
      // Stopped by a shutdown rather than by its task: say so, rather than what the abort did to the run.
      const result: JobResult = this.stopped && controller.signal.aborted ? { status: 'FAILED', error: SHUTDOWN_ERROR } : ran;
      await finishJob(db, job.id, job.generation, result);
      if (result.status === 'COMPLETED' && (result.finalAnswer ?? result.plan)) {
        await insertMessage(db, { taskId: job.taskId, role: 'agent', body: result.plan ?? result.finalAnswer ?? '' });
      }
      log.info({ status: result.status }, 'job finished');
    } catch (error) {
      if (this.stopped && !(error instanceof StaleGenerationError)) {
        await finishJob(db, job.id, job.generation, { status: 'FAILED', error: SHUTDOWN_ERROR }).catch(() => undefined);
      } else if (error instanceof StaleGenerationError || controller.signal.aborted) {
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
      harness = harnessFor(parsed, this.options.modelEnv ?? process.env, { credentialProxy: this.credentialProxy });
    } catch (error) {
      return { status: 'FAILED', error: (error as Error).message };
    }
    const deps: JobRunDeps = {
      db,
      environments: this.options.environments,
      publicUrl: this.options.publicUrl,
      forks: this.options.forks,
      codeHost: this.options.environments.codeHost,
      logger: this.options.logger.child({ jobId: job.id }),
      ...(this.options.startDevServers ? { startDevServers: this.options.startDevServers } : {}),
    };
    return new JobRun(deps, { job, task, agent: parsed, harness, emit, signal }).execute();
  }
}
