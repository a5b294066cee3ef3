/**
 * One envelope for every error the HTTP edge answers: typed AppErrors, request validation, Fastify's own
 * errors (malformed JSON, body too large, content type, unknown route, wrong method) and anything else,
 * which becomes a 500 `internal_error` "Server error" with the stack only in the log.
 */
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import FindMyWay, { type HTTPVersion } from 'find-my-way';
import { hasZodFastifySchemaValidationErrors } from 'fastify-type-provider-zod';
import { AppError, ValidationError } from '../domain/errors.js';
import type { ErrorEnvelope, ValidationIssue } from '../protocol/errors.js';

const CONTEXT_MESSAGE: Record<string, string> = {
  body: 'Invalid request body',
  querystring: 'Invalid query parameters',
  params: 'Invalid path parameters',
  headers: 'Invalid request headers',
};

function fieldOf(instancePath: string, context: string): string {
  const path = instancePath.replace(/^\//, '').split('/').filter(Boolean).join('.');
  if (path) return path;
  return context === 'querystring' ? 'query' : context;
}

/** Maps any thrown value to an AppError. */
export function toAppError(error: unknown): AppError {
  if (error instanceof AppError) return error;
  const fastifyError = error as FastifyError & { validationContext?: string };
  if (hasZodFastifySchemaValidationErrors(fastifyError)) {
    const context = fastifyError.validationContext ?? 'body';
    const issues: ValidationIssue[] = fastifyError.validation.map((issue) => ({
      field: fieldOf(issue.instancePath, context),
      message: issue.message ?? 'is invalid',
    }));
    return new ValidationError(issues, CONTEXT_MESSAGE[context] ?? CONTEXT_MESSAGE.body);
  }
  switch (fastifyError.code) {
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return ValidationError.field('body', `is not valid JSON: ${fastifyError.message}`);
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return ValidationError.field('body', 'is empty but the content type says JSON');
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new AppError('payload_too_large', 'Request body is too large');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
    case 'FST_ERR_CTP_INVALID_CONTENT_LENGTH':
      return fastifyError.statusCode === 415
        ? new AppError('unsupported_media_type', `Unsupported content type; send application/json`)
        : new AppError('validation_error', 'Invalid request body', { details: { issues: [{ field: 'body', message: fastifyError.message }] } });
    default:
      break;
  }
  if (error instanceof SyntaxError && fastifyError.statusCode === 400) {
    return ValidationError.field('body', `is not valid JSON: ${error.message}`);
  }
  const status = fastifyError.statusCode ?? 500;
  if (status === 413) return new AppError('payload_too_large');
  if (status === 415) return new AppError('unsupported_media_type', 'Unsupported content type; send application/json');
  if (status >= 400 && status < 500) {
    return new ValidationError([{ field: 'request', message: fastifyError.message }], 'Invalid request');
  }
  return new AppError('internal_error', undefined, { cause: error });
}

export function sendError(reply: FastifyReply, error: AppError): FastifyReply {
  const envelope: ErrorEnvelope = { error: { code: error.code, message: error.message } };
  if (error.details !== undefined) envelope.error.details = error.details;
  return reply.status(error.status).headers(error.headers).type('application/json; charset=utf-8').send(envelope);
}

/**
 * Installs the error and not-found handlers. A shadow router mirrors every route so that a path that
 * exists under another method answers 405 with `Allow` instead of 404.
 */
export function installErrorHandling(app: FastifyInstance): void {
  const shadow = FindMyWay<HTTPVersion.V1>({ ignoreTrailingSlash: false });
  app.addHook('onRoute', (route) => {
    const methods = Array.isArray(route.method) ? route.method : [route.method];
    for (const method of methods) {
      try {
        shadow.on(method as 'GET', route.url, () => undefined);
      } catch {
        // the same route registered twice (HEAD for GET): once is enough
      }
    }
  });

  app.setErrorHandler((error: unknown, request: FastifyRequest, reply: FastifyReply) => {
    const appError = toAppError(error);
    if (appError.status >= 500) request.log.error({ err: error }, 'request failed');
    else request.log.info({ code: appError.code }, appError.message);
    return sendError(reply, appError);
  });

  app.setNotFoundHandler((request: FastifyRequest, reply: FastifyReply) => {
    const path = request.url.split('?', 1)[0] ?? '/';
    const allowed = ['GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS'].filter(
      (method) => method !== request.method && shadow.find(method as 'GET', path) !== null,
    );
    if (allowed.length > 0) {
      return sendError(
        reply,
        new AppError('method_not_allowed', `Method ${request.method} is not allowed on ${path}`, {
          headers: { allow: allowed.join(', ') },
          details: { allow: allowed },
        }),
      );
    }
    return sendError(reply, new AppError('not_found', `Route ${request.method} ${path} not found`));
  });
}
