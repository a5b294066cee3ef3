/**
 * The runner's HTTP client for `{base_url}/runners/…` (docs/runner-protocol.md), typed and checked by the
 * wire schemas of src/protocol/runner.ts: every answer is validated before anyone uses it.
 *
 * Failures it handles itself: 429 and 503 wait for `Retry-After` (backoff when absent); network errors,
 * timeouts and other 5xx back off exponentially with full jitter (backoff.ts); both retry up to
 * `maxAttempts` (unbounded for the daemon, which must deliver receipts "until it can"). Every protocol
 * request is safe to repeat: claims, events, parts and receipts are idempotent by design.
 *
 * A 401 asks `GET /identity` which of two things happened: the connection was revoked (pair again, with
 * `reconnect`) or the credential is unknown.
 */
import { z } from 'zod';
import {
  ClaimResponse,
  EnrollmentReceipt,
  EventPartResponse,
  EventsResponse,
  HeartbeatResponse,
  Identity,
  ListRunsResponse,
  RunStatusResponse,
  SignalsResponse,
  type CompleteBody,
  type EnrollBody,
  type EventPartBody,
  type HeartbeatBody,
  type ReviewAnswerBody,
  type SignalsBody,
} from '../protocol/runner.js';
import { backoffDelay, retryAfterMs, sleep as realSleep } from './backoff.js';

/** A refusal the runner does not retry: its status, the envelope's code and message, and its details. */
export class RunnerHttpError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly details?: unknown,
  ) {
    super(message);
    this.name = 'RunnerHttpError';
  }

  /** `details.expectedSequence` of a sequence conflict, if it is one. */
  get expectedSequence(): number | null {
    return expectedSequenceOf(this.details);
  }
}

export function expectedSequenceOf(details: unknown): number | null {
  const value = typeof details === 'object' && details !== null ? (details as { expectedSequence?: unknown }).expectedSequence : undefined;
  return typeof value === 'number' && Number.isInteger(value) && value >= 1 ? value : null;
}

/** The connection was revoked by its user: the runner stops its runs and must be paired again. */
export class RunnerRevokedError extends Error {
  constructor(readonly runnerId: string) {
    super('this runner connection was revoked; its runs were stopped. Pair this computer again: svc runner pair');
    this.name = 'RunnerRevokedError';
  }
}

/** The server does not know the credential at all (a deleted connection, another server). */
export class RunnerUnauthorizedError extends Error {
  constructor(server: string) {
    super(`${server} does not accept this runner's credential; pair this computer again: svc runner pair`);
    this.name = 'RunnerUnauthorizedError';
  }
}

/** Retries ran out (`maxAttempts`) on network errors, timeouts or 5xx. */
export class RunnerUnreachableError extends Error {
  constructor(server: string, reason: string) {
    super(`cannot reach ${server}: ${reason}`);
    this.name = 'RunnerUnreachableError';
  }
}

/** The server answered something the protocol does not allow: a bug on one side, not worth a retry. */
export class RunnerProtocolError extends Error {
  constructor(path: string, reason: string) {
    super(`the server's answer to ${path} does not follow the runner protocol: ${reason}`);
    this.name = 'RunnerProtocolError';
  }
}

export interface RetryEvent {
  path: string;
  /** The number of the attempt that failed, from 1. */
  attempt: number;
  delayMs: number;
  reason: string;
}

export interface RunnerClientOptions {
  /** The REST base URL, ending in /api/v1. */
  baseUrl: string;
  credential?: string;
  /** Attempts per request, the first included; unbounded by default. */
  maxAttempts?: number;
  /** Per attempt; a long poll adds its wait. */
  timeoutMs?: number;
  /** Aborts every request and every wait (the daemon's shutdown). */
  signal?: AbortSignal;
  /** Seams for tests that must not wait in real time: how to wait, and the jitter's randomness. */
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
  random?: () => number;
  onRetry?: (event: RetryEvent) => void;
}

interface CallOptions {
  /** Aborts this request alone (the daemon interrupts a long poll with it). */
  signal?: AbortSignal;
  timeoutMs?: number;
  /** Sends the credential (every route but enroll). */
  auth?: boolean;
}

const DEFAULT_TIMEOUT_MS = 60_000;
/** A long poll answers within its wait; this much more before the runner gives up on the answer. */
const LONG_POLL_GRACE_MS = 15_000;

export class RunnerClient {
  readonly baseUrl: string;

