/**
 * `svc runner start`: the desktop runner daemon, one per home (lock.ts).
 *
 * At start it takes over what an earlier life left: runs that were executing are stopped (their
 * recorded process groups killed) and reported failed, finished runs resume delivery and completion
 * (run-state.ts); none is executed again. A run whose state here is damaged (its record or outbox) is
 * quarantined: its upload stops, its outbox is closed, its folder is moved aside as it is (`quarantine/`,
 * shown by `svc runner status`), the log says where, and once the server lists it the run is reported
 * failed with a fresh outbox, never executed again; the others go on. A run is moved aside once: should
 * its fresh state be damaged too, it is left alone. What fails for a reason that may pass (process groups
 * that cannot be stopped, too many open files, a full disk) quarantines nothing: a run left by an earlier
 * life is then neither reported nor claimed until a later pass takes it over (a run is never reported
 * while what it started may still run); a freshly claimed run that never started is claimed again later.
 * Then it discovers what it can run, heartbeats, and long-polls `POST /runners/signals`:
 *
 * - a new work version: list `/runs`, claim queued runs up to the concurrency (one run per task at a
 *   time), stop cancelled ones (their receipt says `cancelled`), forget runs the server no longer lists;
 * - `missing` runs: stop them and drop their outbox;
 * - controls: hand each to its run, then advance the run's cursor;
 * - review requests: answer with the file (review.ts).
 *
 * A revoked connection stops every run and ends the daemon with a message to pair again; so does a
 * credential the server does not know. SIGINT/SIGTERM stop the runs' process groups and keep the outbox:
 * the next start reports those runs failed after delivering their events.
 */
import {
  RUNNER_LIMITS,
  type Capabilities,
  type ListRunsResponse,
  type ProjectRegistration,
  type RunManifest,
  type RunOutcome,
  type RunnerEvent,
  type SignalsResponse,
} from '../protocol/runner.js';
import { assertNever } from '../domain/errors.js';
import { runnerVersion } from './about.js';
import { backoffDelay, sleep } from './backoff.js';
import { RunnerClient, RunnerHttpError, RunnerRevokedError, RunnerUnauthorizedError, type RunnerClientOptions } from './client.js';
import { completeRun } from './complete.js';
import { discoverCapabilities } from './discovery.js';
import { startExecution, type Execution } from './execute.js';
import type { Connection, RunnerHome } from './home.js';
import { acquireRunnerLock, type RunnerLock } from './lock.js';
import { errorText, stderrLog, type Log } from './log.js';
import { OutboxCorruptError, RunOutbox } from './outbox.js';
import { registrationOf } from './projects.js';
import { reviewAnswer } from './review.js';
import { RunRecordDamagedError, RunRecords, type GroupControl, type RunRecord } from './run-state.js';
import { Uploader } from './upload.js';

export const STOPPED_WHILE_EXECUTING = 'the runner stopped while this run executed';
const LOST_STATE = 'the runner lost the state of this run';
export const DAMAGED_STATE = "the runner's state of this run was damaged; it was moved aside on the computer";

export interface DaemonOptions {
  home: RunnerHome;
  concurrency?: number;
  env?: NodeJS.ProcessEnv;
  log?: Log;
  /** The signals request's wait (at most 10 s). */
  waitMs?: number;
  /** Client seams (tests): waits, randomness. */
  client?: Pick<RunnerClientOptions, 'sleep' | 'random' | 'timeoutMs'>;
  /** Process group seams (tests): how groups are signalled, how long a stop waits. */
  groups?: GroupControl;
}

/** Ends the daemon: the connection cannot go on (revoked, unknown credential). */
const isFatal = (error: unknown) => error instanceof RunnerRevokedError || error instanceof RunnerUnauthorizedError;

/** How long a stopping daemon waits for its harnesses to unwind once their processes are killed. */
const UNWIND_MS = 10_000;

interface Delivery {
  record: RunRecord;
  outbox: RunOutbox;
}

