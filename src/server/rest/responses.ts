import { ErrorEnvelope } from '../../protocol/errors.js';
import { FILE_LIMITS } from '../../protocol/rest.js';

/** The body limit of every route but those that take `files` (FILE_LIMITS.bodyLimitBytes). */
export const BODY_LIMIT_BYTES = 1024 * 1024;
const mib = (bytes: number) => `${bytes / (1024 * 1024)} MiB`;

type ErrorStatus = 400 | 401 | 403 | 404 | 409 | 413 | 415 | 429 | 500;

const DESCRIPTIONS: Record<ErrorStatus, string> = {
  400:
    '`validation_error`: the body (or its JSON), query, path or headers are invalid, e.g. "Invalid request body", ' +
    '"Invalid query parameters", "Invalid path parameters"; `details.issues` lists `{ field, message }`',
  401:
    '`unauthorized`: "Invalid or missing API key" for no credential, another scheme than Bearer, or a malformed, unknown, expired or ' +
    'revoked key; "Invalid or expired session; sign in again" for a session cookie that signs no one in (expired, signed out or revoked)',
  403:
    '`forbidden`: the credential may not do this, and the message says why: a session request that changes something without the ' +
    "session's `X-CSRF-Token` or from another `Origin`, an `X-Svc-Workspace` the user is not a member of, an endpoint only a " +
    "signed-in user may use, or an action the user's role does not allow",
  404: '`not_found`: the task ("Task not found") or routing config ("Routing config not found") named in the path does not exist in the key\'s workspace',
  409: '`conflict`: the task\'s status does not allow this action, or the `default` routing config would be deleted; the message says which',
  413:
    `\`payload_too_large\` "Request body is too large": over ${mib(BODY_LIMIT_BYTES)}, or ` +
    `${mib(FILE_LIMITS.bodyLimitBytes)} on the routes that take \`files\``,
  415: '`unsupported_media_type`: a body that is not `application/json`',
  429:
    '`rate_limited` "Rate limit exceeded. Max 100 requests per minute." (or "… Max 1000 requests per hour."): over ' +
    'the limit of this key (or of this signed-in user); `Retry-After` says when to try again, `details` is `{ window, limit, retryAfterSeconds }`',
  500: '`internal_error` "Server error": server failure; the details are only in the server log',
};

/** The error responses of a route, each documented with the shared envelope; 401, 429 and 500 always. */
export function errorResponses(...statuses: ErrorStatus[]) {
  return describedErrorResponses({}, ...statuses);
}

/** As `errorResponses`, with some statuses described as this route means them. */
export function describedErrorResponses(descriptions: Partial<Record<ErrorStatus, string>>, ...statuses: ErrorStatus[]) {
  const all: ErrorStatus[] = [...new Set<ErrorStatus>([...statuses, 401, 429, 500])].sort((a, b) => a - b);
  return Object.fromEntries(all.map((status) => [status, ErrorEnvelope.describe(descriptions[status] ?? DESCRIPTIONS[status])]));
}

const BODY_METHODS = new Set(['POST', 'PUT', 'PATCH', 'DELETE']);

/**
 * The errors the HTTP edge can answer on an authenticated route whatever its handler does: 401, 429 and
 * 500; 400 (a path, query or body the checks before the handler refuse, such as malformed JSON or a NUL
 * character); 403 (a session request's CSRF, origin or workspace checks); and 413 and 415 for every
 * method Fastify reads a body for, schema or not.
 */
export function edgeErrorResponses(method: string | string[]) {
  const methods = Array.isArray(method) ? method : [method];
  const takesBody = methods.some((name) => BODY_METHODS.has(name.toUpperCase()));
  return errorResponses(400, 403, ...(takesBody ? ([413, 415] as const) : []));
}
