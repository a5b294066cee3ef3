/**
 * Authentication and the per-key sliding-window rate limit in one round trip.
 *
 * Requests are counted per key in one-second buckets in the database, so every server process on one
 * PostgreSQL shares the limit. A window of N seconds counts the buckets of the last N+1 seconds (the
 * current second included), which errs on the side of refusing: no N-second span ever holds more than
 * the limit. Refused requests are not counted.
 *
 * Concurrency: the statement reads the buckets as of its snapshot, which misses the requests of the
 * same key that commit while it runs, and those may have written another second's bucket (a burst that
 * straddles a second boundary let a few too many through). So every counted request also increments
 * the key's tally row, a bucket at `second` -1 that no window includes and pruning keeps: requests of
 * one key serialise on it, and its latest count minus the count the snapshot saw is exactly what the
 * snapshot missed. The limit therefore holds under any concurrency, across processes too.
 */
import { and, asc, eq, gt, gte, lt, sql } from 'drizzle-orm';
import { preparedRows, type Db } from './db.js';
import { rateLimitBuckets } from './schema.js';

export interface RateLimits {
  perMinute: number;
  perHour: number;
}

export type AuthOutcome =
  | { kind: 'unauthorized' }
  | { kind: 'allowed'; keyId: string; workspaceId: string }
  | { kind: 'limited'; keyId: string; window: 'minute' | 'hour'; limit: number; retryAfterSeconds: number };

const MINUTE = 60;
const HOUR = 3600;
/** The `second` of a key's tally row (see above); real buckets have seconds since the epoch. */
export const TALLY_SECOND = -1;

/** One statement, prepared once per connection: it runs on every authenticated request. */
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
    ),
    clock as (select floor(extract(epoch from clock_timestamp()))::bigint as s),
    prev as (
      select
        coalesce(sum(b.count) filter (where b.second >= c.s - ${MINUTE}), 0)::int as minute,
        coalesce(sum(b.count) filter (where b.second >= c.s - ${HOUR}), 0)::int as hour,
        coalesce(sum(b.count) filter (where b.second = ${TALLY_SECOND}), 0)::int as tally
      from rate_limit_buckets b, clock c
      where b.key_id = (select id from k) and (b.second >= c.s - ${HOUR} or b.second = ${TALLY_SECOND})
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
    )
    select k.id, k.workspace_id, (select count from bump) as bumped, (select s from clock)::text as now_s
    from k`;

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
  return refusal(db, row.id, Number(row.now_s), limits);
}

/** Works out which window refused the request and when enough of it will have slid by. */
async function refusal(
  db: Db,
  keyId: string,
  now: number,
  limits: RateLimits,
): Promise<Extract<AuthOutcome, { kind: 'limited' }>> {
  const buckets = await db
    .select({ second: rateLimitBuckets.second, count: rateLimitBuckets.count })
    .from(rateLimitBuckets)
    .where(and(eq(rateLimitBuckets.keyId, keyId), gte(rateLimitBuckets.second, now - HOUR)))
    .orderBy(asc(rateLimitBuckets.second));
  const inWindow = (span: number) => buckets.filter((bucket) => bucket.second >= now - span);
  const minute = inWindow(MINUTE);
  const minuteTotal = minute.reduce((sum, bucket) => sum + bucket.count, 0);
  const [window, span, limit, counted] =
    minuteTotal >= limits.perMinute
      ? (['minute', MINUTE, limits.perMinute, minute] as const)
      : (['hour', HOUR, limits.perHour, buckets] as const);
  // Drop the oldest buckets until one more request fits; the last one dropped leaves the window at
  // its second + span + 1.
  let total = counted.reduce((sum, bucket) => sum + bucket.count, 0);
  let retryAt = now + 1;
  for (const bucket of counted) {
    if (total < limit) break;
    total -= bucket.count;
    retryAt = bucket.second + span + 1;
  }
  return { kind: 'limited', keyId, window, limit, retryAfterSeconds: Math.max(1, retryAt - now) };
}

/**
 * Deletes buckets older than the longest window; the server calls it periodically. Tally rows stay (one
 * per key, deleted with it): losing one while requests of its key run would undercount what they missed.
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
}
