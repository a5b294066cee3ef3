/**
 * Authentication and the per-key sliding-window rate limit in one round trip, and the same limit for
 * other subjects: signed-in users (per user) and runner connections. (Failed sign-ins are throttled
 * apart, in sign_in_throttles: store/users.ts.)
 *
 * Requests are counted per subject (an API key, a user, a runner) in one-second buckets in the database,
 * so every server process on one PostgreSQL shares the limit. A window of N seconds counts the buckets of the last N+1 seconds (the
 * current second included), which errs on the side of refusing: no N-second span ever holds more than
 * the limit. Refused requests are not counted.
 *
 * Concurrency: the statement reads the buckets as of its snapshot, which misses the requests of the
 * same subject that commit while it runs, and those may have written another second's bucket (a burst
 * that straddles a second boundary let a few too many through). So every counted request also increments
 * the subject's tally row, a bucket at `second` -1 that no window includes and pruning keeps while the
 * subject lives: requests of one subject serialise on it, and its latest count minus the count the
 * snapshot saw is exactly what the snapshot missed. The limit therefore holds under any concurrency,
 * across processes too.
 */
import { and, asc, eq, gt, gte, lt, sql } from 'drizzle-orm';
import { preparedRows, type Db } from './db.js';
import { rateLimitBuckets, type runners } from './schema.js';

export interface RateLimits {
  perMinute: number;
  perHour: number;
}

export type AuthOutcome =
  | { kind: 'unauthorized' }
  | { kind: 'allowed'; keyId: string; workspaceId: string }
  | { kind: 'limited'; keyId: string; window: 'minute' | 'hour'; limit: number; retryAfterSeconds: number };

export type CountOutcome =
  | { kind: 'allowed' }
  | { kind: 'limited'; window: 'minute' | 'hour'; limit: number; retryAfterSeconds: number };

const MINUTE = 60;
const HOUR = 3600;
/** The `second` of a subject's tally row (see above); real buckets have seconds since the epoch. */
export const TALLY_SECOND = -1;

/**
 * The counting part of a statement: counts one request of the subject `k.id` when it fits both windows
 * (`short` and `long` seconds, limits $2 and $3). `bump` has a row exactly when the request was counted.
 */
function countingCtes(short: number, long: number): string {
  return `
    clock as (select floor(extract(epoch from clock_timestamp()))::bigint as s),
    prev as (
      select
        coalesce(sum(b.count) filter (where b.second >= c.s - ${short}), 0)::int as minute,
        coalesce(sum(b.count) filter (where b.second >= c.s - ${long}), 0)::int as hour,
        coalesce(sum(b.count) filter (where b.second = ${TALLY_SECOND}), 0)::int as tally
      from rate_limit_buckets b, clock c
      where b.key_id = (select id from k) and (b.second >= c.s - ${Math.max(short, long)} or b.second = ${TALLY_SECOND})
    ),
    -- The gate: the tally row's latest count (r.count) less the snapshot's (prev.tally) is what
    -- committed unseen since the snapshot; all of it is recent, so it counts in both windows.
    gate as (
      insert into rate_limit_buckets as r (key_id, second, count)
      select k.id, ${TALLY_SECOND}, 1 from k, prev p
      where p.minute < $2::int and p.hour < $3::int
      on conflict (key_id, second) do update set count = r.count + 1
      where (select minute from prev) + r.count - (select tally from prev) < $2::int
        and (select hour from prev) + r.count - (select tally from prev) < $3::int
      returning r.key_id
    ),
    bump as (
      insert into rate_limit_buckets as r (key_id, second, count)
      select g.key_id, c.s, 1 from gate g, clock c
      on conflict (key_id, second) do update set count = r.count + 1
      returning r.count
    )`;
}

