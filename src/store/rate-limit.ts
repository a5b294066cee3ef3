/**
 * Authentication and the per-key sliding-window rate limit in one round trip.
 *
 * Requests are counted per key in one-second buckets in the database, so every server process on one
 * PostgreSQL shares the limit. A window of N seconds counts the buckets of the last N+1 seconds (the
 * current second included), which errs on the side of refusing: no N-second span ever holds more than
 * the limit. Concurrent requests of one second serialise on the bucket row, whose ON CONFLICT condition
 * sees the latest count, so within a second the limit holds exactly under concurrency. Across a second
 * boundary the earlier buckets are read from the statement's snapshot, so a request of the new second
 * can miss a concurrent, not yet committed request of the old one: the limit may be exceeded by the
 * requests in flight at that instant (a few at most). Refused requests are not counted.
 */
import { and, asc, eq, gte, lt, sql } from 'drizzle-orm';
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
        coalesce(sum(b.count) filter (where b.second >= c.s - ${MINUTE} and b.second < c.s), 0)::int as minute,
        coalesce(sum(b.count) filter (where b.second < c.s), 0)::int as hour
      from rate_limit_buckets b, clock c
      where b.key_id = (select id from k) and b.second >= c.s - ${HOUR}
    ),
    bump as (
      insert into rate_limit_buckets as r (key_id, second, count)
      select k.id, c.s, 1 from k, clock c, prev p
      where p.minute < $2::int and p.hour < $3::int
      on conflict (key_id, second) do update set count = r.count + 1
      where r.count + (select minute from prev) < $2::int
        and r.count + (select hour from prev) < $3::int
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

/** Deletes buckets older than the longest window; the server calls it periodically. */
export async function pruneRateLimitBuckets(db: Db): Promise<void> {
  await db
    .delete(rateLimitBuckets)
    .where(lt(rateLimitBuckets.second, sql`floor(extract(epoch from clock_timestamp()))::bigint - ${HOUR + 60}`));
}
