/**
 * The user service: accounts, passwords, one-time sign-in links, sessions and workspace members. The
 * HTTP edge (sessions, /api/v1/auth, /api/v1/members) and `svc admin user` go through here.
 *
 * Secrets: session tokens and sign-in link tokens are 32 random bytes (base64url, 43 characters) of
 * which only the SHA-256 is stored; passwords are stored as scrypt hashes (domain/passwords.ts).
 */
import { createHash, randomBytes } from 'node:crypto';
import { AppError, ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import { dummyHash, hashPassword, needsRehash, passwordProblem, verifyPassword } from '../domain/passwords.js';
import { Email, type AddMemberBody, type ChangePasswordBody, type SessionResponse } from '../protocol/auth.js';
import type { Db } from '../store/db.js';
import { clearAttempts, countAttempt, type AttemptLimit } from '../store/rate-limit.js';
import { findRoutingConfigs } from '../store/routing.js';
import {
  createSession,
  createSignInLink,
  redeemSignInLink,
  revokeOtherSessions,
  revokeSession,
  revokeSessionByTokenHash,
} from '../store/sessions.js';
import {
  addMembership,
  ensurePersonalWorkspace,
  findMember,
  findMembership,
  findUser,
  findUserByEmail,
  insertUserIfNew,
  listMembers,
  listUserWorkspaces,
  setPasswordHash,
  type MemberRow,
  type Role,
  type UserRow,
} from '../store/users.js';
import { findWorkspace } from '../store/workspaces.js';
import type { Caller } from './tasks.js';

/** A session lives 30 days after its last use. */
export const SESSION_TTL_MS = 30 * 24 * 60 * 60_000;
/** A sign-in link works once, within 24 hours; a newer link for the same user replaces it. */
export const SIGN_IN_LINK_TTL_MS = 24 * 60 * 60_000;
/** Failed sign-ins (and wrong current passwords) per email: 10 in any 15 minutes, then 429. */
export const SIGN_IN_ATTEMPTS: AttemptLimit = { windowSeconds: 15 * 60, limit: 10 };
export const SIGN_IN_PATH = '/auth/sign-in';

const TOKEN_SHAPE = /^[A-Za-z0-9_-]{43}$/;

export function newToken(): string {
  return randomBytes(32).toString('base64url');
}

/** Tokens carry 256 bits of randomness, so a fast hash is enough to keep them out of the database. */
export function hashToken(token: string): string {
  return createHash('sha256').update(token).digest('hex');
}

export function isWellFormedToken(value: string): boolean {
  return TOKEN_SHAPE.test(value);
}

/** The link a person opens in a browser to sign in once. */
export function signInUrl(publicUrl: string, token: string): string {
  return `${publicUrl.replace(/\/+$/, '')}${SIGN_IN_PATH}/${token}`;
}

/** A new session, with the secrets that are shown once: the cookie's token and the CSRF token. */
export interface SessionGrant {
  user: UserRow;
  token: string;
  csrfToken: string;
  expiresAt: Date;
}

export interface SignInOptions {
  ttlMs: number;
  userAgent: string | null;
  /** The session token the request carried, if any: it is revoked, since the new session replaces it. */
  replacedToken: string | null;
}

const INVALID_CREDENTIALS = 'Invalid email or password';

/** Failed sign-ins are counted per email, known or not, under an id derived from the address. */
function attemptSubject(email: string): string {
  const hex = createHash('sha256').update(`sign-in\0${email.trim().toLowerCase()}`).digest('hex');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20, 32)}`;
}

function throttled(retryAfterSeconds: number): AppError {
  return new AppError('rate_limited', 'Too many failed sign-in attempts for this email; try again later', {
    details: { retryAfterSeconds },
    headers: { 'retry-after': String(retryAfterSeconds) },
  });
}

/** Counts an attempt before it is checked, so that parallel guesses cannot outrun the limit. */
async function admitAttempt(db: Db, email: string): Promise<void> {
  const outcome = await countAttempt(db, attemptSubject(email), SIGN_IN_ATTEMPTS);
  if (outcome.kind === 'limited') throw throttled(outcome.retryAfterSeconds);
}

async function grantSession(db: Db, user: UserRow, options: SignInOptions): Promise<SessionGrant> {
  const token = newToken();
  const csrfToken = newToken();
  const session = await createSession(db, {
    userId: user.id,
    tokenHash: hashToken(token),
    csrfToken,
    ttlMs: options.ttlMs,
    userAgent: options.userAgent?.slice(0, 512) ?? null,
  });
  if (options.replacedToken !== null) await revokeSessionByTokenHash(db, hashToken(options.replacedToken));
  return { user, token, csrfToken, expiresAt: session.expiresAt };
}

/**
 * Signs in with email and password. An unknown email, an account without a password and a wrong
 * password take the same path (a full scrypt verification) and give the same 401.
 */
export async function signInWithPassword(db: Db, input: { email: string; password: string }, options: SignInOptions): Promise<SessionGrant> {
  await admitAttempt(db, input.email);
  const user = await findUserByEmail(db, input.email.trim());
  const stored = user?.passwordHash ?? (await dummyHash());
  const matches = await verifyPassword(input.password, stored);
  if (!user?.passwordHash || !matches) throw new AppError('unauthorized', INVALID_CREDENTIALS);
  await clearAttempts(db, attemptSubject(input.email));
  // Hashes made with weaker parameters than today's are replaced while the password is at hand.
  if (needsRehash(user.passwordHash)) await setPasswordHash(db, user.id, await hashPassword(input.password));
  return grantSession(db, user, options);
}

export type LinkSignIn = { kind: 'signed-in'; grant: SessionGrant } | { kind: 'used' | 'expired' | 'unknown' };

/** Redeems a one-time sign-in link and opens a session; the link and the session are one transaction. */
export async function signInWithLink(db: Db, token: string, options: SignInOptions): Promise<LinkSignIn> {
  if (!isWellFormedToken(token)) return { kind: 'unknown' };
  return db.transaction(async (tx) => {
    const redeemed = await redeemSignInLink(tx, hashToken(token));
    if (redeemed.kind !== 'redeemed') return redeemed;
    const user = await findUser(tx, redeemed.userId);
    if (!user) return { kind: 'unknown' };
    return { kind: 'signed-in', grant: await grantSession(tx, user, options) };
  });
}

export async function signOut(db: Db, sessionId: string): Promise<void> {
  await revokeSession(db, sessionId);
}

/** What GET /api/v1/auth/session answers (dates still as Dates). */
export async function describeSession(
  db: Db,
  session: { userId: string; csrfToken: string; expiresAt: Date },
): Promise<Omit<SessionResponse, 'expiresAt'> & { expiresAt: Date }> {
  const user = await findUser(db, session.userId);
  if (!user) throw new AppError('unauthorized', 'Invalid or expired session; sign in again');
  return {
    user: presentUser(user),
    workspaces: await listUserWorkspaces(db, user.id),
    csrfToken: session.csrfToken,
    expiresAt: session.expiresAt,
  };
}

export function presentUser(user: UserRow): { id: string; email: string; name: string | null } {
  return { id: user.id, email: user.email, name: user.name };
}

/**
 * Sets or changes the password. Once one is set, the current one is required (and wrong guesses count
 * against the email's sign-in attempts). Every other session of the user is signed out.
 */
export async function changePassword(db: Db, session: { userId: string; sessionId: string }, body: ChangePasswordBody): Promise<void> {
  const problem = passwordProblem(body.newPassword);
  if (problem) throw ValidationError.field('newPassword', problem);
  const user = await findUser(db, session.userId);
  if (!user) throw new AppError('unauthorized', 'Invalid or expired session; sign in again');
  if (user.passwordHash) {
    if (body.currentPassword === undefined) throw ValidationError.field('currentPassword', 'is required once a password is set');
    await admitAttempt(db, user.email);
    if (!(await verifyPassword(body.currentPassword, user.passwordHash))) throw new AppError('forbidden', 'The current password is wrong');
    await clearAttempts(db, attemptSubject(user.email));
  }
  const hash = await hashPassword(body.newPassword);
  await db.transaction(async (tx) => {
    await setPasswordHash(tx, user.id, hash);
    await revokeOtherSessions(tx, user.id, session.sessionId);
  });
}

/** The names a user's personal workspace may take: short and readable, or (if that one is taken) unique. */
function personalWorkspaceNames(userId: string): string[] {
  const hex = userId.replace(/-/g, '');
  return [`personal-${hex.slice(0, 12)}`, `personal-${hex}`];
}

function parseEmail(email: string): string {
  const parsed = Email.safeParse(email.trim());
  if (!parsed.success) throw ValidationError.field('email', 'must be an email address');
  return parsed.data;
}

/**
 * The account for `email`, created with its personal workspace (plan free, the user its owner) when
 * new. Call inside a transaction: a new account and its workspace appear together.
 */
export async function findOrCreateAccount(
  tx: Db,
  input: { email: string; name?: string | undefined; defaultAgent: string },
): Promise<{ user: UserRow; created: boolean }> {
  const name = input.name?.trim() || null;
  if (name !== null && name.length > 200) throw ValidationError.field('name', 'must be at most 200 characters');
  const account = await insertUserIfNew(tx, { email: parseEmail(input.email), name });
  if (account.created) {
    await ensurePersonalWorkspace(tx, { userId: account.user.id, names: personalWorkspaceNames(account.user.id), defaultAgent: input.defaultAgent });
  }
  return account;
}

/** A fresh one-time link for the user; earlier unused ones stop working. */
export async function issueSignInLink(db: Db, userId: string, publicUrl: string): Promise<{ url: string; expiresAt: Date }> {
  const token = newToken();
  const { expiresAt } = await createSignInLink(db, { userId, tokenHash: hashToken(token), ttlMs: SIGN_IN_LINK_TTL_MS });
  return { url: signInUrl(publicUrl, token), expiresAt };
}

export interface AddedMember {
  member: MemberRow;
  accountCreated: boolean;
  signInLink: { url: string; expiresAt: Date } | null;
}

const ROLE_RANK: Record<Role, number> = { member: 0, admin: 1, owner: 2 };

/**
 * What a caller may do with the members of its workspace: an API key acts for the workspace (as its
 * owner would); a signed-in user needs to be an owner or admin, and only owners make owners.
 */
async function assertMayAddMember(db: Db, caller: Caller, role: Role): Promise<void> {
  if (caller.keyId !== null) return;
  if (caller.userId === null) throw new AppError('forbidden', 'Only workspace owners and admins can add members');
  const membership = await findMembership(db, caller.workspaceId, caller.userId);
  if (!membership || ROLE_RANK[membership.role] < ROLE_RANK.admin) {
    throw new AppError('forbidden', 'Only workspace owners and admins can add members');
  }
  if (ROLE_RANK[role] > ROLE_RANK[membership.role]) throw new AppError('forbidden', 'Only owners can add owners');
}

/**
 * Adds a user to the caller's workspace, creating the account when the email has none. The one-time
 * sign-in link is answered only for an account this call created: handing one out for an existing
 * account would let any workspace admin take over anyone's account.
 */
export async function addMember(db: Db, caller: Caller, body: AddMemberBody, options: { publicUrl: string }): Promise<AddedMember> {
  const workspace = await findWorkspace(db, caller.workspaceId);
  if (!workspace) throw new NotFoundError('Workspace not found');
  await assertMayAddMember(db, caller, body.role);
  if (workspace.personalUserId !== null) throw new AppError('forbidden', 'A personal workspace has no other members');
  const { fallback } = await findRoutingConfigs(db, workspace.id, null);
  if (!fallback) throw new AppError('internal_error', undefined, { cause: new Error(`workspace ${workspace.id} has no default routing config`) });
  return db.transaction(async (tx) => {
    // A new member's personal workspace starts with the agent of the workspace that added them.
    const account = await findOrCreateAccount(tx, { email: body.email, name: body.name, defaultAgent: fallback.agent });
    if (!(await addMembership(tx, { workspaceId: workspace.id, userId: account.user.id, role: body.role }))) {
      throw new ConflictError(`${account.user.email} is already a member of this workspace`);
    }
    const member = await findMember(tx, workspace.id, account.user.id);
    if (!member) throw new Error('the membership just added cannot be found');
    const signInLink = account.created ? await issueSignInLink(tx, account.user.id, options.publicUrl) : null;
    return { member, accountCreated: account.created, signInLink };
  });
}

export async function workspaceMembers(db: Db, caller: Caller): Promise<MemberRow[]> {
  return listMembers(db, caller.workspaceId);
}
