/** The error answers of runner routes, documented with the shared envelope. */
import { ErrorEnvelope } from '../../protocol/errors.js';

type RunnerErrorStatus = 400 | 401 | 403 | 404 | 409 | 413 | 415 | 429 | 500;

const DESCRIPTIONS: Record<RunnerErrorStatus, string> = {
  400: '`validation_error`: the body, path or query is invalid; `details.issues` lists `{ field, message }`',
  401:
    '`unauthorized`: "Invalid or missing runner credential" for no `Bearer service_runner_…` credential or an unknown one ' +
    '(workspace API keys are never runner credentials); "This runner connection was revoked; …" for a revoked connection',
  403: '`forbidden`: the runner may not do this, and the message says why',
  404: '`not_found`: the run (or review request) does not exist for this runner',
  409: '`conflict`: the run is not in a state that allows this, or the generation named is not the current one (`details.generation`)',
  413: '`payload_too_large` "Request body is too large": over the limit of the route (docs/runner-protocol.md)',
  415: '`unsupported_media_type`: a body that is not `application/json`',
  429: '`rate_limited`: over the runner connection\'s limit; `Retry-After` says when to try again',
  500: '`internal_error` "Server error": server failure; the details are only in the server log',
};

const BODY_METHODS = new Set(['POST', 'PUT', 'PATCH', 'DELETE']);

/** A runner route's errors: 400, 401, 429, 500 always, 413 and 415 with a body, and those it names. */
export function runnerErrorResponses(method: string | string[], ...statuses: RunnerErrorStatus[]) {
  const methods = Array.isArray(method) ? method : [method];
  const takesBody = methods.some((name) => BODY_METHODS.has(name.toUpperCase()));
  const all = [...new Set<RunnerErrorStatus>([400, 401, 429, 500, ...(takesBody ? ([413, 415] as const) : []), ...statuses])].sort((a, b) => a - b);
  return Object.fromEntries(all.map((status) => [status, ErrorEnvelope.describe(DESCRIPTIONS[status])]));
}

/** Statuses a runner route answers beyond the ones every route does. */
export function runnerRouteErrors(...statuses: RunnerErrorStatus[]) {
  return Object.fromEntries(statuses.map((status) => [status, ErrorEnvelope.describe(DESCRIPTIONS[status])]));
}
