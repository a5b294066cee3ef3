/**
 * Runner authentication: `Authorization: Bearer service_runner_<token>`, the connection's current
 * credential (SPEC.md "Authentication", local runner protocol). Workspace API keys, session cookies and
 * pairing grants are not runner credentials: they get 401 here like any unknown credential. A revoked
 * connection's credential is refused too, except where a route says it takes one (`GET /identity`).
 * Every runner is rate-limited on its own (SVC_RUNNER_RATE_LIMIT_*), counted in the database.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import { AppError, RateLimitedError } from '../../domain/errors.js';
import { hashRunnerCredential, isWellFormedRunnerCredential } from '../../domain/runners.js';
import type { Db } from '../../store/db.js';
import { authenticateRunnerAndCount, type RateLimits } from '../../store/rate-limit.js';
import type { RunnerRow } from '../../store/runners.js';
import { bearerToken } from '../auth.js';

export const RUNNER_UNAUTHORIZED = 'Invalid or missing runner credential';
export const RUNNER_REVOKED = 'This runner connection was revoked; pair the computer again (svc runner pair)';

declare module 'fastify' {
  interface FastifyRequest {
    runner: RunnerRow | null;
  }
  interface FastifyContextConfig {
    /** The route answers a revoked connection's credential too (GET /identity). */
    acceptsRevoked?: boolean;
  }
}

export function makeRunnerAuthenticator(db: Db, limits: RateLimits) {
  return async function authenticateRunner(request: FastifyRequest, _reply: FastifyReply): Promise<void> {
    const token = bearerToken(request.headers.authorization);
    if (!token || !isWellFormedRunnerCredential(token)) throw new AppError('unauthorized', RUNNER_UNAUTHORIZED);
    const outcome = await authenticateRunnerAndCount(db, hashRunnerCredential(token), limits);
    if (outcome.kind === 'unauthorized') throw new AppError('unauthorized', RUNNER_UNAUTHORIZED);
    const { runner } = outcome;
    if (runner.revokedAt && !request.routeOptions.config.acceptsRevoked) throw new AppError('unauthorized', RUNNER_REVOKED);
    if (outcome.kind === 'limited') throw new RateLimitedError(outcome.window, outcome.limit, outcome.retryAfterSeconds);
    request.runner = runner;
    request.log = request.log.child({ runnerId: runner.id });
  };
}

/** The runner of an authenticated runner route; the hook guarantees it. */
export function runnerOf(request: FastifyRequest): RunnerRow {
  if (!request.runner) throw new AppError('unauthorized', RUNNER_UNAUTHORIZED);
  return request.runner;
}
