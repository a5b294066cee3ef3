/**
 * Sessions of signed-in users, one-time sign-in links (tokens arrive here hashed; neither is stored) and
 * the throttle of failed password sign-ins.
 */
import { and, eq, isNull, lt, ne, sql } from 'drizzle-orm';
import { preparedRows, queryRows, type Db } from './db.js';
import { sessions, signInLinks, signInThrottles } from './schema.js';
import type { Role } from './users.js';

export type SessionRow = typeof sessions.$inferSelect;

/** How long ended sessions and spent links stay (for the record) before a new one of the user clears them. */
const ENDED_KEPT = sql`interval '7 days'`;

/**
 * Opens a session. The user's sessions that ended (expired or revoked) over a week ago go at the same
 * time, so that the table holds what people use rather than every sign-in ever.
 */
export async function createSession(
  db: Db,
  input: { userId: string; tokenHash: string; csrfToken: string; ttlMs: number; userAgent: string | null },
): Promise<SessionRow> {
  await db
    .delete(sessions)
    .where(and(eq(sessions.userId, input.userId), sql`least(${sessions.revokedAt}, ${sessions.expiresAt}) < now() - ${ENDED_KEPT}`));
  const [row] = await db
    .insert(sessions)
    .values({
      userId: input.userId,
      tokenHash: input.tokenHash,
      csrfToken: input.csrfToken,
      expiresAt: sql`now() + ${input.ttlMs}::float8 * interval '1 millisecond'`,
      userAgent: input.userAgent,
    })
    .returning();
  if (!row) throw new Error('insert returned no row');
  return row;
}

export interface ResolvedSession {
  sessionId: string;
  userId: string;
  csrfToken: string;
  expiresAt: Date;
  /** Whether this request moved the expiry (at most once a minute): the cookie's lifetime moves with it. */
  renewed: boolean;
  /** The workspace the request acts in, if the user is a member of it. */
  workspace: { id: string; role: Role; personal: boolean } | null;
}

/**
 * One statement per session request: finds the live session, slides its expiry (kept to the minute, like
 * api_keys.last_used_at, which spares the row a write on every request) and finds the user's membership
 * in the workspace asked for, or in their personal workspace when none is.
 */
const RESOLVE_SESSION = `
    with s as (
      select id, user_id, csrf_token, expires_at from sessions
      where token_hash = $1 and revoked_at is null and expires_at > now()
    ),
    renew as (
      update sessions set last_seen_at = now(), expires_at = now() + $3::float8 * interval '1 millisecond'
      where id = (select id from s) and last_seen_at < now() - interval '60 seconds'
      returning expires_at
    ),
    w as (
      select m.workspace_id, m.role, coalesce(ws.personal_user_id = m.user_id, false) as personal
      from memberships m join workspaces ws on ws.id = m.workspace_id
      where m.user_id = (select user_id from s)
        and case when $2::uuid is null then ws.personal_user_id = m.user_id else m.workspace_id = $2::uuid end
    )
    select s.id, s.user_id, s.csrf_token,
      (extract(epoch from coalesce((select expires_at from renew), s.expires_at)) * 1000)::float8 as expires_ms,
      exists (select 1 from renew) as renewed,
      w.workspace_id, w.role, w.personal
    from s left join w on true`;

export async function resolveSession(
  db: Db,
  input: { tokenHash: string; workspaceId: string | null; ttlMs: number },
): Promise<ResolvedSession | null> {
  const [row] = await preparedRows<{
    id: string;
    user_id: string;
    csrf_token: string;
    expires_ms: number;
    renewed: boolean;
    workspace_id: string | null;
    role: Role | null;
    personal: boolean | null;
  }>(db, 'svc_resolve_session', RESOLVE_SESSION, [input.tokenHash, input.workspaceId, input.ttlMs]);
  if (!row) return null;
  return {
    sessionId: row.id,
    userId: row.user_id,
    csrfToken: row.csrf_token,
    expiresAt: new Date(Number(row.expires_ms)),
    renewed: row.renewed,
    workspace: row.workspace_id && row.role ? { id: row.workspace_id, role: row.role, personal: row.personal === true } : null,
  };
}

export async function findSession(db: Db, sessionId: string): Promise<SessionRow | null> {
  const [row] = await db.select().from(sessions).where(eq(sessions.id, sessionId));
  return row ?? null;
}

