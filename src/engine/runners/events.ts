/**
 * Event uploads from runners (docs/runner-protocol.md "Events" and "Large events"): batches go into the
 * one job journal (store/journal.ts: ordered, idempotent, one generation), each batch on its own, so that
 * one run's error never fails another's — an unexpected one included, which is that batch's 500. Events
 * the owner must act on — permissions, questions — are also kept apart from the trace (local_requests),
 * in the same transaction as the journal write.
 *
 * A large event arrives in parts staged per (run, generation, sequence); its reference, the sole item of
 * an ordinary batch, makes the server join the parts, check size and SHA-256 of the whole journal entry,
 * and store the original event. Until then nothing is in the journal: no reader sees part of an event.
 * The parts go once the event is stored: the stored event keeps the reference's digest, so that a retried
 * reference is answered from it without joining anything again.
 *
 * What PostgreSQL cannot store — NUL and unpaired surrogates, which jsonb refuses — becomes U+FFFD in the
 * stored data, after the size and digest checks, which see the event as the runner sent it; a retry is
 * compared with that too. Identifiers the server hands back (a request's id, a question's) are refused
 * with such characters instead, since a replaced one would no longer match the runner's.
 */
import { createHash } from 'node:crypto';
import { z } from 'zod';
import { AppError, ConflictError, NotFoundError, ValidationError } from '../../domain/errors.js';
import {
  CommandEntry,
  type EventRef,
  Question,
  RUNNER_LIMITS,
  RunnerEvent,
  StorableText,
  UNSTORABLE_CHARACTERS,
  type BatchResult,
  type EventBatch,
  type EventPartBody,
  type EventPartResponse,
  type EventsBody,
} from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { appendEvents, appendLocked, lockJournal, planAppend, type AppendResult, type JournalEvent } from '../../store/journal.js';
import type { RunnerRow } from '../../store/runners.js';
import { dropEventParts, findTaskRow, heldByRunner, insertLocalRequest, lockRunnerRun, settleControlAnswer, stagedParts, stageEventPart, storedEventCount } from '../../store/runs.js';
import { queueFollowUp } from '../tasks.js';
import { answerRestartsTask, decodeBase64 } from './owner.js';
import { RUN_NOT_FOUND } from './runs.js';

/** The shapes of the event kinds the server acts on; other kinds go into the journal as they are. */
const PermissionData = z.object({
  requestId: StorableText(1, 200),
  tool: StorableText(0, 200).optional(),
  input: z.unknown().optional(),
  kind: z.literal('question').optional(),
  questions: z.array(Question).max(20).optional(),
});
const AsyncQuestionData = z.object({ requestId: StorableText(1, 200), questions: z.array(Question).min(1).max(20) });
const AnswerResultData = z.object({ id: StorableText(1, 200), delivered: z.boolean() });
const CommandsData = z.object({ commands: z.array(CommandEntry).max(RUNNER_LIMITS.commandInventory) });

const KNOWN: Record<string, z.ZodType> = {
  permission: PermissionData,
  async_question: AsyncQuestionData,
  async_question_answer_result: AnswerResultData,
  commands: CommandsData,
};

/** An escape in JSON text that may stand for a character PostgreSQL cannot store (a cheap test first). */
const UNSTORABLE_ESCAPE = /\\u(?:0000|d[89a-f])/i;
const UNSTORABLE_ALL = new RegExp(UNSTORABLE_CHARACTERS.source, 'g');

/** `value` with NUL and unpaired surrogates (in strings and keys) replaced by U+FFFD. */
function storable(value: unknown): unknown {
  if (typeof value === 'string') return value.replace(UNSTORABLE_ALL, '\ufffd');
  if (Array.isArray(value)) return value.map(storable);
  if (value !== null && typeof value === 'object') return Object.fromEntries(Object.entries(value).map(([key, inner]) => [storable(key), storable(inner)]));
  return value;
}