export class RunnerDaemon {
  private readonly home: RunnerHome;
  private readonly records: RunRecords;
  private readonly log: Log;
  private readonly env: NodeJS.ProcessEnv;
  private readonly concurrency: number;
  private readonly waitMs: number;
  private readonly shutdown = new AbortController();
  private connection: Connection;
  private readonly client: RunnerClient;
  private readonly uploader: Uploader;
  private lock: RunnerLock | null = null;
  private capabilities: Capabilities | undefined;
  private heartbeatIntervalMs: number;
  private heartbeatTimer: NodeJS.Timeout | null = null;
  private fatal: unknown = null;

  private readonly executing = new Map<string, Execution>();
  private readonly delivering = new Map<string, Delivery>();
  private readonly outboxes = new Map<string, RunOutbox>();
  /** Control cursors: the last control sequence each run took. */
  private readonly cursors = new Map<string, number>();
  /** Runs forgotten while their execution still unwinds: it must not record them again. */
  private readonly forgotten = new Set<string>();
  /**
   * Runs whose state here was damaged: never claimed again. `movedAside`: their folder is in quarantine/,
   * so they are reported failed afresh once listed; otherwise they are left alone.
   */
  private readonly quarantined = new Map<string, { movedAside: boolean }>();
  /**
   * Runs an earlier life left whose takeover failed for a reason that may pass (their process groups could
   * not be stopped, the disk refused): known here, so neither claimed nor reported, and tried again on the
   * next passes.
   */
  private readonly leftBehind = new Set<string>();
  /** Failures that may pass, per run: the backoff before the next pass and how often the log says so. */
  private readonly retries = new Map<string, number>();
  private retryTimer: { timer: NodeJS.Timeout; dueAt: number } | null = null;
  private readonly random: (() => number) | undefined;
  private readonly reviewsInFlight = new Set<string>();
  private readonly reviewsAnswered = new Set<string>();
  private listedVersion: string | null = null;
  private relist = true;
  private pollInterrupt: AbortController | null = null;

  constructor(options: DaemonOptions) {
    this.home = options.home;
    const sink = options.log ?? stderrLog;
    // A log that fails (a closed stderr) must not break what the daemon was doing when it wrote the line.
    this.log = (line) => {
      try {
        sink(line);
      } catch {
        // nowhere left to say it
      }
    };
    this.records = new RunRecords(options.home, this.log, options.groups);
    this.env = options.env ?? process.env;
    this.concurrency = Math.max(1, options.concurrency ?? 2);
    this.waitMs = Math.min(options.waitMs ?? RUNNER_LIMITS.maxWaitMs, RUNNER_LIMITS.maxWaitMs);
    this.random = options.client?.random;
    this.connection = options.home.requireConnection();
    this.heartbeatIntervalMs = this.connection.heartbeatIntervalMs;
    this.client = new RunnerClient({
      baseUrl: this.connection.server,
      credential: this.connection.credential,
      signal: this.shutdown.signal,
      onRetry: ({ path, attempt, delayMs, reason }) => {
        if (attempt === 1 || attempt % 10 === 0) this.log(`${path}: ${reason}; trying again in ${Math.round(delayMs / 100) / 10} s (attempt ${attempt + 1})`);
      },
      ...options.client,
    });
    this.uploader = new Uploader({
      client: this.client,
      log: this.log,
      onGone: (runId) => this.forget(runId),
      onRefused: () => this.wake(),
      onFatal: (error) => this.fail(error),
      ...(options.client?.random ? { random: options.client.random } : {}),
    });
  }