/** One statement, prepared once per connection: it runs on every request authenticated by a key. */
const AUTHENTICATE_AND_COUNT = `
    with k as (
      select id, workspace_id from api_keys
      where key_hash = $1 and revoked_at is null and (expires_at is null or expires_at > now())
    ),
    -- Data-modifying CTEs run even when unread. lastUsedAt is kept to the minute, which spares the
    -- key row a write (and its lock) on every request.
    touch as (
      update api_keys set last_used_at = now()
      where id = (select id from k) and (last_used_at is null or last_used_at < now() - interval '60 seconds')
      returning 1
    ),${countingCtes(MINUTE, HOUR)}
    select k.id, k.workspace_id, (select count from bump) as bumped, (select s from clock)::text as now_s
    from k`;

/** Counts one request of a subject that is already known (a signed-in user, an email's sign-ins). */
const countSubject = (short: number, long: number) => `
    with k as (select $1::uuid as id),${countingCtes(short, long)}
    select (select count from bump) as bumped, (select s from clock)::text as now_s`;

const COUNT_REQUEST = countSubject(MINUTE, HOUR);

export async function authenticateAndCount(db: Db, keyHash: string, limits: RateLimits): Promise<AuthOutcome> {
  const rows = await preparedRows<{ id: string; workspace_id: string; bumped: number | null; now_s: string }>(
    db,
    'svc_authenticate_and_count',
    AUTHENTICATE_AND_COUNT,
    [keyHash, limits.perMinute, limits.perHour],
  );
  const row = rows[0];
  if (!row) return { kind: 'unauthorized' };
  if (row.bumped !== null && row.bumped !== undefined) {
    return { kind: 'allowed', keyId: row.id, workspaceId: row.workspace_id };
  }
  const refused = await refusal(db, row.id, Number(row.now_s), limits);
  return { kind: 'limited', keyId: row.id, ...refused };
}

/** Counts one request of `subject` (a signed-in user's id) against the same limits as a key's. */
export async function countRequest(db: Db, subject: string, limits: RateLimits): Promise<CountOutcome> {
  const [row] = await preparedRows<{ bumped: number | null; now_s: string }>(db, 'svc_count_request', COUNT_REQUEST, [
    subject,
    limits.perMinute,
    limits.perHour,
  ]);
  if (!row) throw new Error('the count statement returned no row');
  if (row.bumped !== null && row.bumped !== undefined) return { kind: 'allowed' };
  return { kind: 'limited', ...(await refusal(db, subject, Number(row.now_s), limits)) };
}

/**
 * Finds the runner connection whose credential hashes to `credentialHash` (revoked ones too: the caller
 * decides) and counts the request against its limits, in one round trip: a runner's event uploads and
 * long polls pay it on every request. The runner's id is the subject counted.
 */
const AUTHENTICATE_RUNNER_AND_COUNT = `
    with k as (select id from runners where credential_hash = $1),${countingCtes(MINUTE, HOUR)}
    select r.id, r.user_id, r.workspace_id, r.name, r.platform, r.runner_version, r.credential_hash, r.capabilities,
      r.work_version::text as work_version, r.enrolled_at, r.revoked_at, r.last_seen_at, r.created_at,
      (select count from bump) as bumped, (select s from clock)::text as now_s
    from runners r where r.id = (select id from k)`;

interface RunnerAuthRow {
  id: string;
  user_id: string;
  workspace_id: string;
  name: string;
  platform: string | null;
  runner_version: string | null;
  credential_hash: string;
  capabilities: unknown;
  work_version: string;
  enrolled_at: Date | string;
  revoked_at: Date | string | null;
  last_seen_at: Date | string | null;
  created_at: Date | string;
  bumped: number | null;
  now_s: string;
}

const dateOf = (value: Date | string): Date => (value instanceof Date ? value : new Date(value));

export type RunnerAuthOutcome =
  | { kind: 'unauthorized' }
  | { kind: 'allowed'; runner: typeof runners.$inferSelect }
  | ({ kind: 'limited'; runner: typeof runners.$inferSelect } & Omit<Extract<AuthOutcome, { kind: 'limited' }>, 'kind' | 'keyId'>);