/** The event as the journal stores it, named by the digest of what was sent (`json`: the event's JSON text). */
function stored(event: JournalEvent, json: string, digest: string): JournalEvent {
  return { kind: event.kind, data: UNSTORABLE_ESCAPE.test(json) ? storable(event.data) : event.data, digest };
}

const sha256 = (data: string | Buffer): string => createHash('sha256').update(data).digest('hex');

/** A batch's unexpected failure, for the log: its run, and what went wrong. */
export type BatchFailure = (error: unknown, runId: string) => void;

export async function ingestEvents(db: Db, runner: RunnerRow, body: EventsBody, onFailure: BatchFailure): Promise<BatchResult[]> {
  const results: BatchResult[] = [];
  for (const batch of body.batches) {
    try {
      results.push({ runId: batch.runId, acknowledgedSequence: await ingestBatch(db, runner, batch) });
    } catch (thrown) {
      // Anything else is this batch's server error: the other runs of the request go on.
      if (!(thrown instanceof AppError)) onFailure(thrown, batch.runId);
      const error = thrown instanceof AppError ? thrown : new AppError('internal_error', undefined, { cause: thrown });
      results.push({ runId: batch.runId, error: { status: error.status, message: error.message, ...(error.details === undefined ? {} : { details: error.details }) } });
    }
  }
  return results;
}

async function ingestBatch(db: Db, runner: RunnerRow, batch: EventBatch): Promise<number> {
  const refs = batch.events.filter((event): event is EventRef => 'type' in event && event.type === 'event_ref');
  if (refs.length > 0) {
    if (batch.events.length !== 1) throw ValidationError.field('events', 'an event reference must be the sole item of its batch');
    return ingestReference(db, runner, batch, refs[0]!);
  }
  const events = (batch.events as RunnerEvent[]).map((event, index) => {
    const sequence = batch.firstSequence + index;
    const json = JSON.stringify(event);
    if (entryBytes(sequence, json) > RUNNER_LIMITS.inlineEventBytes) {
      throw new AppError('payload_too_large', `event ${sequence} is larger than ${RUNNER_LIMITS.inlineEventBytes} bytes inline; send it in parts`);
    }
    const checked = checkedEvent(event, sequence);
    return stored(checked, json, sha256(JSON.stringify({ kind: checked.kind, data: checked.data })));
  });
  // The journal checks the run is this runner's, with its task and run locked in one round trip.
  const appended = await appendEvents(
    db,
    { jobId: batch.runId, generation: batch.generation, firstSequence: batch.firstSequence, events, runnerId: runner.id },
    { onStored: (tx, fresh, job) => actOn(tx, job, fresh) },
  );
  return acknowledged(appended);
}

/** The bytes of a journal entry `{ sequence, event }` as the runner measures it (`json`: the event's). */
const entryBytes = (sequence: number, json: string): number => Buffer.byteLength(`{"sequence":${sequence},"event":${json}}`, 'utf8');

/**
 * A reference batch, in one transaction: the run locked (its owner and generation checked first, so that
 * nobody learns of or touches another runner's parts), then a retry answered from the stored event's
 * digest, or the parts joined, checked, stored as the original event, and dropped.
 */
async function ingestReference(db: Db, runner: RunnerRow, batch: EventBatch, ref: EventRef): Promise<number> {
  const digest = `ref:${ref.digest}`;
  const outcome = await db.transaction(async (tx): Promise<AppendResult | ValidationError> => {
    const head = await lockJournal(tx, batch.runId, runner.id);
    if (!head) return { ok: false, reason: 'not_found', message: RUN_NOT_FOUND };
    const input = { generation: batch.generation, firstSequence: batch.firstSequence };
    const plan = planAppend(head, { ...input, count: 1 });
    if (!plan.ok) return plan;
    if (plan.repeated === 1) return appendLocked(tx, head, { ...input, events: [{ kind: 'event_ref', data: ref, digest }] });
    const joined = await joinParts(tx, batch.runId, batch.generation, batch.firstSequence, ref);
    if (joined instanceof ValidationError) return joined;
    return appendLocked(tx, head, { ...input, events: [stored(joined.event, joined.json, digest)] }, {
      onStored: async (inner, fresh, job) => {
        await actOn(inner, job, fresh);
        await dropEventParts(inner, job.id, batch.firstSequence);
      },
    });
  });
  if (outcome instanceof ValidationError) throw outcome;
  return acknowledged(outcome);
}

