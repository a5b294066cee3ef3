/** Sessions of signed-in users and one-time sign-in links. Tokens arrive here hashed; neither is stored. */
import { and, eq, isNull, ne, sql } from 'drizzle-orm';
import { preparedRows, type Db } from './db.js';
import { sessions, signInLinks } from './schema.js';
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
    await tx
      .update(signInLinks)
      .set({ expiresAt: sql`least(${signInLinks.expiresAt}, now())` })
      .where(and(eq(signInLinks.userId, input.userId), isNull(signInLinks.usedAt)));
    const [row] = await tx
      .insert(signInLinks)
      .values({ userId: input.userId, tokenHash: input.tokenHash, expiresAt: sql`now() + ${input.ttlMs}::float8 * interval '1 millisecond'` })
      .returning({ expiresAt: signInLinks.expiresAt });
    if (!row) throw new Error('insert returned no row');
    return row;
  });
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
  const [link] = await db.select({ usedAt: signInLinks.usedAt }).from(signInLinks).where(eq(signInLinks.tokenHash, tokenHash));
  if (!link) return { kind: 'unknown' };
  return link.usedAt ? { kind: 'used' } : { kind: 'expired' };
}