  /** Runs until stopped (resolves) or until the connection cannot go on (rejects with why). */
  async run(): Promise<void> {
    this.lock = acquireRunnerLock(this.home.lockFile, this.home.dir);
    try {
      await this.recover();
      const discovery = await discoverCapabilities(this.home, this.env);
      this.capabilities = discovery.capabilities;
      this.log(`runner ${this.connection.runnerId} for ${this.connection.server}; harnesses: ${discovery.harnesses.join(', ') || 'none found'}`);
      await this.heartbeat();
      this.scheduleHeartbeat();
      await this.signalsLoop();
    } catch (error) {
      // Once the shutdown began, what the loops throw is its abort; `fail` recorded a real cause already.
      if (!this.shutdown.signal.aborted) this.fatal ??= error;
    } finally {
      await this.stopEverything();
      this.lock.release();
    }
    if (this.fatal !== null) throw this.fatal;
  }

  /** SIGINT/SIGTERM: stop the runs' processes, keep the outbox, let `run` resolve. */
  stop(): void {
    if (!this.shutdown.signal.aborted) this.shutdown.abort(new Error('the runner is stopping'));
  }

  /** Ends the daemon for `error`; once it is stopping, what fails is only the stop's own abort. */
  private fail(error: unknown): void {
    if (this.shutdown.signal.aborted) return;
    this.fatal = error;
    this.shutdown.abort(error);
  }

  private wake(): void {
    this.relist = true;
    this.pollInterrupt?.abort(new Error('woken'));
  }

  // ---- start: what an earlier life left ----

  private async recover(): Promise<void> {
    // Moved aside in an earlier life; reported since, or still to be.
    for (const { runId } of this.records.quarantined()) this.quarantined.set(runId, { movedAside: true });
    for (const runId of this.records.runIds()) await this.recoverRun(runId);
  }

  /** Takes over what an earlier life left of one run; what fails for a reason that may pass is tried again on a later pass. */
  private async recoverRun(runId: string): Promise<void> {
    try {
      await this.takeOverRun(runId);
      this.leftBehind.delete(runId);
      this.retries.delete(runId);
    } catch (error) {
      await this.release(runId);
      this.leftBehind.add(runId);
      this.retryLater(runId, `not taken over: ${errorText(error)}; it is neither reported nor claimed until it is`);
    }
  }

  private async takeOverRun(runId: string): Promise<void> {
    let found: RunRecord | null;
    try {
      found = this.records.read(runId);
    } catch (error) {
      if (!(error instanceof RunRecordDamagedError)) throw error;
      // Whatever it ran is stopped first: once its folder is moved aside, nothing here could stop it.
      await this.stopLeftGroups(runId);
      await this.quarantine(runId, `its record ${error.path} is damaged (${error.problem})`);
      return;
    }
    if (found) await this.takeOver(found);
  }

  private async takeOver(found: RunRecord): Promise<void> {
    const { runId } = found.manifest;
    // Its processes are gone before anything reports it: should the stop fail, the takeover fails.
    if (found.phase === 'executing') await this.stopLeftGroups(runId);
    const outbox = await this.openOutbox(found.manifest);
    if (!outbox) return;
    let record = found;
    if (record.phase === 'executing') {
      await outbox.append({ kind: 'error', data: { message: STOPPED_WHILE_EXECUTING } });
      record = this.records.write({ manifest: record.manifest, phase: 'finished', outcome: { status: 'failed', error: STOPPED_WHILE_EXECUTING } });
    }
    this.log(`run ${runId}: resuming delivery (${outbox.backlog().entries} event(s) to send)`);
    this.uploader.add({ runId, generation: record.manifest.generation, outbox });
    this.deliver(record, outbox);
  }

  private async stopLeftGroups(runId: string): Promise<void> {
    let stopped: number;
    try {
      stopped = await this.records.stopGroups(runId);
    } catch (error) {
      throw new Error(`its process groups could not be stopped (${errorText(error)})`, { cause: error });
    }
    if (stopped > 0) this.log(`run ${runId}: stopped ${stopped} process group(s) left from before`);
  }