function acknowledged(result: AppendResult): number {
  if (result.ok) return result.acknowledgedSequence;
  if (result.reason === 'not_found') throw new NotFoundError(RUN_NOT_FOUND);
  throw new ConflictError(result.message, { expectedSequence: result.expectedSequence, reason: result.reason });
}

/** A known kind must have its shape (nothing of the batch is stored otherwise). */
function checkedEvent(event: RunnerEvent, sequence: number): JournalEvent {
  const shape = KNOWN[event.kind];
  if (shape) {
    const parsed = shape.safeParse(event.data);
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      throw ValidationError.field(`events.${sequence}.data${issue.path.length ? `.${issue.path.join('.')}` : ''}`, issue.message);
    }
  }
  return { kind: event.kind, data: event.data ?? null };
}

/**
 * Joins a staged event's parts (the run is locked) and checks them against its reference; answers the
 * original event and its JSON text, or why not. Parts whose bytes do not make the referenced entry (a
 * part corrupted on the way) are dropped, so that the runner stages them again (the refusal commits that);
 * a part still missing keeps what is there.
 */
async function joinParts(tx: Db, jobId: string, generation: number, sequence: number, ref: EventRef): Promise<{ event: JournalEvent; json: string } | ValidationError> {
  const invalid = (message: string) => ValidationError.field('events.0', message);
  const parts = await stagedParts(tx, jobId, generation, sequence);
  if (parts.length === 0) return invalid(`no parts are staged for event ${sequence} of generation ${generation}`);
  const missing = parts.findIndex((part, index) => part.part !== index);
  if (missing !== -1) return invalid(`part ${missing} of event ${sequence} is missing`);
  const refuse = async (message: string): Promise<ValidationError> => {
    await dropEventParts(tx, jobId, sequence);
    return invalid(`${message}; its parts were dropped: stage them again`);
  };
  if (parts.some((part) => part.digest !== ref.digest || part.sizeBytes !== ref.sizeBytes)) return refuse(`the parts of event ${sequence} were staged for another reference`);
  const bytes = Buffer.concat(parts.map((part) => part.data));
  if (bytes.length < ref.sizeBytes) return invalid(`the parts of event ${sequence} hold ${bytes.length} bytes, not ${ref.sizeBytes}: a part is missing`);
  if (bytes.length > ref.sizeBytes) return refuse(`the parts of event ${sequence} hold ${bytes.length} bytes, not ${ref.sizeBytes}`);
  if (sha256(bytes) !== ref.digest) return refuse(`the parts of event ${sequence} do not match its digest`);
  const text = bytes.toString('utf8');
  let entry: unknown;
  try {
    entry = JSON.parse(text);
  } catch {
    return refuse(`the parts of event ${sequence} are not a JSON journal entry`);
  }
  const parsed = z.object({ sequence: z.literal(sequence), event: RunnerEvent }).safeParse(entry);
  if (!parsed.success) return refuse(`the joined entry is not { sequence: ${sequence}, event }`);
  try {
    return { event: checkedEvent(parsed.data.event, sequence), json: text };
  } catch (error) {
    if (error instanceof ValidationError) return error;
    throw error;
  }
}

