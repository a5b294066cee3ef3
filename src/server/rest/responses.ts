import { ErrorEnvelope } from '../../protocol/errors.js';

type ErrorStatus = 400 | 401 | 403 | 404 | 409 | 413 | 415 | 429 | 500;

const DESCRIPTIONS: Record<ErrorStatus, string> = {
  400: '`validation_error`: the request is invalid; `details.issues` lists `{ field, message }`',
  401: '`unauthorized`: invalid or missing API key',
  403: '`forbidden`: the credential may not do this',
  404: '`not_found`: no such task in the key\'s workspace',
  409: '`conflict`: the task is not in a state that allows this',
  413: '`payload_too_large`: the request body is over its limit',
  415: '`unsupported_media_type`: the body is not application/json',
  429: '`rate_limited`: over 100 requests per minute or 1,000 per hour for this key; see `Retry-After`',
  500: '`internal_error`: server failure',
};

/** The error responses of a route, each documented with the shared envelope. */
export function errorResponses(...statuses: ErrorStatus[]) {
  const all: ErrorStatus[] = [...new Set<ErrorStatus>([...statuses, 401, 429, 500])];
  return Object.fromEntries(all.map((status) => [status, ErrorEnvelope.describe(DESCRIPTIONS[status])]));
}
