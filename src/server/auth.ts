/**
 * Bearer authentication of workspace API keys and the per-key rate limit, in one database round trip.
 * Any scheme other than Bearer, a malformed key, or an unknown, expired or revoked one is 401.
 */
import type { FastifyRequest } from 'fastify';
import { hashApiKey, isWellFormedApiKey } from '../domain/api-keys.js';
import { RateLimitedError, UnauthorizedError } from '../domain/errors.js';
import type { Caller } from '../engine/tasks.js';
import type { Db } from '../store/db.js';
import { authenticateAndCount, type RateLimits } from '../store/rate-limit.js';

declare module 'fastify' {
  interface FastifyRequest {
    caller: Caller | null;
  }
}

export function bearerToken(header: string | undefined): string | null {
  if (!header) return null;
  const match = /^Bearer +(\S+) *$/i.exec(header);
  return match?.[1] ?? null;
}

export function makeAuthenticator(db: Db, limits: RateLimits) {
  return async function authenticate(request: FastifyRequest): Promise<void> {
    const token = bearerToken(request.headers.authorization);
    if (!token || !isWellFormedApiKey(token)) throw new UnauthorizedError();
    const outcome = await authenticateAndCount(db, hashApiKey(token), limits);
    switch (outcome.kind) {
      case 'unauthorized':
        throw new UnauthorizedError();
      case 'limited':
        throw new RateLimitedError(outcome.window, outcome.limit, outcome.retryAfterSeconds);
      case 'allowed':
        request.caller = { workspaceId: outcome.workspaceId, keyId: outcome.keyId };
        request.log = request.log.child({ workspaceId: outcome.workspaceId, keyId: outcome.keyId });
        return;
    }
  };
}

/** The caller of an authenticated route; the auth hook guarantees it. */
export function callerOf(request: FastifyRequest): Caller {
  if (!request.caller) throw new UnauthorizedError();
  return request.caller;
}
