/**
 * The user service: accounts, passwords, one-time sign-in links, sessions and workspace members. The
 * HTTP edge (sessions, /api/v1/auth, /api/v1/members) and `svc admin user` go through here.
 *
 * Secrets: session tokens and sign-in link tokens are 32 random bytes (base64url, 43 characters) of
 * which only the SHA-256 is stored; passwords are stored as scrypt hashes (domain/passwords.ts).
 */
import { randomBytes } from 'node:crypto';
import { isIPv4, isIPv6 } from 'node:net';
import { AppError, ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import { dummyHash, hashPassword, needsRehash, passwordProblem, verifyPassword } from '../domain/passwords.js';
import { hashSecret } from '../domain/secrets.js';
import { Email, type AddMemberBody, type ChangePasswordBody, type SessionResponse } from '../protocol/auth.js';
import type { Db } from '../store/db.js';
import { findRoutingConfigs } from '../store/routing.js';
import {
  admitSignInAttempt,
  clearSignInFailures,
  createSession,
  createSignInLink,
  expireSignInLinks,
  inspectSignInLink,
  pruneSignInThrottles,
  redeemSignInLink,
  revokeOtherSessions,
  revokeSession,
  revokeSessionByTokenHash,
  withdrawSignInAttempt,
  type CountedAttempt,
  type ThrottlePolicy,
} from '../store/sessions.js';
import {
  addMembership,
  confirmUser,
  ensurePersonalWorkspace,
  findMember,
  findMembership,
  findUser,
  findUserByEmail,
  insertUserIfNew,
  listMembers,
  listUserWorkspaces,
  lockUser,
  replacePasswordHash,
  setPasswordHash,
  type MemberRow,
  type Role,
  type UserRow,
} from '../store/users.js';
import { findWorkspace, type Workspace } from '../store/workspaces.js';
import type { Caller } from './tasks.js';

/** A session lives 30 days after its last use. */
export const SESSION_TTL_MS = 30 * 24 * 60 * 60_000;
/** A sign-in link works once, within 24 hours; a newer link for the same user replaces it. */
export const SIGN_IN_LINK_TTL_MS = 24 * 60 * 60_000;
const MINUTE = 60;
const HOUR = 60 * MINUTE;
/**
 * Failed sign-ins (and wrong current passwords) per email: 9 are free, the tenth locks the address for
 * 15 minutes, each failure after a lock doubles it (up to a day); a day after the last lock they are
 * forgotten, and the right password forgets them at once.
 */
export const EMAIL_THROTTLE: ThrottlePolicy = { limit: 10, lockSeconds: 15 * MINUTE, maxLockSeconds: 24 * HOUR, forgetSeconds: 24 * HOUR };
/**
 * Failed sign-ins per client network (an IPv4 address, an IPv6 /64), whatever the email: many people may
 * share one address, so the limit is higher and an hour without failures forgets them. A success there
 * does not clear them (anyone could sign in to an account of their own between guesses).
 */
export const NETWORK_THROTTLE: ThrottlePolicy = { limit: 100, lockSeconds: 15 * MINUTE, maxLockSeconds: 24 * HOUR, forgetSeconds: HOUR };
export const SIGN_IN_PATH = '/auth/sign-in';

const TOKEN_SHAPE = /^[A-Za-z0-9_-]{43}$/;

export function newToken(): string {
  return randomBytes(32).toString('base64url');
}

/** Tokens carry 256 bits of randomness, so a fast hash is enough to keep them out of the database. */
export const hashToken: (token: string) => string = hashSecret;

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

/** Where a password is being tried: the client's address, for the per-network throttle. */
export interface AttemptOrigin {
  ip: string;
}

export interface SignInOptions extends AttemptOrigin {
  ttlMs: number;
  userAgent: string | null;
  /** The session token the request carried, if any: it is revoked, since the new session replaces it. */
  replacedToken: string | null;
}

const INVALID_CREDENTIALS = 'Invalid email or password';

/** The network an address stands for: an IPv4 address itself, the /64 of an IPv6 one. */
export function networkOf(ip: string): string {
  const mapped = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(ip)?.[1];
  if (mapped !== undefined && isIPv4(mapped)) return mapped;
  if (!isIPv6(ip)) return ip;
  const [head = '', tail = ''] = ip.toLowerCase().split('::');
  const left = head === '' ? [] : head.split(':');
  const right = tail === '' ? [] : tail.split(':');
  const groups = ip.includes('::') ? [...left, ...Array<string>(8 - left.length - right.length).fill('0'), ...right] : left;
  return `${groups.slice(0, 4).map((group) => group.replace(/^0+(?=.)/, '')).join(':')}::/64`;
}

/** The throttles' subjects: hashes, so that the table holds no address, known or not. */
export const emailSubject = (email: string) => hashSecret(`sign-in\0email\0${email.trim().toLowerCase()}`);
export const networkSubject = (ip: string) => hashSecret(`sign-in\0network\0${networkOf(ip)}`);

function throttled(retryAfterSeconds: number, of: 'this email' | 'your network'): AppError {
  return new AppError('rate_limited', `Too many failed sign-in attempts for ${of}; try again later`, {
    details: { retryAfterSeconds },
    headers: { 'retry-after': String(retryAfterSeconds) },
  });
}

/**
 * Tries a password under the throttles of its email and of the client's network. The attempt counts as
 * a failure of both before it is checked (parallel guesses cannot outrun a limit) and is taken back when
 * it succeeds: only failures count. The right password also forgets the email's failures.
 */
async function throttledAttempt<T>(db: Db, email: string, origin: AttemptOrigin, check: () => Promise<T | null>): Promise<T | null> {
  const network = await admitSignInAttempt(db, networkSubject(origin.ip), NETWORK_THROTTLE);
  if (network.kind === 'locked') throw throttled(network.retryAfterSeconds, 'your network');
  const address = await admitSignInAttempt(db, emailSubject(email), EMAIL_THROTTLE);
  if (address.kind === 'locked') {
    await withdrawSignInAttempt(db, network.attempt);
    throw throttled(address.retryAfterSeconds, 'this email');
  }
  let outcome: T | null = null;
  try {
    outcome = await check();
  } finally {
    if (outcome !== null) await succeeded(db, network.attempt, address.attempt);
    else await pruneSignInThrottles(db);
  }
  return outcome;
}

async function succeeded(db: Db, network: CountedAttempt, address: CountedAttempt): Promise<void> {
  await withdrawSignInAttempt(db, network);
  await clearSignInFailures(db, address.subject);
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
  return openPasswordSession(db, await verifySignInPassword(db, input, options), options);
}

/** A password found right for an account, and the hash it was checked against. */
export interface VerifiedPassword {
  user: UserRow;
  passwordHash: string;
  /** A hash of the same password with today's parameters, when the verified one was made with weaker ones. */
  rehash: string | null;
}

/**
 * The first half of a password sign-in: checks the password under the throttles (401 when wrong). scrypt
 * runs here, outside any transaction, so that no row stays locked for its tens of milliseconds.
 */
export async function verifySignInPassword(db: Db, input: { email: string; password: string }, origin: AttemptOrigin): Promise<VerifiedPassword> {
  const signedIn = await throttledAttempt(db, input.email, origin, async () => {
    const user = await findUserByEmail(db, input.email.trim());
    const matches = await verifyPassword(input.password, user?.passwordHash ?? (await dummyHash()));
    return matches && user?.passwordHash ? { user, passwordHash: user.passwordHash } : null;
  });
  if (!signedIn) throw new AppError('unauthorized', INVALID_CREDENTIALS);
  // Hashes made with weaker parameters than today's are replaced while the password is at hand.
  const rehash = needsRehash(signedIn.passwordHash) ? await hashPassword(input.password) : null;
  return { ...signedIn, rehash };
}

/**
 * The second half: opens the session only if the account still has the hash that was verified. Between
 * the two the password may have been changed or cleared (an operator taking the account back revokes
 * every session in the same transaction): the user's row is locked first, so that such a change either
 * committed before (the same 401 as a wrong password) or waits for this session and then revokes it.
 */
export async function openPasswordSession(db: Db, verified: VerifiedPassword, options: SignInOptions): Promise<SessionGrant> {
  const grant = await db.transaction(async (tx) => {
    const user = await lockUser(tx, verified.user.id);
    if (!user || user.passwordHash !== verified.passwordHash) return null;
    if (verified.rehash !== null) await replacePasswordHash(tx, user.id, verified.passwordHash, verified.rehash);
    return grantSession(tx, user, options);
  });
  if (!grant) throw new AppError('unauthorized', INVALID_CREDENTIALS);
  return grant;
}

export type LinkSignIn = { kind: 'signed-in'; grant: SessionGrant } | { kind: 'used' | 'expired' | 'unknown' };

/**
 * Redeems a one-time sign-in link and opens a session; the link and the session are one transaction. The
 * user's row is locked before the link is redeemed (the order an operator taking the account back keeps):
 * a link that take-back ended meanwhile is then found expired by the conditional redemption.
 */
export async function signInWithLink(db: Db, token: string, options: SignInOptions): Promise<LinkSignIn> {
  if (!isWellFormedToken(token)) return { kind: 'unknown' };
  const tokenHash = hashToken(token);
  return db.transaction(async (tx) => {
    const link = await inspectSignInLink(tx, tokenHash);
    if (link.kind !== 'redeemed') return link;
    const user = await lockUser(tx, link.userId);
    if (!user) return { kind: 'unknown' };
    const redeemed = await redeemSignInLink(tx, tokenHash);
    if (redeemed.kind !== 'redeemed') return redeemed;
    return { kind: 'signed-in', grant: await grantSession(tx, user, options) };
  });
}

/** What opening a link would do, without using it: the page a GET of the link shows. */
export async function previewSignInLink(db: Db, token: string): Promise<{ kind: 'live'; email: string } | { kind: 'used' | 'expired' | 'unknown' }> {
  if (!isWellFormedToken(token)) return { kind: 'unknown' };
  const link = await inspectSignInLink(db, hashToken(token));
  if (link.kind !== 'redeemed') return link;
  const user = await findUser(db, link.userId);
  return user ? { kind: 'live', email: user.email } : { kind: 'unknown' };
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
 * against the sign-in throttles). Every other session of the user is signed out and every unused
 * sign-in link stops working: whoever held one of them no longer gets in.
 */
export async function changePassword(
  db: Db,
  session: { userId: string; sessionId: string },
  body: ChangePasswordBody,
  origin: AttemptOrigin,
): Promise<void> {
  const problem = passwordProblem(body.newPassword);
  if (problem) throw ValidationError.field('newPassword', problem);
  const user = await findUser(db, session.userId);
  if (!user) throw new AppError('unauthorized', 'Invalid or expired session; sign in again');
  const current = user.passwordHash;
  if (current) {
    const given = body.currentPassword;
    if (given === undefined) throw ValidationError.field('currentPassword', 'is required once a password is set');
    const right = await throttledAttempt(db, user.email, origin, async () => ((await verifyPassword(given, current)) ? true : null));
    if (!right) throw new AppError('forbidden', 'The current password is wrong');
  }
  const hash = await hashPassword(body.newPassword);
  await db.transaction(async (tx) => {
    await setPasswordHash(tx, user.id, hash);
    await revokeOtherSessions(tx, user.id, session.sessionId);
    await expireSignInLinks(tx, user.id);
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
 * Who makes an account: an operator (who vouches for it: the account is confirmed), or a workspace
 * through POST /members (only that workspace may add it until an operator confirms it: nobody checked
 * that the address belongs to whoever holds the account).
 */
export type AccountMaker = 'operator' | { workspaceId: string };

/**
 * The account for `email`, created with its personal workspace (plan free, the user its owner) when
 * new. Call inside a transaction: a new account and its workspace appear together. Without `madeBy`
 * the account is neither confirmed nor any workspace's: only an operator can add it anywhere.
 */
export async function findOrCreateAccount(
  tx: Db,
  input: { email: string; name?: string | undefined; defaultAgent: string; madeBy?: AccountMaker },
): Promise<{ user: UserRow; created: boolean }> {
  const name = input.name?.trim() || null;
  if (name !== null && name.length > 200) throw ValidationError.field('name', 'must be at most 200 characters');
  const account = await insertUserIfNew(tx, {
    email: parseEmail(input.email),
    name,
    createdByWorkspaceId: typeof input.madeBy === 'object' ? input.madeBy.workspaceId : null,
    confirmed: input.madeBy === 'operator',
  });
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

export interface JoinedWorkspace {
  user: UserRow;
  /** Whether the account is new (it then got its personal workspace). */
  created: boolean;
  /** False when the user already was a member (the membership keeps its role). */
  membershipAdded: boolean;
}

/**
 * An operator confirms an account a workspace made, in the caller's transaction: until now it was
 * whoever held it (the admin of the workspace that made it could have opened its link, kept the session
 * and set a password). Its password goes, its links end and every session is revoked, so that the link
 * the operator hands out next is the only way in. The user's row is locked first, as a password sign-in and
 * a link's redemption lock it before they open a session: one of those either committed its session before
 * and is revoked here, or waits for this transaction and then finds the password gone or the link expired.
 */
async function takeBackAccount(tx: Db, userId: string): Promise<UserRow> {
  await lockUser(tx, userId);
  const user = await confirmUser(tx, userId);
  await expireSignInLinks(tx, userId);
  await revokeOtherSessions(tx, userId, null);
  return user;
}

/**
 * Puts the account for `email` (made when new) into `workspace`, in the caller's transaction. An
 * existing account joins only a workspace that may vouch for it: it was confirmed by an operator or made
 * by this workspace. Otherwise whoever holds it (the admin of the workspace that made it, say) would get
 * into this workspace under someone else's address: 409, unless an operator confirms it here
 * (`confirm`), which takes the account back from whoever held it (takeBackAccount).
 */
export async function joinWorkspace(
  tx: Db,
  workspace: Workspace,
  input: { email: string; name?: string | undefined; role: Role; defaultAgent: string },
  by: { madeBy: AccountMaker; confirm?: boolean },
): Promise<JoinedWorkspace> {
  const account = await findOrCreateAccount(tx, { email: input.email, name: input.name, defaultAgent: input.defaultAgent, madeBy: by.madeBy });
  let user = account.user;
  if (!account.created && (await findMembership(tx, workspace.id, user.id))) return { user, created: false, membershipAdded: false };
  if (!account.created && user.confirmedAt === null && user.createdByWorkspaceId !== workspace.id) {
    if (by.madeBy !== 'operator') {
      throw new ConflictError(
        `${user.email} has an account that another workspace created; an operator must confirm it (svc admin user create --confirm) before this workspace can add it`,
      );
    }
    if (!by.confirm) {
      throw new ConflictError(
        `the account of ${user.email} was made by another workspace and no operator has confirmed it; check that it belongs to that person, then add --confirm`,
      );
    }
    user = await takeBackAccount(tx, user.id);
  }
  const membershipAdded = await addMembership(tx, { workspaceId: workspace.id, userId: user.id, role: input.role });
  return { user, created: account.created, membershipAdded };
}

/**
 * Adds a user to the caller's workspace, creating the account when the email has none. The one-time
 * sign-in link is answered only to a signed-in owner or admin, for an account this call created: a link
 * for an existing account would let any workspace admin take over anyone's account, and API keys never
 * get one (a key is a script's credential, not a person who hands a link to a person).
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
    const joined = await joinWorkspace(tx, workspace, { ...body, defaultAgent: fallback.agent }, { madeBy: { workspaceId: workspace.id } });
    if (!joined.membershipAdded) throw new ConflictError(`${joined.user.email} is already a member of this workspace`);
    const member = await findMember(tx, workspace.id, joined.user.id);
    if (!member) throw new Error('the membership just added cannot be found');
    const signInLink = joined.created && caller.keyId === null ? await issueSignInLink(tx, joined.user.id, options.publicUrl) : null;
    return { member, accountCreated: joined.created, signInLink };
  });
}

export async function workspaceMembers(db: Db, caller: Caller): Promise<MemberRow[]> {
  return listMembers(db, caller.workspaceId);
}
