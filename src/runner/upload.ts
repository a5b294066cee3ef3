/**
 * Uploads the outboxes of the runner's runs to `POST /runners/events`, in order, in requests of at most
 * 4 MiB that may carry several runs (one batch each). What the answer says per run:
 *
 * - `acknowledgedSequence`: the outbox drops what it covers;
 * - an error with `details.expectedSequence`: the server holds everything before it, so that much is
 *   acknowledged here and the upload goes on from there;
 * - 404: the run is not this runner's any more (`onGone`);
 * - any other error: that run backs off (exponentially, full jitter) while the others go on.
 *
 * A refusal of the whole request names no run. When it is about what the request holds (a 4xx other than
 * 401, 403 and 429), one run's batch may be the cause, so each batch is sent again alone: only the run
 * whose batch is refused then backs off. Any other refusal backs off every run of the request.
 *
 * A batch that got no answer is sent again with the same entries (the same first sequence and bytes).
 * An entry over 240 KiB is staged first in parts (`POST /runs/{id}/event-parts`) and then sent as its
 * reference, the sole item of its batch.
 */
import { RUNNER_LIMITS } from '../protocol/runner.js';
import { backoffDelay } from './backoff.js';
import { RunnerHttpError, expectedSequenceOf, type RunnerClient } from './client.js';
import type { Log } from './log.js';
import type { OutboxEntry, RunOutbox } from './outbox.js';
import { eventJsonOf, eventRefOf, needsParts, partsOf } from './parts.js';

export interface UploadTarget {
  runId: string;
  generation: number;
  outbox: RunOutbox;
}

/** The run left the upload before its outbox was delivered. */
export class UploadAbandonedError extends Error {
  constructor(runId: string, reason: string) {
    super(`the events of run ${runId} were not delivered: ${reason}`);
    this.name = 'UploadAbandonedError';
  }
}

interface RunUpload {
  target: UploadTarget;
  /** Consecutive failures, for the backoff. */
  failures: number;
  blockedUntil: number;
  /** The batch sent without an answer yet: the next attempt sends exactly these again. */
  inflight: { firstSequence: number; count: number } | null;
  /** Sequences whose parts the server acknowledged, waiting for their reference batch. */
  staged: Set<number>;
  waiters: Array<{ resolve: () => void; reject: (error: Error) => void }>;
}

interface Batch {
  upload: RunUpload;
  firstSequence: number;
  count: number;
  /** The batch's JSON text. */
  text: string;
  /** An event reference for staged parts. */
  staged: boolean;
}

export interface UploaderOptions {
  client: RunnerClient;
  log: Log;
  /** The server no longer has the run for this runner (404): the daemon forgets it. */
  onGone?: (runId: string) => void;
  /** A refusal that neither acknowledges nor resyncs (a stale generation, a finished run). */
  onRefused?: (runId: string, error: { status: number; message: string }) => void;
  /** What stops the daemon (revoked, shutdown): the upload cannot go on. */
  onFatal: (error: unknown) => void;
  random?: () => number;
  /** Requests are at most this large (4 MiB by the protocol; smaller in tests). */
  requestBytes?: number;
}

const REQUEST_OVERHEAD = Buffer.byteLength('{"batches":[]}');

export class Uploader {
  private readonly runs = new Map<string, RunUpload>();
  private pumping = false;
  private again = false;
  private timer: NodeJS.Timeout | null = null;
  private stopped = false;

  constructor(private readonly options: UploaderOptions) {}

  add(target: UploadTarget): void {
    if (this.runs.has(target.runId)) return;
    this.runs.set(target.runId, { target, failures: 0, blockedUntil: 0, inflight: null, staged: new Set(), waiters: [] });
    this.kick();
  }

  /** Stops uploading a run; whoever waits for its delivery learns why. */
  remove(runId: string, reason = 'the run was dropped'): void {
    const upload = this.runs.get(runId);
    if (!upload) return;
    this.runs.delete(runId);
    for (const waiter of upload.waiters) waiter.reject(new UploadAbandonedError(runId, reason));
  }

  has(runId: string): boolean {
    return this.runs.has(runId);
  }

  /** Resolves once every entry the run's outbox holds now or later is acknowledged. */
  whenDelivered(runId: string): Promise<void> {
    const upload = this.runs.get(runId);
    if (!upload) return Promise.reject(new UploadAbandonedError(runId, 'it is not being uploaded'));
    if (upload.target.outbox.pending().length === 0) return Promise.resolve();
    const delivered = new Promise<void>((resolve, reject) => upload.waiters.push({ resolve, reject }));
    this.kick();
    return delivered;
  }

