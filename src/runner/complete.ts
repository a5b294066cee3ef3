/**
 * Finishing a run whose harness ended and whose process groups are gone (phase `finished`, run-state.ts):
 * `syncing` (the phase becomes `synced`), every outbox entry delivered, then the completion receipt with
 * the last sequence. Each step survives a restart, and the receipt is retried until the server takes it:
 * network failures inside the client, a sequence conflict here (the outbox is delivered again first).
 */
import { backoffDelay, sleep } from './backoff.js';
import { RunnerHttpError, type RunnerClient } from './client.js';
import type { Log } from './log.js';
import type { RunOutbox } from './outbox.js';
import type { RunRecord, RunRecords } from './run-state.js';
import { UploadAbandonedError, type Uploader } from './upload.js';

export interface CompletionContext {
  client: RunnerClient;
  records: RunRecords;
  uploader: Uploader;
  log: Log;
  signal: AbortSignal;
  random?: () => number;
}

/** `completed`: the server took the receipt. `gone`: the run is no longer this runner's to report. */
export type CompletionResult = 'completed' | 'gone';

export async function completeRun(context: CompletionContext, record: RunRecord, outbox: RunOutbox): Promise<CompletionResult> {
  const { client, records, uploader, log } = context;
  const { runId, generation } = record.manifest;
  const outcome = record.outcome;
  if (!outcome) throw new Error(`run ${runId} has no outcome to report`);
  if (record.phase === 'executing') throw new Error(`run ${runId} is still executing`);
  if (record.phase === 'finished') {
    try {
      await client.syncing(runId, generation);
    } catch (error) {
      if (!(error instanceof RunnerHttpError)) throw error;
      if (error.status === 404) return 'gone';
      // A run the server finished or cancelled meanwhile may refuse it; the receipt's answer decides.
      log(`run ${runId}: syncing was refused (${error.message}); sending the receipt anyway`);
    }
    records.write({ manifest: record.manifest, phase: 'synced', outcome });
  }
  for (let attempt = 0; ; attempt++) {
    try {
      await uploader.whenDelivered(runId);
    } catch (error) {
      // The daemon stopping abandons uploads too; that run is not gone, only not delivered yet.
      context.signal.throwIfAborted();
      if (error instanceof UploadAbandonedError) return 'gone';
      throw error;
    }
    try {
      await client.complete(runId, { generation, lastSequence: outbox.lastSequence, processStopped: true, outcome });
      return 'completed';
    } catch (error) {
      if (!(error instanceof RunnerHttpError)) throw error;
      if (error.status === 404) return 'gone';
      if (error.expectedSequence === null) {
        log(`run ${runId}: the server refused its completion receipt: ${error.message} (HTTP ${error.status}); the run is left to it`);
        return 'gone';
      }
      // The server lacks events the outbox counts as delivered: it must have lost them. Nothing can be
      // sent again, so the receipt is retried (slowly) and the log says why it does not go through.
      log(`run ${runId}: the server holds events up to ${error.expectedSequence - 1}, not ${outbox.lastSequence}; retrying the receipt`);
      await sleep(backoffDelay(attempt, context.random), context.signal);
    }
  }
}
