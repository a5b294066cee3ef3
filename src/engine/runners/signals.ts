/**
 * The signals long poll (docs/runner-protocol.md "POST /signals"). A request that has nothing to answer
 * waits — holding no database connection — until a NOTIFY on RUNNER_CHANNEL names its runner (whichever
 * process made the change) or its `waitMs` passes; it never sleeps and polls. One LISTEN per process
 * serves every waiting request: a notification wakes only the waiters of the runner it names, each of
 * which looks at the database again.
 *
 * A waiter is registered before the first look, so a change that commits between the look and the wait
 * still wakes it.
 *
 * A control's NOTIFY carries the control itself (store/runs.ts `controlNotice`). A poll that waits with
 * nothing to say, and whose cursor for that run is just before it, answers with it at once — its last
 * look plus the control — without another query: the one path the control delivery latency rides on.
 * Anything else (a version change, a control it cannot place) makes it look again.
 */
import { AppError } from '../../domain/errors.js';
import type { SignalsBody, SignalsResponse } from '../../protocol/runner.js';
import { preparedRows, type Database, type Db } from '../../store/db.js';
import { RUNNER_CHANNEL, touchRunner, type RunnerRow } from '../../store/runners.js';
import { markReviewRequestsDelivered, readRunnerNotice } from '../../store/runs.js';

/** A pending review request wakes long polls again once this long has passed since one carried it. */
export const REVIEW_REDELIVERY_MS = 30_000;

/** How long a runner whose poll came in after the server began closing waits before it asks again. */
const CLOSING_RETRY_AFTER_SECONDS = 5;

const closing = () =>
  new AppError('service_unavailable', 'The server is shutting down; poll again', { headers: { 'retry-after': String(CLOSING_RETRY_AFTER_SECONDS) } });

type AnnouncedControl = { runId: string; sequence: number; message: unknown };
type Waiter = (control: AnnouncedControl | null) => void;

export class RunnerSignals {
  private readonly waiters = new Map<string, Set<Waiter>>();
  private listening: Promise<() => Promise<void>> | null = null;
  private closed = false;

  constructor(private readonly database: Database) {}

  private listen(): Promise<unknown> {
    // Once closed, nothing listens again: close() stopped the one LISTEN and none would be stopped after it.
    if (this.closed) return Promise.reject(closing());
    this.listening ??= this.database.listen(RUNNER_CHANNEL, (payload) => {
      const { runnerId, control } = readRunnerNotice(payload);
      for (const wake of this.waiters.get(runnerId) ?? []) wake(control);
    });
    // A failed LISTEN is tried again by the next request.
    return this.listening.catch((error: unknown) => {
      this.listening = null;
      throw error;
    });
  }

  /** How many requests wait now (for operators and benchmarks). */
  get waiting(): number {
    let count = 0;
    for (const set of this.waiters.values()) count += set.size;
    return count;
  }

  /**
   * Answers the signals request of `runner`: at once when there is something to say, otherwise when a
   * change of the runner wakes it and there is, otherwise after `waitMs` (or when `abort` fires: the
   * client went away, the server closes). A poll that comes after close() is refused (503).
   */
  async poll(runner: RunnerRow, body: SignalsBody, abort: AbortSignal): Promise<SignalsResponse> {
    await this.listen();
    const db = this.database.db;
    let woken = false;
    /** Controls announced since the last look (null: a wake that announced none, so look again). */
    let announced: AnnouncedControl[] | null = [];
    let release: (() => void) | null = null;
    const waiter: Waiter = (control) => {
      woken = true;
      if (control && announced) announced.push(control);
      else announced = null;
      release?.();
    };
    let set = this.waiters.get(runner.id);
    if (!set) this.waiters.set(runner.id, (set = new Set()));
    set.add(waiter);
    const deadline = Date.now() + body.waitMs;
    try {
      await touchRunner(db, runner.id);
      const cursors = new Map(body.runs.map((run) => [run.runId, run.after]));
      let last: SignalsResponse | null = null;
      for (;;) {
        // Nothing but controls announced since a look that found nothing to say: they are the answer.
        const placed = last && announced && announced.length > 0 ? placeAnnounced(announced, cursors) : null;
        if (last && placed) return { ...last, controls: placed };
        woken = false;
        announced = [];
        const { answer, worth } = await look(db, runner.id, body);
        last = answer;
        const remaining = deadline - Date.now();
        if (worth || remaining <= 0 || abort.aborted || this.closed) return answer;
        if (!woken) {
          await new Promise<void>((resolve) => {
            const timer = setTimeout(resolve, remaining);
            const done = () => {
              clearTimeout(timer);
              abort.removeEventListener('abort', done);
              release = null;
              resolve();
            };
            release = done;
            abort.addEventListener('abort', done, { once: true });
          });
        }
      }
    } finally {
      set.delete(waiter);
      if (set.size === 0) this.waiters.delete(runner.id);
    }
  }

