/**
 * The HTTP edge: Fastify with zod validation, the error envelope, request ids, health checks, the
 * OpenAPI document and the /api/v1 routes behind bearer authentication and the rate limit.
 */
import { randomUUID } from 'node:crypto';
import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance } from 'fastify';
import fastifySwagger from '@fastify/swagger';
import {
  jsonSchemaTransform,
  jsonSchemaTransformObject,
  serializerCompiler,
  validatorCompiler,
  type ZodTypeProvider,
} from 'fastify-type-provider-zod';
import { z } from 'zod';
import type { Database } from '../store/db.js';
import type { RateLimits } from '../store/rate-limit.js';
import { makeAuthenticator } from './auth.js';
import { installErrorHandling } from './errors.js';
import { EventHub } from './event-hub.js';
import { logRoutes } from './rest/logs.js';
import { routingRoutes } from './rest/routing.js';
import { taskRoutes } from './rest/tasks.js';
import { AppError } from '../domain/errors.js';

export const API_PREFIX = '/api/v1';
export const API_VERSION = '1.0.0';

export interface ServerOptions {
  database: Database;
  publicUrl: string;
  rateLimits: RateLimits;
  /** A pino logger; without one the server logs nothing (tests). */
  logger?: FastifyBaseLogger;
}

const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/;

/** Moves a response schema marked `x-media-type` from application/json to that media type. */
function documentMediaTypes<T>(document: T): T {
  type Media = Record<string, { schema?: Record<string, unknown> }>;
  const paths = (document as { paths?: Record<string, Record<string, { responses?: Record<string, { content?: Media }> }>> }).paths;
  for (const operations of Object.values(paths ?? {})) {
    for (const operation of Object.values(operations)) {
      for (const response of Object.values(operation.responses ?? {})) {
        const schema = response.content?.['application/json']?.schema;
        const mediaType = schema?.['x-media-type'];
        if (typeof mediaType !== 'string' || !schema) continue;
        const { 'x-media-type': _marker, ...rest } = schema;
        response.content = { [mediaType]: { schema: rest } };
      }
    }
  }
  return document;
}

/** Adds the `Retry-After` header to every documented 429 answer. */
function documentRetryAfter<T>(document: T): T {
  const paths = (document as { paths?: Record<string, Record<string, { responses?: Record<string, Record<string, unknown>> }>> }).paths;
  for (const operations of Object.values(paths ?? {})) {
    for (const operation of Object.values(operations)) {
      const limited = operation.responses?.['429'];
      if (limited) {
        limited.headers = {
          'Retry-After': { description: 'Seconds to wait before the next request is accepted', schema: { type: 'integer', minimum: 1 } },
        };
      }
    }
  }
  return document;
}

export async function buildServer(options: ServerOptions): Promise<FastifyInstance> {
  const app = Fastify({
    ...(options.logger ? { loggerInstance: options.logger } : { logger: false }),
    // genReqId reads X-Request-Id itself so that only a well-formed one is trusted.
    requestIdHeader: false,
    logController: new LogController({
      requestIdLogLabel: 'requestId',
      disableRequestLogging: (request) => request.url === '/healthz' || request.url === '/readyz',
    }),
    genReqId: (request) => {
      const given = request.headers['x-request-id'];
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID();
    },
    // Routes that take files raise their own limit; everything else stays small.
    bodyLimit: 1024 * 1024,
    return503OnClosing: true,
  }).withTypeProvider<ZodTypeProvider>();

  const hub = new EventHub(options.database);
  app.addHook('onClose', async () => hub.close());

  app.setValidatorCompiler(validatorCompiler);
  app.setSerializerCompiler(serializerCompiler);
  installErrorHandling(app);

  // The API speaks JSON only: any other content type is 415.
  app.removeAllContentTypeParsers();
  // An empty body with a JSON content type means "no body" (curl -X POST -H 'content-type: …').
  const parseJson = app.getDefaultJsonParser('error', 'error');
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (request, body, done) => {
    if (typeof body === 'string' && body.trim() === '') return done(null, undefined);
    parseJson(request, body.toString(), done);
  });

  app.addHook('onRequest', async (request, reply) => {
    reply.header('x-request-id', request.id);
  });
  app.decorateRequest('caller', null);

  await app.register(fastifySwagger, {
    openapi: {
      openapi: '3.0.3',
      info: {
        title: 'svc REST API',
        version: API_VERSION,
        description:
          'Task delegation service for coding agents. Every /api/v1 path needs `Authorization: Bearer service_…`. ' +
          'Errors use the envelope `{ error: { code, message, details? } }`. Limits: 100 requests per minute and ' +
          '1,000 per hour per key.',
      },
      servers: [{ url: options.publicUrl }],
      components: {
        securitySchemes: {
          bearerAuth: { type: 'http', scheme: 'bearer', description: 'A workspace API key (`service_…`)' },
        },
      },
      tags: [
        { name: 'tasks', description: 'Tasks, their jobs and follow-ups' },
        { name: 'routing', description: 'Routing configs selected by a leading `/trigger`' },
      ],
    },
    transform: jsonSchemaTransform,
    transformObject: (input) => documentMediaTypes(documentRetryAfter(jsonSchemaTransformObject(input))),
  });

  app.get('/healthz', { schema: { hide: true } }, async () => ({ status: 'ok' }));
  app.get('/readyz', { schema: { hide: true } }, async (request) => {
    try {
      await options.database.ping();
      return { status: 'ok' };
    } catch (error) {
      request.log.warn({ err: error }, 'database not ready');
      throw new AppError('service_unavailable', 'Database unavailable');
    }
  });

  await app.register(
    async (api) => {
      api.get(
        '/openapi.json',
        { schema: { hide: true, response: { 200: z.any() } } },
        async () => app.swagger(),
      );
      await api.register(async (secured) => {
        const authenticate = makeAuthenticator(options.database.db, options.rateLimits);
        secured.addHook('onRequest', authenticate);
        secured.addHook('onRoute', (route) => {
          route.schema = { ...route.schema, security: [{ bearerAuth: [] }] };
        });
        const deps = { db: options.database.db, publicUrl: options.publicUrl };
        await secured.register(taskRoutes, deps);
        await secured.register(routingRoutes, deps);
        await secured.register(logRoutes, { db: options.database.db, hub });
      });
    },
    { prefix: API_PREFIX },
  );

  return app;
}
