/**
 * The scheduler: runs periodic work every `tickMs` in this process — the fork lifecycle's moves, the
 * environments' sweep, ended workspace shells, later the automations. Ticks never overlap (the next is
 * timed from the end of the last); a failing job is logged and tried again next tick, never thrown out
 * of the timer.
 *
 * Work that can take long (archiving forks, installing an environment's dependencies) is `detached`: a
 * tick starts a round of it when its last round has ended and goes on without waiting for it, so that it
 * never holds up the other work. `stop` waits for every round under way: a process shutting down stops
 * its long work first (Environments.abort, ForkLifecycle.abort), then the scheduler. Once stopped, no
 * work starts, also not through `tick` (until `start` again): what shuts down after it must not have it
 * running again.
 *
 * Every process runs its own scheduler. The fork lifecycle is per host (each host moves the forks on its
 * disk) and each of its moves is a conditional UPDATE, so several processes ticking at once is safe;
 * work that must run once across all hosts will take a PostgreSQL advisory lock here when it arrives.
 */
import type { Logger } from 'pino';

export interface ScheduledWork {
  name: string;
  /** One round of the work; what it resolves to is logged when it did something. */
  run(): Promise<unknown>;
  /** Runs beside the ticks, one round at a time, instead of in them (see the module comment). */
  detached?: boolean;
}

export interface SchedulerOptions {
  tickMs: number;
  work: ScheduledWork[];
  logger: Logger;
}

export class Scheduler {
  private timer: NodeJS.Timeout | null = null;
  private inFlight: Promise<void> | null = null;
  private running = false;
  /** Set by `stop`: no tick starts any work, and a tick under way starts no more. */
  private stopped = false;
  /** The round under way of each detached work, by name. */
  private readonly detached = new Map<string, Promise<void>>();

  constructor(private readonly options: SchedulerOptions) {}

  /** Starts ticking: the first tick comes after `tickMs`. */
  start(): void {
    if (this.running) return;
    this.running = true;
    this.stopped = false;
    this.schedule();
  }

  /** Stops ticking and waits for a tick in flight, and the detached rounds under way, to end. */
  async stop(): Promise<void> {
    this.running = false;
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    await this.inFlight;
    await Promise.all(this.detached.values());
  }

  /**
   * Runs every piece of work once, now (a tick in flight finishes first; detached work is started, not
   * awaited); nothing once stopped.
   */
  async tick(): Promise<void> {
    while (this.inFlight) await this.inFlight;
    const tick = this.runAll().finally(() => {
      this.inFlight = null;
    });
    this.inFlight = tick;
    await tick;
  }

  private schedule(): void {
    if (!this.running) return;
    this.timer = setTimeout(() => {
      this.timer = null;
      void this.tick().finally(() => this.schedule());
    }, this.options.tickMs);
    // The scheduler alone keeps no process alive.
    this.timer.unref();
  }

  private async runAll(): Promise<void> {
    for (const work of this.options.work) {
      if (this.stopped) return;
      if (!work.detached) {
        await this.runOnce(work);
      } else if (!this.detached.has(work.name)) {
        const round = this.runOnce(work).finally(() => this.detached.delete(work.name));
        this.detached.set(work.name, round);
      }
    }
  }

  /** One round of `work`; it never throws (a failure is logged). */
  private async runOnce(work: ScheduledWork): Promise<void> {
    try {
      const result = await work.run();
      if (didSomething(result)) this.options.logger.info({ work: work.name, result }, 'scheduled work done');
    } catch (error) {
      this.options.logger.error({ err: error, work: work.name }, 'scheduled work failed');
    }
  }
}

/** A result worth a log line: anything but nothing, or counts that are all zero. */
function didSomething(result: unknown): boolean {
  if (result === undefined || result === null) return false;
  if (typeof result === 'object') return Object.values(result).some((value) => value !== 0);
  return true;
}