export async function revokeSession(db: Db, sessionId: string): Promise<void> {
  await db.update(sessions).set({ revokedAt: sql`now()` }).where(and(eq(sessions.id, sessionId), isNull(sessions.revokedAt)));
}

export async function revokeSessionByTokenHash(db: Db, tokenHash: string): Promise<void> {
  await db.update(sessions).set({ revokedAt: sql`now()` }).where(and(eq(sessions.tokenHash, tokenHash), isNull(sessions.revokedAt)));
}

/** Revokes every live session of the user but `keep`; returns how many it revoked. */
export async function revokeOtherSessions(db: Db, userId: string, keep: string | null): Promise<number> {
  const rows = await db
    .update(sessions)
    .set({ revokedAt: sql`now()` })
    .where(and(eq(sessions.userId, userId), isNull(sessions.revokedAt), keep ? ne(sessions.id, keep) : undefined))
    .returning({ id: sessions.id });
  return rows.length;
}

/**
 * Stores a new link for the user. Older unused links of the user stop working: only the newest one
 * handed out can be used. Links spent (used or expired) over a week ago are deleted.
 */
export async function createSignInLink(db: Db, input: { userId: string; tokenHash: string; ttlMs: number }): Promise<{ expiresAt: Date }> {
  return db.transaction(async (tx) => {
    await tx
      .delete(signInLinks)
      .where(and(eq(signInLinks.userId, input.userId), sql`least(${signInLinks.usedAt}, ${signInLinks.expiresAt}) < now() - ${ENDED_KEPT}`));
    await expireSignInLinks(tx, input.userId);
    const [row] = await tx
      .insert(signInLinks)
      .values({ userId: input.userId, tokenHash: input.tokenHash, expiresAt: sql`now() + ${input.ttlMs}::float8 * interval '1 millisecond'` })
      .returning({ expiresAt: signInLinks.expiresAt });
    if (!row) throw new Error('insert returned no row');
    return row;
  });
}

/** Ends every unused sign-in link of the user (a newer link replaces them; a new password ends them). */
export async function expireSignInLinks(db: Db, userId: string): Promise<void> {
  await db
    .update(signInLinks)
    .set({ expiresAt: sql`least(${signInLinks.expiresAt}, now())` })
    .where(and(eq(signInLinks.userId, userId), isNull(signInLinks.usedAt)));
}

export type LinkRedemption = { kind: 'redeemed'; userId: string } | { kind: 'used' } | { kind: 'expired' } | { kind: 'unknown' };

/**
 * Marks the link used if it is live. The conditional update is what makes a link work once: of two
 * concurrent redemptions only one updates the row.
 */
export async function redeemSignInLink(db: Db, tokenHash: string): Promise<LinkRedemption> {
  const [redeemed] = await db
    .update(signInLinks)
    .set({ usedAt: sql`now()` })
    .where(and(eq(signInLinks.tokenHash, tokenHash), isNull(signInLinks.usedAt), sql`${signInLinks.expiresAt} > now()`))
    .returning({ userId: signInLinks.userId });
  if (redeemed) return { kind: 'redeemed', userId: redeemed.userId };
  return inspectSignInLink(db, tokenHash);
}

/** What a link would do if redeemed now, without redeeming it (the page a GET of the link shows). */
export async function inspectSignInLink(db: Db, tokenHash: string): Promise<LinkRedemption> {
  const [link] = await db
    .select({ userId: signInLinks.userId, usedAt: signInLinks.usedAt, live: sql<boolean>`${signInLinks.expiresAt} > now()` })
    .from(signInLinks)
    .where(eq(signInLinks.tokenHash, tokenHash));
  if (!link) return { kind: 'unknown' };
  if (link.usedAt) return { kind: 'used' };
  return link.live ? { kind: 'redeemed', userId: link.userId } : { kind: 'expired' };
}

/**
 * How failed sign-ins of one subject (an email, a network) are throttled: the first `limit - 1` failures
 * are free; the one that reaches `limit` locks the subject for `lockSeconds`, and each failure after a lock
 * doubles it, up to `maxLockSeconds`. Failures are forgotten `forgetSeconds` after the last lock ends
 * (or after the last failure, below the limit).
 */