  /**
   * The run's outbox, opened and kept in `outboxes`. Null when it is damaged: the run is quarantined. Any
   * other failure (too many open files, a full disk) is thrown: it is no damage, and may pass.
   */
  private async openOutbox(manifest: RunManifest): Promise<RunOutbox | null> {
    let outbox: RunOutbox;
    try {
      outbox = await RunOutbox.open(this.records.dirOf(manifest.runId), manifest.eventsStored);
    } catch (error) {
      if (!(error instanceof OutboxCorruptError)) throw error;
      await this.quarantine(manifest.runId, errorText(error));
      return null;
    }
    this.outboxes.set(manifest.runId, outbox);
    return outbox;
  }

  /**
   * Moves a run whose state here is damaged aside; it is reported failed from a fresh outbox once the
   * server lists it. Its upload stops and its outbox is closed first: nothing here touches the moved
   * folder again, and the fresh outbox is the one uploaded. A run already moved aside is not moved again
   * (its fresh state is damaged too): it is left alone, as it is.
   */
  private async quarantine(runId: string, why: string): Promise<void> {
    await this.release(runId);
    if (this.quarantined.get(runId)?.movedAside) {
      this.quarantined.set(runId, { movedAside: false });
      this.log(`run ${runId}: ${why}; it was moved aside before, so its folder ${this.records.dirOf(runId)} stays as it is and the run is left alone (svc runner status lists it)`);
      return;
    }
    try {
      const path = this.records.quarantine(runId);
      this.quarantined.set(runId, { movedAside: true });
      this.log(`run ${runId}: ${why}; its folder was moved to ${path}, and the run is reported failed, never executed here again`);
      // Reported once listed: a listing is asked for.
      this.wake();
    } catch (error) {
      this.quarantined.set(runId, { movedAside: false });
      this.log(`run ${runId}: ${why}; its folder ${this.records.dirOf(runId)} could not be moved aside (${errorText(error)}): the run is left alone until it is (svc runner status lists it)`);
    }
  }

  /** Stops uploading the run and closes its outbox (its record and folder stay). */
  private async release(runId: string): Promise<void> {
    this.uploader.remove(runId, 'its state here was set aside');
    const outbox = this.outboxes.get(runId);
    this.outboxes.delete(runId);
    await outbox?.close().catch(() => undefined);
  }

  /**
   * Something of the run failed for a reason that may pass: the log says so (the first time, then every
   * tenth), and a listing (which also retries the runs left behind) is asked for after a backoff.
   */
  private retryLater(runId: string, why: string): void {
    const attempt = this.retries.get(runId) ?? 0;
    this.retries.set(runId, attempt + 1);
    if (attempt === 0 || (attempt + 1) % 10 === 0) this.log(`run ${runId}: ${why} (trying again, attempt ${attempt + 2})`);
    if (this.shutdown.signal.aborted) return;
    const dueAt = Date.now() + backoffDelay(attempt, this.random);
    if (this.retryTimer && this.retryTimer.dueAt <= dueAt) return;
    if (this.retryTimer) clearTimeout(this.retryTimer.timer);
    const timer = setTimeout(() => {
      this.retryTimer = null;
      this.wake();
    }, dueAt - Date.now());
    this.retryTimer = { timer, dueAt };
  }

  // ---- heartbeat ----

  private async heartbeat(): Promise<void> {
    let projects: ProjectRegistration[] | undefined;
    try {
      projects = this.home.readProjects().map(registrationOf);
    } catch (error) {
      // A broken project list keeps what the server has rather than registering none.
      this.log(`projects are not sent: ${errorText(error)}`);
    }
    const version = runnerVersion();
    const answer = await this.client.heartbeat({
      workspaceId: this.connection.workspaceId,
      ...(this.capabilities ? { capabilities: this.capabilities } : {}),
      ...(projects ? { projects } : {}),
      ...(version ? { runnerVersion: version } : {}),
    });
    this.heartbeatIntervalMs = answer.heartbeatIntervalMs > 0 ? answer.heartbeatIntervalMs : this.heartbeatIntervalMs;
    if (answer.workspaceId !== this.connection.workspaceId) {
      this.connection = { ...this.connection, workspaceId: answer.workspaceId };
      this.home.writeConnection(this.connection);
    }
    if (answer.version !== this.listedVersion) this.wake();
  }

