/**
 * Authentication of /api/v1 and the rate limit. A request is authenticated by a workspace API key
 * (`Authorization: Bearer service_…`, checked and counted in one database round trip) or by the session
 * cookie of a signed-in user. An Authorization header always wins: with one, cookies are ignored, and
 * any scheme other than Bearer, a malformed key, or an unknown, expired or revoked one is 401.
 *
 * Session requests act in the workspace named by `X-Svc-Workspace` (one the user is a member of), by
 * default the user's personal workspace. Browsers send cookies by themselves, so a session request with
 * an unsafe method must also prove it comes from the service's own pages: `X-CSRF-Token` equal to the
 * session's token (a page of another site cannot read it) and, when the browser sends `Origin`, the
 * public URL's origin.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import { hashApiKey, isWellFormedApiKey } from '../domain/api-keys.js';
import { AppError, RateLimitedError, UnauthorizedError } from '../domain/errors.js';
import { sameSecret } from '../domain/secrets.js';
import { isUuid } from '../domain/slugs.js';
import type { Caller } from '../engine/tasks.js';
import { hashToken, isWellFormedToken } from '../engine/users.js';
import type { Db } from '../store/db.js';
import { authenticateAndCount, countRequest, type RateLimits } from '../store/rate-limit.js';
import { resolveSession, type ResolvedSession } from '../store/sessions.js';
import type { Role } from '../store/users.js';

export const SESSION_COOKIE = 'svc_session';
export const WORKSPACE_HEADER = 'x-svc-workspace';
export const CSRF_HEADER = 'x-csrf-token';
const SAFE_METHODS = new Set(['GET', 'HEAD', 'OPTIONS']);
const NIL_UUID = '00000000-0000-0000-0000-000000000000';

export const SESSION_EXPIRED = 'Invalid or expired session; sign in again';
export const USER_REQUIRED = 'This endpoint needs a signed-in user; workspace API keys cannot use it';

/** The signed-in user behind a session request, and the workspace it acts in. */
export interface RequestSession {
  sessionId: string;
  userId: string;
  csrfToken: string;
  expiresAt: Date;
  workspaceId: string;
  role: Role;
  personal: boolean;
}

declare module 'fastify' {
  interface FastifyRequest {
    caller: Caller | null;
    session: RequestSession | null;
  }
}

export interface SessionSettings {
  /** Where people reach the service: the only origin session requests may come from. */
  publicUrl: string;
  ttlMs: number;
}

export function bearerToken(header: string | undefined): string | null {
  if (!header) return null;
  const match = /^Bearer +(\S+) *$/i.exec(header);
  return match?.[1] ?? null;
}

/** The value of cookie `name` in a Cookie header (the first one, as the most specific path comes first). */
export function readCookie(header: string | undefined, name: string): string | null {
  if (!header) return null;
  for (const pair of header.split(';')) {
    const at = pair.indexOf('=');
    if (at < 0 || pair.slice(0, at).trim() !== name) continue;
    const value = pair.slice(at + 1).trim();
    return value.length >= 2 && value.startsWith('"') && value.endsWith('"') ? value.slice(1, -1) : value;
  }
  return null;
}

const isHttps = (publicUrl: string) => new URL(publicUrl).protocol === 'https:';

/**
 * The session cookie's name. Under an https public URL it takes the `__Host-` prefix: browsers then
 * keep it only when it is Secure, for Path=/ and without Domain, so that no other host (a sibling
 * subdomain, a plain-http page) can set or shadow it.
 */
export function sessionCookieName(settings: Pick<SessionSettings, 'publicUrl'>): string {
  return isHttps(settings.publicUrl) ? `__Host-${SESSION_COOKIE}` : SESSION_COOKIE;
}

/** The session token the request's cookie carries, if any. */
export function sessionTokenOf(request: FastifyRequest, settings: SessionSettings): string | null {
  return readCookie(request.headers.cookie, sessionCookieName(settings));
}

function cookieLine(value: string, maxAge: number, settings: SessionSettings): string {
  return `${sessionCookieName(settings)}=${value}; Path=/; Max-Age=${maxAge}; HttpOnly; SameSite=Lax${isHttps(settings.publicUrl) ? '; Secure' : ''}`;
}

/** Set-Cookie for a session token: script cannot read it, other sites' requests do not carry it (Lax). */
export function sessionCookie(token: string, settings: SessionSettings): string {
  return cookieLine(token, Math.floor(settings.ttlMs / 1000), settings);
}

export function clearedSessionCookie(settings: SessionSettings): string {
  return cookieLine('', 0, settings);
}

/**
 * The live session of the request's cookie, acting in `workspaceId` (null: the personal workspace).
 * When the lookup moved the expiry, the cookie is sent again with it.
 */