  constructor(private readonly options: RunnerClientOptions) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, '');
  }

  enroll(body: EnrollBody): Promise<EnrollmentReceipt> {
    return this.call('POST', '/enroll', EnrollmentReceipt, body, { auth: false });
  }

  identity(): Promise<Identity> {
    return this.call('GET', '/identity', Identity);
  }

  heartbeat(body: HeartbeatBody): Promise<HeartbeatResponse> {
    return this.call('POST', '/heartbeat', HeartbeatResponse, body);
  }

  listRuns(): Promise<ListRunsResponse> {
    return this.call('GET', '/runs', ListRunsResponse);
  }

  claim(runId: string): Promise<ClaimResponse> {
    return this.call('POST', `/runs/${encodeURIComponent(runId)}/claim`, ClaimResponse, {});
  }

  signals(body: SignalsBody, signal?: AbortSignal): Promise<SignalsResponse> {
    return this.call('POST', '/signals', SignalsResponse, body, { timeoutMs: body.waitMs + LONG_POLL_GRACE_MS, ...(signal ? { signal } : {}) });
  }

  /** `body` is the serialized request: a retried batch must carry the very bytes of the first. */
  events(body: string): Promise<EventsResponse> {
    return this.call('POST', '/events', EventsResponse, body);
  }

  eventPart(runId: string, body: EventPartBody): Promise<EventPartResponse> {
    return this.call('POST', `/runs/${encodeURIComponent(runId)}/event-parts`, EventPartResponse, body);
  }

  syncing(runId: string, generation: number): Promise<RunStatusResponse> {
    return this.call('POST', `/runs/${encodeURIComponent(runId)}/syncing`, RunStatusResponse, { generation });
  }

  complete(runId: string, body: CompleteBody): Promise<RunStatusResponse> {
    return this.call('POST', `/runs/${encodeURIComponent(runId)}/complete`, RunStatusResponse, body);
  }

  async answerReview(reviewRequestId: string, body: ReviewAnswerBody): Promise<void> {
    await this.call('POST', `/review-requests/${encodeURIComponent(reviewRequestId)}`, z.unknown(), body);
  }

  private async call<T>(method: 'GET' | 'POST', path: string, schema: z.ZodType<T>, body?: unknown, call: CallOptions = {}): Promise<T> {
    const url = `${this.baseUrl}/runners${path}`;
    const payload = body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body);
    const headers: Record<string, string> = { accept: 'application/json' };
    if (payload !== undefined) headers['content-type'] = 'application/json';
    if (call.auth !== false) {
      if (!this.options.credential) throw new Error('this request needs the runner credential');
      headers.authorization = `Bearer ${this.options.credential}`;
    }
    const callers = [this.options.signal, call.signal].filter((signal): signal is AbortSignal => signal !== undefined);
    const maxAttempts = this.options.maxAttempts ?? Number.POSITIVE_INFINITY;
    for (let attempt = 0; ; attempt++) {
      for (const signal of callers) signal.throwIfAborted();
      let status: number;
      let text: string;
      let retryAfter: string | null;
      try {
        const timeout = AbortSignal.timeout(call.timeoutMs ?? this.options.timeoutMs ?? DEFAULT_TIMEOUT_MS);
        const response = await fetch(url, { method, headers, ...(payload === undefined ? {} : { body: payload }), signal: AbortSignal.any([...callers, timeout]) });
        status = response.status;
        retryAfter = response.headers.get('retry-after');
        text = await response.text();
      } catch (error) {
        for (const signal of callers) signal.throwIfAborted();
        await this.pause(path, attempt, maxAttempts, null, networkReason(error));
        continue;
      }
      if (status >= 200 && status < 300) return this.parse(path, schema, text);
      const envelope = errorOf(status, text);
      if (status === 429 || status === 503) {
        await this.pause(path, attempt, maxAttempts, retryAfterMs(retryAfter), `HTTP ${status}: ${envelope.message}`);
        continue;
      }
      if (status >= 500) {
        await this.pause(path, attempt, maxAttempts, null, `HTTP ${status}: ${envelope.message}`);
        continue;
      }
      if (status === 401 && call.auth !== false && path !== '/identity') await this.explainUnauthorized();
      throw new RunnerHttpError(status, envelope.code, envelope.message, envelope.details);
    }
  }

  private parse<T>(path: string, schema: z.ZodType<T>, text: string): T {
    let json: unknown;
    try {
      json = text === '' ? undefined : JSON.parse(text);
    } catch {
      throw new RunnerProtocolError(path, 'not JSON');
    }
    const parsed = schema.safeParse(json);
    if (!parsed.success) {
      throw new RunnerProtocolError(path, parsed.error.issues.map((issue) => `${issue.path.join('.') || '(root)'} ${issue.message}`).join('; '));
    }
    return parsed.data;
  }

  /** Waits before the next attempt, or throws RunnerUnreachableError when there is none. */
  private async pause(path: string, attempt: number, maxAttempts: number, retryAfter: number | null, reason: string): Promise<void> {
    if (attempt + 1 >= maxAttempts) throw new RunnerUnreachableError(this.baseUrl, reason);
    const delayMs = retryAfter ?? backoffDelay(attempt, this.options.random);
    this.options.onRetry?.({ path, attempt: attempt + 1, delayMs, reason });
    await (this.options.sleep ?? realSleep)(delayMs, this.options.signal);
  }

  /** After a 401: revoked (pair again with reconnect), or unknown altogether. */
  private async explainUnauthorized(): Promise<void> {
    let identity: Identity;
    try {
      identity = await this.identity();
    } catch (error) {
      if (error instanceof RunnerHttpError && error.status === 401) throw new RunnerUnauthorizedError(this.baseUrl);
      throw error;
    }
    if (identity.revoked) throw new RunnerRevokedError(identity.runnerId);
  }
}

function errorOf(status: number, text: string): { code: string; message: string; details?: unknown } {
  try {
    const parsed = JSON.parse(text) as { error?: { code?: unknown; message?: unknown; details?: unknown } };
    if (parsed.error && typeof parsed.error.message === 'string') {
      return { code: typeof parsed.error.code === 'string' ? parsed.error.code : `http_${status}`, message: parsed.error.message, details: parsed.error.details };
    }
  } catch {
    // not the envelope
  }
  return { code: `http_${status}`, message: text.trim().split('\n', 1)[0]?.slice(0, 200) || `HTTP ${status}` };
}

function networkReason(error: unknown): string {
  if (error instanceof DOMException && error.name === 'TimeoutError') return 'no answer in time';
  const message = error instanceof Error ? error.message : String(error);
  const cause = (error as { cause?: { code?: string; message?: string } }).cause;
  if (cause?.code) return `${cause.code}${cause.message ? ` (${cause.message})` : ''}`;
  return cause?.message ? `${message}: ${cause.message}` : message;
}