  private scheduleHeartbeat(): void {
    if (this.shutdown.signal.aborted) return;
    this.heartbeatTimer = setTimeout(() => {
      this.heartbeat().then(
        () => this.scheduleHeartbeat(),
        (error: unknown) => {
          if (isFatal(error)) return this.fail(error);
          if (!this.shutdown.signal.aborted) this.log(`heartbeat failed: ${errorText(error)}`);
          this.scheduleHeartbeat();
        },
      );
    }, this.heartbeatIntervalMs);
  }

  // ---- signals ----

  private async signalsLoop(): Promise<void> {
    let failures = 0;
    while (!this.shutdown.signal.aborted) {
      try {
        if (this.relist) await this.listRuns();
        const interrupt = new AbortController();
        this.pollInterrupt = interrupt;
        let answer: SignalsResponse;
        try {
          // A wake that came while the list was fetched must not wait for the poll.
          if (this.relist) continue;
          answer = await this.client.signals(
            { runs: this.signalRuns(), version: this.listedVersion, waitMs: this.waitMs },
            interrupt.signal,
          );
        } catch (error) {
          if (interrupt.signal.aborted && !this.shutdown.signal.aborted) continue;
          throw error;
        } finally {
          this.pollInterrupt = null;
        }
        this.handleSignals(answer);
        failures = 0;
      } catch (error) {
        if (this.shutdown.signal.aborted || isFatal(error)) throw error;
        // A refusal or an answer off the protocol: log it, wait, and go on (network failures are retried
        // inside the client already).
        this.log(`signals: ${errorText(error)}`);
        await sleep(backoffDelay(failures++), this.shutdown.signal);
      }
    }
  }

  /** The runs whose controls and existence matter: executing and still delivering. */
  private signalRuns(): Array<{ runId: string; after: number }> {
    const ids = [...new Set([...this.executing.keys(), ...this.delivering.keys()])];
    return ids.slice(0, RUNNER_LIMITS.signalRuns).map((runId) => ({ runId, after: this.cursors.get(runId) ?? 0 }));
  }

  private handleSignals(answer: SignalsResponse): void {
    for (const runId of answer.missing) {
      this.log(`run ${runId} no longer exists; stopping it and dropping its events`);
      this.forget(runId);
    }
    const controls = [...answer.controls].sort((a, b) => a.sequence - b.sequence);
    for (const control of controls) {
      if (control.sequence <= (this.cursors.get(control.runId) ?? 0)) continue;
      this.executing.get(control.runId)?.deliver(control.message);
      this.cursors.set(control.runId, control.sequence);
    }
    for (const request of answer.reviewRequests) void this.answerReview(request.id, request.taskId, request.path);
    if (answer.version !== this.listedVersion) this.relist = true;
  }

  private async answerReview(id: string, taskId: string, path: string): Promise<void> {
    if (this.reviewsInFlight.has(id) || this.reviewsAnswered.has(id)) return;
    this.reviewsInFlight.add(id);
    try {
      await this.client.answerReview(id, reviewAnswer(this.home, { taskId, path }));
      this.reviewsAnswered.add(id);
      if (this.reviewsAnswered.size > 1_000) this.reviewsAnswered.delete(this.reviewsAnswered.values().next().value!);
    } catch (error) {
      if (isFatal(error)) return this.fail(error);
      if (!this.shutdown.signal.aborted) this.log(`review request ${id}: ${errorText(error)}`);
    } finally {
      this.reviewsInFlight.delete(id);
    }
  }

  // ---- runs ----