  /** Something new to send: starts a pass unless one runs (which then goes round once more). */
  kick(): void {
    if (this.stopped) return;
    if (this.pumping) {
      this.again = true;
      return;
    }
    this.pumping = true;
    void this.pump().finally(() => {
      this.pumping = false;
      this.scheduleRetry();
    });
  }

  /** No more uploads: whoever waits for a delivery learns that it will not come from here. */
  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    for (const upload of this.runs.values()) {
      for (const waiter of upload.waiters.splice(0)) waiter.reject(new UploadAbandonedError(upload.target.runId, 'the upload stopped'));
    }
  }

  private async pump(): Promise<void> {
    try {
      do {
        this.again = false;
        while (!this.stopped && (await this.sendOnce()));
      } while (this.again && !this.stopped);
    } catch (error) {
      this.stop();
      this.options.onFatal(error);
    }
  }

  private scheduleRetry(): void {
    if (this.stopped) return;
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    const waiting = [...this.runs.values()].filter((upload) => upload.target.outbox.pending().length > 0 && upload.blockedUntil > Date.now());
    if (waiting.length === 0) return;
    const next = Math.min(...waiting.map((upload) => upload.blockedUntil));
    this.timer = setTimeout(() => {
      this.timer = null;
      this.kick();
    }, Math.max(0, next - Date.now()));
    this.timer.unref?.();
  }

  /** One request: answers whether anything was sent. */
  private async sendOnce(): Promise<boolean> {
    const budget = (this.options.requestBytes ?? RUNNER_LIMITS.eventBatchBytes) - REQUEST_OVERHEAD;
    const batches: Batch[] = [];
    let used = 0;
    for (const upload of this.runs.values()) {
      if (batches.length >= RUNNER_LIMITS.signalRuns) break;
      if (upload.blockedUntil > Date.now() || upload.target.outbox.pending().length === 0) continue;
      const batch = await this.batchOf(upload, budget - used - (batches.length > 0 ? 1 : 0));
      if (!batch) continue;
      batches.push(batch);
      used += Buffer.byteLength(batch.text) + (batches.length > 1 ? 1 : 0);
    }
    if (batches.length === 0) return false;
    await this.send(batches);
    return true;
  }

  /** One request with these batches; each run's result is taken as it says. */
  private async send(batches: readonly Batch[]): Promise<void> {
    const answer = await this.options.client.events(`{"batches":[${batches.map((batch) => batch.text).join(',')}]}`).catch((error: unknown) => {
      // A refusal of the whole request (not a network error: the client retries those).
      if (error instanceof RunnerHttpError) return error;
      throw error;
    });
    if (answer instanceof RunnerHttpError) {
      const why = `${answer.message} (HTTP ${answer.status})`;
      if (batches.length > 1 && refusesContent(answer.status)) {
        this.options.log(`the server refused an upload of ${batches.length} runs' events: ${why}; sending each run's alone`);
        for (const batch of batches) {
          if (this.runs.get(batch.upload.target.runId) === batch.upload && !this.stopped) await this.send([batch]);
        }
        return;
      }
      const whose = batches.length === 1 ? `run ${batches[0]!.upload.target.runId}'s events from ${batches[0]!.firstSequence}` : 'an event upload';
      this.options.log(`the server refused ${whose}: ${why}`);
      for (const batch of batches) this.backOff(batch.upload);
      return;
    }
    for (const batch of batches) {
      const result = answer.results.find((candidate) => candidate.runId === batch.upload.target.runId);
      if (this.runs.get(batch.upload.target.runId) !== batch.upload) continue;
      if (!result) {
        this.backOff(batch.upload);
        continue;
      }
      if ('acknowledgedSequence' in result) await this.acknowledged(batch.upload, result.acknowledgedSequence);
      else await this.refused(batch, result.error);
    }
  }

  /** The run's next batch within `room` bytes, staging a large entry's parts first; null when none fits. */
  private async batchOf(upload: RunUpload, room: number): Promise<Batch | null> {
    const { runId, generation, outbox } = upload.target;
    const pending = outbox.pending();
    const first = pending[0]!;
    const head = `{"runId":${JSON.stringify(runId)},"generation":${generation},"firstSequence":${first.sequence},"events":[`;
    // The batch's size: its head, `]}`, and each event's bytes (its entry's without the entry's wrapping).
    const empty = Buffer.byteLength(head) + 2;
    const eventBytes = (entry: OutboxEntry) => entry.bytes - entryOverhead(entry.sequence);
    const size = (entries: readonly OutboxEntry[]) => entries.reduce((sum, entry, index) => sum + eventBytes(entry) + (index > 0 ? 1 : 0), empty);
    if (needsParts(first.bytes)) {
      const text = `${head}${JSON.stringify(eventRefOf(Buffer.from(first.line, 'utf8')))}]}`;
      if (Buffer.byteLength(text) > room) return null;
      if (!upload.staged.has(first.sequence) && !(await this.stage(upload, first))) return null;
      upload.inflight = { firstSequence: first.sequence, count: 1 };
      return { upload, firstSequence: first.sequence, count: 1, text, staged: true };
    }
    let entries: OutboxEntry[];
    if (upload.inflight && upload.inflight.firstSequence === first.sequence && pending.length >= upload.inflight.count) {
      entries = pending.slice(0, upload.inflight.count);
      if (size(entries) > room) return null;
    } else {
      entries = [];
      let total = empty;
      for (const entry of pending) {
        const grown = total + eventBytes(entry) + (entries.length > 0 ? 1 : 0);
        if (needsParts(entry.bytes) || grown > room) break;
        entries.push(entry);
        total = grown;
      }
      if (entries.length === 0) return null;
    }
    upload.inflight = { firstSequence: first.sequence, count: entries.length };
    const text = `${head}${entries.map((entry) => eventJsonOf(entry.line, entry.sequence)).join(',')}]}`;
    return { upload, firstSequence: first.sequence, count: entries.length, text, staged: false };
  }

  /** Sends a large entry's parts; false when the run must back off. */
  private async stage(upload: RunUpload, entry: OutboxEntry): Promise<boolean> {
    const { runId, generation } = upload.target;
    const bytes = Buffer.from(entry.line, 'utf8');
    const ref = eventRefOf(bytes);
    const parts = partsOf(bytes);
    try {
      for (const [part, data] of parts.entries()) {
        await this.options.client.eventPart(runId, { generation, sequence: entry.sequence, part, data: data.toString('base64'), ref });
      }
    } catch (error) {
      if (!(error instanceof RunnerHttpError)) throw error;
      // The server may hold the event already (its answer was lost): the reference batch's result says.
      if (error.status !== 409) {
        this.options.log(`run ${runId}: staging event ${entry.sequence} in ${parts.length} parts failed: ${error.message} (HTTP ${error.status})`);
        this.backOff(upload);
        return false;
      }
    }
    upload.staged.add(entry.sequence);
    return true;
  }

  private async acknowledged(upload: RunUpload, sequence: number): Promise<void> {
    upload.failures = 0;
    upload.blockedUntil = 0;
    upload.inflight = null;
    await upload.target.outbox.acknowledge(sequence);
    for (const staged of upload.staged) if (staged <= sequence) upload.staged.delete(staged);
    this.settle(upload);
  }

  private async refused(batch: Batch, error: { status: number; message: string; details?: unknown }): Promise<void> {
    const { upload } = batch;
    const { runId, outbox } = upload.target;
    const expected = expectedSequenceOf(error.details);
    if (expected !== null && expected - 1 > outbox.acknowledgedSequence) {
      // The server holds everything before `expected`: that is acknowledged, and the upload goes on there.
      await this.acknowledged(upload, expected - 1);
      return;
    }
    upload.inflight = null;
    if (batch.staged) upload.staged.delete(batch.firstSequence);
    if (error.status === 404) {
      this.options.log(`run ${runId} is gone from the server; its events are dropped`);
      this.remove(runId, 'the server no longer has the run');
      this.options.onGone?.(runId);
      return;
    }
    const why = expected !== null && expected - 1 < outbox.acknowledgedSequence ? ` (the server expects sequence ${expected}, which it acknowledged before)` : '';
    this.options.log(`run ${runId}: events from ${batch.firstSequence} refused: ${error.message} (HTTP ${error.status})${why}`);
    this.backOff(upload);
    this.options.onRefused?.(runId, error);
  }

  private backOff(upload: RunUpload): void {
    upload.blockedUntil = Date.now() + backoffDelay(upload.failures, this.options.random);
    upload.failures += 1;
  }

  private settle(upload: RunUpload): void {
    if (upload.target.outbox.pending().length > 0) return;
    const waiters = upload.waiters.splice(0);
    for (const waiter of waiters) waiter.resolve();
  }
}

/** A whole-request refusal about what the request holds, not about who sends it or how often. */
function refusesContent(status: number): boolean {
  return status >= 400 && status < 500 && status !== 401 && status !== 403 && status !== 429;
}

/** An entry line's bytes beyond its event's: `{"sequence":N,"event":` and the closing brace. */
function entryOverhead(sequence: number): number {
  return Buffer.byteLength(`{"sequence":${sequence},"event":}`);
}