  /** Ends every wait at once (the server is closing) and stops listening, for good. */
  async close(): Promise<void> {
    this.closed = true;
    for (const set of this.waiters.values()) for (const wake of set) wake(null);
    const listening = this.listening;
    this.listening = null;
    if (listening) await (await listening.catch(() => async () => undefined))();
  }
}

/**
 * The announced controls as an answer, when each one is the next after its run's cursor (runs not named
 * are not this poll's concern); null when any cannot be placed so (a gap: look instead).
 */
function placeAnnounced(announced: readonly AnnouncedControl[], cursors: ReadonlyMap<string, number>): SignalsResponse['controls'] | null {
  const next = new Map(cursors);
  const placed: SignalsResponse['controls'] = [];
  for (const control of [...announced].sort((a, b) => a.sequence - b.sequence)) {
    const after = next.get(control.runId);
    if (after === undefined) continue;
    if (control.sequence !== after + 1) return null;
    next.set(control.runId, control.sequence);
    placed.push({ runId: control.runId, sequence: control.sequence, message: control.message as SignalsResponse['controls'][number]['message'] });
  }
  return placed.length > 0 ? placed : null;
}

/**
 * One statement, prepared once per connection: the look runs on every wake-up of every waiting poll.
 * $1 runner, $2 run ids named, $3 their cursors, $4 how long a carried review request stays quiet (ms).
 */
const LOOK = `
  with named as (select * from unnest($2::uuid[], $3::int[]) as n(id, after)),
  owned as (select n.id, n.after from named n join jobs j on j.id = n.id and j.runner_id = $1::uuid),
  ctl as (
    select c.job_id, c.sequence, c.message from run_controls c join owned o on c.job_id = o.id and c.sequence > o.after
    order by c.job_id, c.sequence limit 1000
  ),
  rev as (
    select id, job_id, task_id, path, created_at,
      (delivered_at is null or delivered_at < now() - $4::double precision * interval '1 millisecond') as fresh
    from review_requests where runner_id = $1::uuid and status = 'pending' order by created_at limit 100
  )
  select
    (select work_version::text from runners where id = $1::uuid) as version,
    (select coalesce(json_agg(id), '[]'::json) from owned) as owned,
    (select coalesce(json_agg(json_build_object('runId', job_id, 'sequence', sequence, 'message', message) order by job_id, sequence), '[]'::json) from ctl) as controls,
    (select coalesce(json_agg(json_build_object('id', id, 'runId', job_id, 'taskId', task_id, 'path', path, 'createdAt', created_at, 'fresh', fresh) order by created_at), '[]'::json) from rev) as reviews`;

interface LookRow {
  version: string | null;
  owned: string[];
  controls: Array<{ runId: string; sequence: number; message: unknown }>;
  reviews: Array<{ id: string; runId: string | null; taskId: string; path: string; createdAt: string; fresh: boolean }>;
}

/** PGlite answers json columns parsed, node-postgres too; a driver that hands back text is parsed here. */
const parsed = <T>(value: T | string): T => (typeof value === 'string' ? (JSON.parse(value) as T) : value);

/**
 * The runner's signals as the database has them now, and whether they are worth answering at once:
 * controls after the cursors, runs that are gone, review requests not carried lately, a new version.
 */
async function look(db: Db, runnerId: string, body: SignalsBody): Promise<{ answer: SignalsResponse; worth: boolean }> {
  const [row] = await preparedRows<LookRow>(db, 'svc_runner_signals', LOOK, [
    runnerId,
    body.runs.map((run) => run.runId),
    body.runs.map((run) => run.after),
    REVIEW_REDELIVERY_MS,
  ]);
  const version = row?.version ?? '0';
  const owned = new Set(parsed(row?.owned ?? []));
  const missing = [...new Set(body.runs.map((run) => run.runId))].filter((runId) => !owned.has(runId));
  const controls = parsed(row?.controls ?? []) as SignalsResponse['controls'];
  const reviews = parsed(row?.reviews ?? []);
  const worth = controls.length > 0 || missing.length > 0 || reviews.some((review) => review.fresh) || version !== body.version;
  if (worth && reviews.length > 0) await markReviewRequestsDelivered(db, reviews.map((review) => review.id));
  return {
    worth,
    answer: {
      controls,
      missing,
      reviewRequests: reviews.map(({ id, runId, taskId, path, createdAt }) => ({ id, runId, taskId, path, createdAt: new Date(createdAt).toISOString() })),
      version,
    },
  };
}