export async function authenticateRunnerAndCount(db: Db, credentialHash: string, limits: RateLimits): Promise<RunnerAuthOutcome> {
  const [row] = await preparedRows<RunnerAuthRow>(db, 'svc_authenticate_runner_and_count', AUTHENTICATE_RUNNER_AND_COUNT, [
    credentialHash,
    limits.perMinute,
    limits.perHour,
  ]);
  if (!row) return { kind: 'unauthorized' };
  const runner = {
    id: row.id,
    userId: row.user_id,
    workspaceId: row.workspace_id,
    name: row.name,
    platform: row.platform,
    runnerVersion: row.runner_version,
    credentialHash: row.credential_hash,
    capabilities: typeof row.capabilities === 'string' ? (JSON.parse(row.capabilities) as unknown) : row.capabilities,
    workVersion: Number(row.work_version),
    enrolledAt: dateOf(row.enrolled_at),
    revokedAt: row.revoked_at === null ? null : dateOf(row.revoked_at),
    lastSeenAt: row.last_seen_at === null ? null : dateOf(row.last_seen_at),
    createdAt: dateOf(row.created_at),
  };
  if (row.bumped !== null && row.bumped !== undefined) return { kind: 'allowed', runner };
  return { kind: 'limited', runner, ...(await refusal(db, row.id, Number(row.now_s), limits)) };
}

type Window = { window: 'minute' | 'hour'; span: number; limit: number };

/** Works out which window refused the request and when enough of it will have slid by. */
function refusal(db: Db, subject: string, now: number, limits: RateLimits) {
  return refusalIn(db, subject, now, [
    { window: 'minute', span: MINUTE, limit: limits.perMinute },
    { window: 'hour', span: HOUR, limit: limits.perHour },
  ]);
}

/** `windows` shortest first: the first full one is the one that refused. */
async function refusalIn(
  db: Db,
  subject: string,
  now: number,
  windows: readonly Window[],
): Promise<{ window: 'minute' | 'hour'; limit: number; retryAfterSeconds: number }> {
  const longest = Math.max(...windows.map((window) => window.span));
  const buckets = await db
    .select({ second: rateLimitBuckets.second, count: rateLimitBuckets.count })
    .from(rateLimitBuckets)
    .where(and(eq(rateLimitBuckets.keyId, subject), gte(rateLimitBuckets.second, now - longest)))
    .orderBy(asc(rateLimitBuckets.second));
  const inWindow = (span: number) => buckets.filter((bucket) => bucket.second >= now - span);
  const total = (counted: typeof buckets) => counted.reduce((sum, bucket) => sum + bucket.count, 0);
  // A request refused by the gate's view of concurrent requests may find no window full here: the
  // longest then stands for it.
  const full = windows.find((window) => total(inWindow(window.span)) >= window.limit) ?? windows[windows.length - 1]!;
  const counted = inWindow(full.span);
  // Drop the oldest buckets until one more request fits; the last one dropped leaves the window at
  // its second + span + 1.
  let left = total(counted);
  let retryAt = now + 1;
  for (const bucket of counted) {
    if (left < full.limit) break;
    left -= bucket.count;
    retryAt = bucket.second + full.span + 1;
  }
  return { window: full.window, limit: full.limit, retryAfterSeconds: Math.max(1, retryAt - now) };
}

/**
 * Deletes buckets older than the longest window, and the tally rows of subjects that are gone (a
 * deleted key or user, an email with no recent attempts); the server calls it periodically. A living
 * subject's tally row stays: losing it while requests of that subject run would undercount what they
 * missed.
 */
export async function pruneRateLimitBuckets(db: Db): Promise<void> {
  await db
    .delete(rateLimitBuckets)
    .where(
      and(
        gt(rateLimitBuckets.second, TALLY_SECOND),
        lt(rateLimitBuckets.second, sql`floor(extract(epoch from clock_timestamp()))::bigint - ${HOUR + 60}`),
      ),
    );
  await db.execute(sql`
    delete from rate_limit_buckets r
    where r.second = ${TALLY_SECOND}
      and not exists (select 1 from api_keys k where k.id = r.key_id)
      and not exists (select 1 from users u where u.id = r.key_id)
      and not exists (select 1 from rate_limit_buckets b where b.key_id = r.key_id and b.second > ${TALLY_SECOND})`);
}