  private async listRuns(): Promise<void> {
    // Cleared first: a wake while the list is fetched asks for another one.
    this.relist = false;
    for (const runId of [...this.leftBehind]) await this.recoverRun(runId);
    let listing: ListRunsResponse;
    try {
      listing = await this.client.listRuns();
    } catch (error) {
      this.relist = true;
      throw error;
    }
    const listed = new Map(listing.runs.map((run) => [run.runId, run]));
    // A run delivered here that the server no longer lists is finished there: nothing is left to report.
    for (const runId of [...this.delivering.keys()]) {
      if (!listed.has(runId)) this.forget(runId);
    }
    const candidates: RunManifest[] = [];
    for (const run of listing.runs) {
      // Not taken over yet: what it started may still run.
      if (this.leftBehind.has(run.runId)) continue;
      const known = this.executing.has(run.runId) || this.delivering.has(run.runId);
      const quarantined = this.quarantined.get(run.runId);
      if (quarantined) {
        if (!known && quarantined.movedAside) await this.reportQuarantined(run);
        continue;
      }
      switch (run.state) {
        case 'cancelled':
          if (this.executing.has(run.runId)) {
            this.log(`run ${run.runId} was cancelled; stopping it`);
            this.executing.get(run.runId)!.stop('cancelled');
          } else if (!known && run.generation >= 1) {
            await this.adopt(run, 'finished', { status: 'cancelled' });
          }
          break;
        case 'syncing':
          if (!known) await this.adopt(run, 'synced', { status: 'failed', error: LOST_STATE });
          break;
        case 'executing':
          // Claimed here but never recorded: the claim's answer was lost, so it never ran. Claim it again.
          if (!known) candidates.push(run);
          break;
        case 'queued':
          candidates.push(run);
          break;
        case 'completed':
        case 'failed':
          break;
        default:
          assertNever(run.state);
      }
    }
    const busyTasks = new Set([...this.executing.values()].map((execution) => execution.manifest.taskId));
    for (const delivery of this.delivering.values()) busyTasks.add(delivery.record.manifest.taskId);
    candidates.sort((a, b) => a.createdAt.localeCompare(b.createdAt));
    for (const run of candidates) {
      if (this.executing.size >= this.concurrency || this.shutdown.signal.aborted) break;
      if (busyTasks.has(run.taskId)) continue;
      busyTasks.add(run.taskId);
      await this.claimAndStart(run);
    }
    this.listedVersion = listing.version;
  }

  /** A run moved aside that the server still holds claimed: reported failed (cancelled if it was), from a fresh record. */
  private async reportQuarantined(run: RunManifest): Promise<void> {
    const error: RunnerEvent = { kind: 'error', data: { message: DAMAGED_STATE } };
    switch (run.state) {
      case 'executing':
        return this.adopt(run, 'finished', { status: 'failed', error: DAMAGED_STATE }, error);
      case 'syncing':
        return this.adopt(run, 'synced', { status: 'failed', error: DAMAGED_STATE }, error);
      case 'cancelled':
        if (run.generation >= 1) await this.adopt(run, 'finished', { status: 'cancelled' });
        return;
      case 'queued':
      case 'completed':
      case 'failed':
        return;
      default:
        assertNever(run.state);
    }
  }

  /** A claimed run this runner has no record of: report it as the server sees it must end, after `event` if given. */
  private async adopt(run: RunManifest, phase: 'finished' | 'synced', outcome: RunOutcome, event?: RunnerEvent): Promise<void> {
    if (this.records.read(run.runId)) return;
    let record: RunRecord;
    let outbox: RunOutbox | null;
    try {
      // Inside the try: a full disk is retried for this run, and the rest of the listing goes on.
      record = this.records.write({ manifest: run, phase, outcome });
      outbox = await this.openOutbox(run);
      if (!outbox) return;
      if (event) await outbox.append(event);
    } catch (error) {
      // Nothing was reported: without its record, the next listing adopts it again.
      await this.release(run.runId);
      this.dropRecord(run.runId);
      this.retryLater(run.runId, `its state here could not be set up to report it: ${errorText(error)}`);
      return;
    }
    this.retries.delete(run.runId);
    this.uploader.add({ runId: run.runId, generation: run.generation, outbox });
    this.deliver(record, outbox);
  }