/** What the owner must answer is kept apart from the trace; an undelivered async answer becomes a follow-up. */
async function actOn(tx: Db, job: { id: string; taskId: string }, fresh: ReadonlyArray<{ sequence: number; event: JournalEvent }>): Promise<void> {
  for (const { event } of fresh) {
    switch (event.kind) {
      case 'permission': {
        const data = PermissionData.parse(event.data);
        await insertLocalRequest(tx, {
          jobId: job.id,
          taskId: job.taskId,
          requestId: data.requestId,
          kind: data.kind === 'question' ? 'question' : 'permission',
          tool: data.tool ?? null,
          payload: { questions: data.questions ?? [], input: data.input ?? null },
        });
        break;
      }
      case 'async_question': {
        const data = AsyncQuestionData.parse(event.data);
        await insertLocalRequest(tx, { jobId: job.id, taskId: job.taskId, requestId: data.requestId, kind: 'async_question', tool: null, payload: { questions: data.questions, input: null } });
        break;
      }
      case 'async_question_answer_result': {
        const data = AnswerResultData.parse(event.data);
        // Delivered: settled, so that a later report of the same answer (a runner that lost its own
        // dedupe, say) cannot make it a follow-up too.
        if (data.delivered) {
          await settleControlAnswer(tx, job.taskId, data.id, 'delivered');
          break;
        }
        // The turn had ended: the answer goes to the task as a follow-up (once, however often this is
        // reported), as for older runners. The upload locked the task.
        const task = await findTaskRow(tx, job.taskId);
        if (!task) break;
        const restarts = answerRestartsTask(task);
        const request = await settleControlAnswer(tx, job.taskId, data.id, restarts ? 'follow-up' : 'dropped');
        const text = (request?.answer as { text?: string } | null)?.text;
        if (text && restarts) await queueFollowUp(tx, task, { body: text, userIntent: null });
        break;
      }
      default:
        break;
    }
  }
}

/**
 * Stages one part of the run's next event (only the next one: the journal's count plus one, of an
 * executing or syncing run of this generation). A repeated part with the same bytes is acknowledged again.
 */
export async function stagePart(db: Db, runner: RunnerRow, runId: string, body: EventPartBody): Promise<EventPartResponse> {
  const data = decodeBase64(body.data, 'data');
  if (data.length === 0) throw ValidationError.field('data', 'must not be empty');
  if (data.length > RUNNER_LIMITS.partDataBytes) throw new AppError('payload_too_large', `a part holds at most ${RUNNER_LIMITS.partDataBytes} bytes of data`);
  if (body.ref.sizeBytes <= RUNNER_LIMITS.inlineEventBytes) throw ValidationError.field('ref.sizeBytes', `events of at most ${RUNNER_LIMITS.inlineEventBytes} bytes go inline, not in parts`);
  if (body.part * RUNNER_LIMITS.partDataBytes >= body.ref.sizeBytes) throw ValidationError.field('part', `event ${body.sequence} has no part ${body.part}`);
  return db.transaction(async (tx) => {
    const locked = await lockRunnerRun(tx, runner.id, runId);
    if (!locked) throw new NotFoundError(RUN_NOT_FOUND);
    const { job } = locked;
    if (job.generation !== body.generation) throw new ConflictError(`generation ${body.generation} no longer holds this run`, { generation: job.generation });
    if (!heldByRunner(job)) throw new ConflictError(`the run is ${job.status}; it stages no parts`);
    const expected = (await storedEventCount(tx, job.id)) + 1;
    if (body.sequence !== expected) throw new ConflictError(`only the next event (${expected}) can stage parts`, { expectedSequence: expected });
    const staged = await stageEventPart(tx, {
      jobId: job.id,
      generation: body.generation,
      sequence: body.sequence,
      part: body.part,
      digest: body.ref.digest,
      sizeBytes: body.ref.sizeBytes,
      data,
    });
    if (staged.kind === 'conflict') throw new ConflictError(staged.message);
    return { runId, sequence: body.sequence, part: body.part, receivedBytes: staged.receivedBytes };
  });
}