export async function requestSession(
  db: Db,
  settings: SessionSettings,
  request: FastifyRequest,
  reply: FastifyReply,
  workspaceId: string | null,
): Promise<ResolvedSession | null> {
  const token = sessionTokenOf(request, settings);
  if (token === null || !isWellFormedToken(token)) return null;
  const session = await resolveSession(db, { tokenHash: hashToken(token), workspaceId, ttlMs: settings.ttlMs });
  // A sliding session: the cookie's lifetime moves with the stored expiry.
  if (session?.renewed) reply.header('set-cookie', sessionCookie(token, settings));
  return session;
}

/** Refuses a browser request from a page of another origin (`Origin` is absent outside browsers). */
export function assertSameOrigin(request: FastifyRequest, publicUrl: string): void {
  const origin = request.headers.origin;
  const expected = new URL(publicUrl).origin;
  if (origin !== undefined && origin !== expected) {
    throw new AppError('forbidden', `Origin ${origin.slice(0, 200)} is not allowed; requests with the session cookie must come from ${expected}`);
  }
}

export function makeAuthenticator(db: Db, limits: RateLimits, settings: SessionSettings) {
  async function authenticateKey(request: FastifyRequest): Promise<void> {
    const token = bearerToken(request.headers.authorization);
    if (!token || !isWellFormedApiKey(token)) throw new UnauthorizedError();
    const outcome = await authenticateAndCount(db, hashApiKey(token), limits);
    switch (outcome.kind) {
      case 'unauthorized':
        throw new UnauthorizedError();
      case 'limited':
        throw new RateLimitedError(outcome.window, outcome.limit, outcome.retryAfterSeconds);
      case 'allowed':
        request.caller = { workspaceId: outcome.workspaceId, keyId: outcome.keyId, userId: null };
        request.log = request.log.child({ workspaceId: outcome.workspaceId, keyId: outcome.keyId });
        return;
    }
  }

  async function authenticateSession(request: FastifyRequest, reply: FastifyReply): Promise<void> {
    const asked = request.headers[WORKSPACE_HEADER];
    // A header that names no workspace matches none (the nil UUID is nobody's id): 403, never the default.
    const workspaceId = asked === undefined ? null : typeof asked === 'string' && isUuid(asked.trim()) ? asked.trim().toLowerCase() : NIL_UUID;
    const session = await requestSession(db, settings, request, reply, workspaceId);
    if (!session) {
      // The browser may as well forget a cookie that no longer signs anyone in.
      reply.header('set-cookie', clearedSessionCookie(settings));
      throw new AppError('unauthorized', SESSION_EXPIRED);
    }
    if (!SAFE_METHODS.has(request.method)) {
      const csrf = request.headers[CSRF_HEADER];
      if (typeof csrf !== 'string' || !sameSecret(csrf, session.csrfToken)) {
        throw new AppError('forbidden', 'Missing or wrong X-CSRF-Token: requests with the session cookie that change something must send the csrfToken of the session');
      }
      assertSameOrigin(request, settings.publicUrl);
    }
    if (!session.workspace) {
      throw new AppError(
        'forbidden',
        asked === undefined
          ? 'You have no personal workspace; name one of your workspaces in X-Svc-Workspace'
          : 'X-Svc-Workspace must be the id of a workspace you are a member of',
      );
    }
    const counted = await countRequest(db, session.userId, limits);
    if (counted.kind === 'limited') throw new RateLimitedError(counted.window, counted.limit, counted.retryAfterSeconds);
    request.session = {
      sessionId: session.sessionId,
      userId: session.userId,
      csrfToken: session.csrfToken,
      expiresAt: session.expiresAt,
      workspaceId: session.workspace.id,
      role: session.workspace.role,
      personal: session.workspace.personal,
    };
    request.caller = { workspaceId: session.workspace.id, keyId: null, userId: session.userId };
    request.log = request.log.child({ workspaceId: session.workspace.id, userId: session.userId });
  }

  return async function authenticate(request: FastifyRequest, reply: FastifyReply): Promise<void> {
    if (request.headers.authorization !== undefined) return authenticateKey(request);
    if (sessionTokenOf(request, settings) === null) throw new UnauthorizedError();
    return authenticateSession(request, reply);
  };
}

/** The caller of an authenticated route; the auth hook guarantees it. */
export function callerOf(request: FastifyRequest): Caller {
  if (!request.caller) throw new UnauthorizedError();
  return request.caller;
}

/**
 * The signed-in user of a route only a person may use (a workspace API key is refused with 403): local
 * work, pairing a runner, the session itself.
 */
export function requireUser(request: FastifyRequest): RequestSession {
  if (request.session) return request.session;
  if (request.caller) throw new AppError('forbidden', USER_REQUIRED);
  throw new UnauthorizedError();
}
