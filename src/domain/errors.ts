import type { ErrorCode, ValidationIssue } from '../protocol/errors.js';

const STATUS: Record<ErrorCode, number> = {
  validation_error: 400,
  unauthorized: 401,
  forbidden: 403,
  not_found: 404,
  method_not_allowed: 405,
  conflict: 409,
  payload_too_large: 413,
  unsupported_media_type: 415,
  rate_limited: 429,
  internal_error: 500,
  service_unavailable: 503,
};

/** The published message of each code (SPEC.md "Errors"); a subclass may say something more precise. */
export const DEFAULT_MESSAGE: Record<ErrorCode, string> = {
  validation_error: 'Invalid request body',
  unauthorized: 'Invalid or missing API key',
  forbidden: 'Forbidden',
  not_found: 'Not found',
  method_not_allowed: 'Method not allowed',
  conflict: 'Conflict',
  payload_too_large: 'Request body is too large',
  unsupported_media_type: 'Unsupported content type',
  rate_limited: 'Rate limit exceeded. Max 100 requests per minute.',
  internal_error: 'Server error',
  service_unavailable: 'Service unavailable',
};

/** An error with a stable code; the HTTP edge turns it into the error envelope. */
export class AppError extends Error {
  readonly code: ErrorCode;
  readonly status: number;
  readonly details: unknown;
  readonly headers: Record<string, string>;

  constructor(
    code: ErrorCode,
    message?: string,
    options: { details?: unknown; cause?: unknown; headers?: Record<string, string> } = {},
  ) {
    super(message ?? DEFAULT_MESSAGE[code], { cause: options.cause });
    this.name = 'AppError';
    this.code = code;
    this.status = STATUS[code];
    this.details = options.details;
    this.headers = options.headers ?? {};
  }
}

export class ValidationError extends AppError {
  constructor(issues: ValidationIssue[], message: string = DEFAULT_MESSAGE.validation_error) {
    super('validation_error', message, { details: { issues } });
    this.name = 'ValidationError';
  }

  static field(field: string, message: string): ValidationError {
    return new ValidationError([{ field, message }]);
  }
}

export class NotFoundError extends AppError {
  constructor(message: string) {
    super('not_found', message);
    this.name = 'NotFoundError';
  }
}

export const taskNotFound = (): NotFoundError => new NotFoundError('Task not found');

export class ConflictError extends AppError {
  constructor(message: string, details?: unknown) {
    super('conflict', message, { details });
    this.name = 'ConflictError';
  }
}

export class UnauthorizedError extends AppError {
  constructor() {
    super('unauthorized');
    this.name = 'UnauthorizedError';
  }
}

export class RateLimitedError extends AppError {
  constructor(window: 'minute' | 'hour', limit: number, retryAfterSeconds: number) {
    super('rate_limited', `Rate limit exceeded. Max ${limit} requests per ${window}.`, {
      details: { window, limit, retryAfterSeconds },
      headers: { 'retry-after': String(retryAfterSeconds) },
    });
    this.name = 'RateLimitedError';
  }
}

export function statusOf(code: ErrorCode): number {
  return STATUS[code];
}

export function assertNever(value: never): never {
  throw new Error(`unexpected value: ${JSON.stringify(value)}`);
}