  /** Drops the run's record only (a run that did nothing here yet); one that cannot be dropped is logged. */
  private dropRecord(runId: string): void {
    try {
      this.records.removeRecord(runId);
    } catch (error) {
      this.log(`run ${runId}: its record could not be removed: ${errorText(error)}`);
    }
  }

  private async claimAndStart(run: RunManifest): Promise<void> {
    let manifest: RunManifest;
    try {
      manifest = (await this.client.claim(run.runId)).run;
    } catch (error) {
      if (!(error instanceof RunnerHttpError)) throw error;
      this.log(`run ${run.runId} was not claimed: ${error.message} (HTTP ${error.status})`);
      return;
    }
    if (manifest.generation < 1 || manifest.runId !== run.runId) {
      this.log(`run ${run.runId}: the claim's answer names generation ${manifest.generation} of run ${manifest.runId}; not executed`);
      return;
    }
    let record: RunRecord;
    let outbox: RunOutbox | null;
    try {
      // Recorded before anything runs: after a crash, a run with a record is never executed again.
      record = this.records.write({ manifest, phase: 'executing' });
      outbox = await this.openOutbox(manifest);
    } catch (error) {
      // It never ran: without its record it is not reported failed after a restart, and a later listing
      // claims it again. The rest of the listing goes on.
      this.dropRecord(manifest.runId);
      this.retryLater(manifest.runId, `its state here could not be set up: ${errorText(error)}; it did not run, and is claimed again later`);
      return;
    }
    if (!outbox) return;
    this.retries.delete(manifest.runId);
    this.uploader.add({ runId: manifest.runId, generation: manifest.generation, outbox });
    this.log(`run ${manifest.runId} (task ${manifest.taskSlug}, ${manifest.harness}/${manifest.model}): executing, generation ${manifest.generation}`);
    const execution = startExecution({ home: this.home, records: this.records, env: this.env, log: this.log }, manifest, outbox, () => this.uploader.kick());
    this.executing.set(manifest.runId, execution);
    void execution.done
      .then(
        (outcome) => this.afterExecution(record, outbox, outcome),
        (error: unknown) => this.afterExecution(record, outbox, { status: 'failed', error: errorText(error) }),
      )
      .catch(async (error: unknown) => {
        this.log(`run ${manifest.runId}: after its execution: ${errorText(error)}`);
        // Its execution is over, whatever failed after it.
        if (this.executing.get(manifest.runId) === execution) this.executing.delete(manifest.runId);
        // Neither executing nor delivering, it would look unclaimed here and be claimed again: it is
        // reported failed instead.
        if (!this.delivering.has(manifest.runId) && !this.forgotten.has(manifest.runId) && !this.shutdown.signal.aborted) {
          await this.quarantine(manifest.runId, `its end could not be handled: ${errorText(error)}`);
        }
      });
  }

  private afterExecution(record: RunRecord, outbox: RunOutbox, outcome: RunOutcome | null): void {
    const { runId } = record.manifest;
    this.executing.delete(runId);
    if (this.forgotten.has(runId)) {
      this.forgotten.delete(runId);
      this.removeRecords(runId);
      return;
    }
    // Stopped by the shutdown: it stays `executing`, and the next start reports it.
    if (outcome === null) return;
    let finished: RunRecord;
    try {
      finished = this.records.write({ manifest: record.manifest, phase: 'finished', outcome });
    } catch (error) {
      // The disk refused (full, failing): delivery writes the record first and retries until it can, and
      // meanwhile the run stays known here, so that it is neither claimed again nor lost.
      this.log(`run ${runId}: its end could not be recorded: ${errorText(error)}; trying again`);
      finished = { manifest: record.manifest, phase: 'finished', outcome, updatedAt: new Date().toISOString() };
    }
    // Ended by itself as the daemon stopped: the next start delivers it.
    if (this.shutdown.signal.aborted) return;
    this.log(`run ${runId}: ${outcome.status}; delivering`);
    this.deliver(finished, outbox);
    // A slot is free, and the task may have a run waiting.
    this.wake();
  }