export interface ThrottlePolicy {
  limit: number;
  lockSeconds: number;
  maxLockSeconds: number;
  forgetSeconds: number;
}

/** The lock, in seconds, that `failures` failures impose from the last one (SQL over parameters $2-$4). */
const lockAfter = (failures: string) =>
  `(case when ${failures} < $2::int then 0 else least($4::float8, $3::float8 * power(2, least(${failures} - $2::int, 40))) end)`;

/**
 * Counts an attempt of `subject` as a failure before it is checked, unless the subject is locked: so
 * parallel guesses cannot outrun the limit. An attempt that then succeeds is withdrawn
 * (withdrawSignInAttempt). One statement: concurrent attempts of a subject serialise on its row.
 * `counted` is what withdrawing needs.
 */
const ADMIT_ATTEMPT = `
    with before as (select last_failure_at::text as at from sign_in_throttles where subject = $1)
    insert into sign_in_throttles as t (subject, failures, last_failure_at) values ($1, 1, now())
    on conflict (subject) do update set
      failures = case when t.last_failure_at + (${lockAfter('t.failures')} + $5::float8) * interval '1 second' < now() then 1 else t.failures + 1 end,
      last_failure_at = now()
    where not (t.failures >= $2::int and t.last_failure_at + ${lockAfter('t.failures')} * interval '1 second' > now())
    returning t.last_failure_at::text as at, (select at from before) as previous`;

const RETRY_AFTER = `
    select greatest(1, ceil(extract(epoch from t.last_failure_at + ${lockAfter('t.failures')} * interval '1 second' - now())))::int as seconds
    from sign_in_throttles t where subject = $1`;

/** An attempt counted by admitSignInAttempt: its subject, and the failure time it replaced. */
export interface CountedAttempt {
  subject: string;
  at: string;
  previous: string | null;
}

export async function admitSignInAttempt(
  db: Db,
  subject: string,
  policy: ThrottlePolicy,
): Promise<{ kind: 'counted'; attempt: CountedAttempt } | { kind: 'locked'; retryAfterSeconds: number }> {
  const params = [subject, policy.limit, policy.lockSeconds, policy.maxLockSeconds];
  const [counted] = await preparedRows<{ at: string; previous: string | null }>(db, 'svc_admit_sign_in', ADMIT_ATTEMPT, [...params, policy.forgetSeconds]);
  if (counted) return { kind: 'counted', attempt: { subject, at: counted.at, previous: counted.previous } };
  const [lock] = await preparedRows<{ seconds: number }>(db, 'svc_sign_in_retry_after', RETRY_AFTER, params);
  return { kind: 'locked', retryAfterSeconds: Math.max(1, Number(lock?.seconds ?? 1)) };
}

/**
 * Takes back an attempt that succeeded: one failure less, and the time of the last failure as it was
 * (unless another attempt has counted since). A row left without failures says nothing and goes. Two
 * statements, each on the subject's row: an attempt counted between them makes the row count again, and
 * the delete then leaves it.
 */
export async function withdrawSignInAttempt(db: Db, attempt: CountedAttempt): Promise<void> {
  await queryRows(
    db,
    sql`update ${signInThrottles} set failures = greatest(${signInThrottles.failures} - 1, 0),
      last_failure_at = case when last_failure_at = ${attempt.at}::timestamptz then coalesce(${attempt.previous}::timestamptz, last_failure_at) else last_failure_at end
      where ${signInThrottles.subject} = ${attempt.subject}`,
  );
  await db.delete(signInThrottles).where(and(eq(signInThrottles.subject, attempt.subject), sql`${signInThrottles.failures} <= 0`));
}

/** Forgets the failures of `subject` (the right password of an email clears its failures). */
export async function clearSignInFailures(db: Db, subject: string): Promise<void> {
  await db.delete(signInThrottles).where(eq(signInThrottles.subject, subject));
}

/**
 * Deletes rows whose last failure is two days old: by then every lock (a day at most) has ended and its
 * failures are forgotten (a day after). The condition is the indexed column alone, so a failed sign-in
 * that prunes reads only the stale rows, not the table. Rows without failures never stay (withdrawSignInAttempt).
 */
export async function pruneSignInThrottles(db: Db): Promise<void> {
  await db.delete(signInThrottles).where(lt(signInThrottles.lastFailureAt, sql`now() - interval '2 days'`));
}