  /** Delivers a finished run and sends its receipt, retrying until done; then forgets it. */
  private deliver(record: RunRecord, outbox: RunOutbox): void {
    const { runId } = record.manifest;
    this.delivering.set(runId, { record, outbox });
    void (async () => {
      for (let attempt = 0; !this.shutdown.signal.aborted && this.delivering.has(runId); attempt++) {
        try {
          let current = this.records.read(runId) ?? record;
          // The end of the run was not recorded (the write failed): it is, before the server hears of it.
          if (current.phase === 'executing') current = this.records.write({ manifest: record.manifest, phase: record.phase, ...(record.outcome ? { outcome: record.outcome } : {}) });
          const result = await completeRun(
            { client: this.client, records: this.records, uploader: this.uploader, log: this.log, signal: this.shutdown.signal },
            current,
            outbox,
          );
          // A stop cuts delivery short: the record and outbox stay for the next start.
          if (this.shutdown.signal.aborted) return;
          if (this.delivering.has(runId)) this.log(`run ${runId}: ${result === 'completed' ? 'reported' : 'left to the server'}`);
          this.forget(runId);
          return;
        } catch (error) {
          if (this.shutdown.signal.aborted) return;
          if (isFatal(error)) return this.fail(error);
          this.log(`run ${runId}: not reported yet: ${errorText(error)}`);
          await sleep(backoffDelay(attempt), this.shutdown.signal).catch(() => undefined);
        }
      }
    })();
  }

  /** Stops a run if it executes and drops everything of it here: record, outbox, cursor. */
  private forget(runId: string): void {
    this.delivering.delete(runId);
    this.cursors.delete(runId);
    this.retries.delete(runId);
    this.uploader.remove(runId);
    const outbox = this.outboxes.get(runId);
    this.outboxes.delete(runId);
    const execution = this.executing.get(runId);
    if (execution) {
      this.forgotten.add(runId);
      execution.stop('deleted');
      void outbox?.close().catch(() => undefined);
      return;
    }
    void (outbox ? outbox.close().catch(() => undefined) : Promise.resolve()).then(() => this.removeRecords(runId));
  }

  /** Drops a forgotten run's folder; one that cannot be removed is logged and left (nothing uses it again). */
  private removeRecords(runId: string): void {
    try {
      this.records.remove(runId);
    } catch (error) {
      this.log(`run ${runId}: its folder ${this.records.dirOf(runId)} could not be removed: ${errorText(error)}`);
    }
  }

  private async stopEverything(): Promise<void> {
    this.stop();
    if (this.heartbeatTimer) clearTimeout(this.heartbeatTimer);
    if (this.retryTimer) clearTimeout(this.retryTimer.timer);
    this.uploader.stop();
    const executions = [...this.executing.values()];
    for (const execution of executions) execution.stop('shutdown');
    // The abort kills their process groups; a harness that takes long to unwind is not waited for.
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([
      Promise.allSettled(executions.map((execution) => execution.done)),
      new Promise((resolve) => (timer = setTimeout(resolve, UNWIND_MS))),
    ]);
    clearTimeout(timer);
    for (const execution of executions) {
      try {
        await this.records.stopGroups(execution.manifest.runId);
      } catch (error) {
        // Its record stays `executing` with the groups' files: the next start stops them before it reports the run.
        this.log(`run ${execution.manifest.runId}: ${errorText(error)}; the next start stops what is left before it reports the run`);
      }
    }
    for (const outbox of this.outboxes.values()) await outbox.close().catch(() => undefined);
  }
}
