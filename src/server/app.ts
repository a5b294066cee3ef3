/**
 * The HTTP edge: Fastify with zod validation, the error envelope, request ids, health checks, the
 * OpenAPI document, the browser's sign-in link and the /api/v1 routes behind authentication (an API key
 * or a session cookie) and the rate limit.
 */
import { randomUUID } from 'node:crypto';
import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance, type FastifyRequest } from 'fastify';
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
import { dummyHash } from '../domain/passwords.js';
import { SESSION_TTL_MS } from '../engine/users.js';
import { makeAuthenticator, SESSION_COOKIE, sessionCookieName, type SessionSettings } from './auth.js';
import { browserSignInRoute, sessionRoutes, SIGN_IN_OPERATIONS, signInRoutes } from './rest/auth.js';
import { memberRoutes } from './rest/members.js';
import { installErrorHandling, sendError, toAppError } from './errors.js';
import { EventHub } from './event-hub.js';
import { logRoutes } from './rest/logs.js';
import { routingRoutes } from './rest/routing.js';
import { BODY_LIMIT_BYTES, edgeErrorResponses } from './rest/responses.js';
import { taskRoutes } from './rest/tasks.js';
import { pullRequestRoutes } from './rest/pull-requests.js';
import { runnerRoutes } from './runners/index.js';
import { localWorkRoutes } from './rest/local.js';
import { pairRunnerPage } from './runners/pair-page.js';
import { runnerUserRoutes } from './rest/runners.js';
import { AppError, ValidationError } from '../domain/errors.js';
import { Environments } from '../engine/environments.js';
import type { SandboxPolicy } from '../sandbox/fork.js';
import { workspaceShellRoutes } from './rest/workspace-shell.js';
import pino from 'pino';

export const API_PREFIX = '/api/v1';
/** A runner long-polls and uploads far more often than a script calls the API. */
export const DEFAULT_RUNNER_RATE_LIMITS: RateLimits = { perMinute: 1_200, perHour: 36_000 };
export const API_VERSION = '1.0.0';

export interface ServerOptions {
  database: Database;
  publicUrl: string;
  /** Holds the code host's repositories and the workspace environments. */
  dataDir: string;
  rateLimits: RateLimits;
  /** The workspace environments (merges bring them up to date); made from `dataDir` when absent (tests). */
  environments?: Environments;
  /** Roots under which `POST /api/v1/repos` accepts paths on the server (SVC_REPO_PATHS); none by default. */
  repoPaths?: readonly string[];
  /** Per runner connection (SVC_RUNNER_RATE_LIMIT_PER_MINUTE, …_PER_HOUR). */
  runnerRateLimits?: RateLimits;
  /** A pino logger; without one the server logs nothing (tests). */
  logger?: FastifyBaseLogger;
  /** What sandboxed processes may see and use (workspace shells); the data dir hidden, nothing unsandboxed, when absent. */
  sandboxPolicy?: SandboxPolicy;
  /** Proxies whose X-Forwarded-* headers name the client (SVC_TRUST_PROXY); none when absent. */
  trustProxy?: boolean | number | string[];
}

const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/;

/**
 * A request URL as the logs may show it: the token of a sign-in link (`/auth/sign-in/{token}`) and the
 * values of query parameters that carry secrets (tokens, pairing codes, verifiers, keys) are replaced.
 * Whoever reads the logs must not be able to sign in or pair a computer with them.
 */
export function redactUrl(url: string): string {
  const at = url.indexOf('?');
  const path = (at < 0 ? url : url.slice(0, at)).replace(/^(\/auth\/sign-in\/)[^/]+/, '$1[redacted]');
  const query = at < 0 ? '' : url.slice(at).replace(/([?&][^=&]*(?:token|code|verifier|secret|key)[^=&]*=)[^&#]*/gi, '$1[redacted]');
  return path + query;
}

/** Fastify's request serializer, with the URL redacted. */
function requestForLog(request: FastifyRequest): Record<string, unknown> {
  return {
    method: request.method,
    url: redactUrl(request.url),
    host: request.host,
    remoteAddress: request.ip,
    remotePort: request.socket?.remotePort,
  };
}
/** The longest path parameter the router takes, as TaskParams says; longer is a 400 before any route runs. */
const MAX_PARAM_LENGTH = 200;

type Json = Record<string, unknown>;
type Operation = { operationId?: string; requestBody?: Json & { content?: Record<string, { schema?: Json }> }; responses?: Record<string, Json & { content?: Record<string, { schema?: Json }> }> };

const isObject = (value: unknown): value is Json => typeof value === 'object' && value !== null && !Array.isArray(value);

function operationsOf(document: Json): Operation[] {
  const paths = isObject(document.paths) ? document.paths : {};
  return Object.values(paths).flatMap((item) => (isObject(item) ? Object.values(item).filter(isObject) : [])) as Operation[];
}

/** Calls `visit` on every object in `value`, parents before children. */
function walk(value: unknown, visit: (node: Json) => void): void {
  if (Array.isArray(value)) {
    for (const item of value) walk(item, visit);
  } else if (isObject(value)) {
    visit(value);
    for (const child of Object.values(value)) walk(child, visit);
  }
}

const SCHEMAS_REF = '#/components/schemas/';
const refName = (ref: unknown): string | null => (typeof ref === 'string' && ref.startsWith(SCHEMAS_REF) ? ref.slice(SCHEMAS_REF.length) : null);

function renameRefs(value: unknown, names: Map<string, string>): void {
  walk(value, (node) => {
    const name = refName(node.$ref);
    const renamed = name === null ? undefined : names.get(name);
    if (renamed !== undefined) node.$ref = SCHEMAS_REF + renamed;
  });
}

/**
 * Response media types and headers: a response schema marked `x-media-type` moves from application/json
 * to that media type; a 204 has no body; every answer carries `X-Request-Id` and every 429 `Retry-After`.
 */
function documentResponses(document: Json): void {
  const components = (document.components ??= {}) as Json;
  components.headers = {
    ...(components.headers as Json | undefined),
    RequestId: {
      description:
        'The request id: the `X-Request-Id` the request sent if well-formed (1–128 letters, digits, `.`, `_`, `:` or `-`), ' +
        'otherwise a fresh UUID. The server logs it with every line about the request.',
      schema: { type: 'string' },
    },
    RetryAfter: {
      description: 'Seconds to wait before the key (or user, or email) is below its limit again',
      schema: { type: 'integer', minimum: 1 },
    },
    SetSessionCookie: {
      description:
        `The session cookie: \`${SESSION_COOKIE}=<token>; Path=/; Max-Age=<lifetime in seconds>; HttpOnly; SameSite=Lax\`; when the ` +
        `public URL is https it is named \`__Host-${SESSION_COOKIE}\` and \`Secure\`; on sign-out the same cookie with \`Max-Age=0\``,
      schema: { type: 'string' },
    },
  };
  const setsCookie = new Set<string>([...SIGN_IN_OPERATIONS, 'signOut']);
  const schemas = isObject(components.schemas) ? components.schemas : {};
  for (const operation of operationsOf(document)) {
    for (const [status, response] of Object.entries(operation.responses ?? {})) {
      const schema = response.content?.['application/json']?.schema;
      // @fastify/swagger does not see the description of a zod component: take it from there.
      const component = schemas[refName(schema?.$ref) ?? ''];
      if (response.description === 'Default Response' && isObject(component) && typeof component.description === 'string') {
        response.description = component.description;
      }
      const mediaType = schema?.['x-media-type'];
      if (typeof mediaType === 'string' && schema) {
        const { 'x-media-type': _marker, ...rest } = schema;
        response.content = { [mediaType]: { schema: rest } };
      }
      if (status === '204') delete response.content;
      response.headers = {
        ...(response.headers as Json | undefined),
        'X-Request-Id': { $ref: '#/components/headers/RequestId' },
        ...(status === '429' ? { 'Retry-After': { $ref: '#/components/headers/RetryAfter' } } : {}),
        ...(status.startsWith('2') && setsCookie.has(operation.operationId ?? '') ? { 'Set-Cookie': { $ref: '#/components/headers/SetSessionCookie' } } : {}),
      };
    }
  }
}

/** A route whose body schema is nullable (`.nullish()`) takes an optional body: say so instead. */
function documentOptionalBodies(document: Json): void {
  for (const operation of operationsOf(document)) {
    const body = operation.requestBody;
    for (const media of Object.values(body?.content ?? {})) {
      const schema = media.schema;
      if (!body || !schema || schema.nullable !== true) continue;
      body.required = false;
      const { nullable: _nullable, ...rest } = schema;
      const only = Array.isArray(rest.allOf) && rest.allOf.length === 1 && Object.keys(rest).length === 1 ? rest.allOf[0] : null;
      media.schema = isObject(only) ? only : rest;
    }
  }
}

/** zod's `z.null()` in OpenAPI 3.0 (which has no null type): the null branch of a nullable reference. */
const nullSchema = (): Json => ({ type: 'string', nullable: true, enum: [null] });
const ANNOTATIONS = new Set(['description', 'title', 'default', 'example', 'deprecated', 'readOnly', 'writeOnly']);

/**
 * Makes the schemas mean in OpenAPI 3.0.3 what zod means. `nullable` only acts next to a `type` (3.0.3),
 * so a nullable reference (`{ nullable, allOf: [$ref] }`) becomes `anyOf: [$ref, null]`, and a nullable
 * enum lists null among its values. The ±2^53 bounds zod gives every `.int()` say nothing and go.
 */
function documentSchemas(document: Json): void {
  walk(document, (node) => {
    if (node.nullable === true) {
      if ('type' in node) {
        if (Array.isArray(node.enum) && !node.enum.includes(null)) node.enum = [...node.enum, null];
      } else if ('$ref' in node || 'allOf' in node || 'anyOf' in node || 'oneOf' in node) {
        const annotations = Object.entries(node).filter(([key]) => ANNOTATIONS.has(key));
        const { nullable: _nullable, ...rest } = Object.fromEntries(Object.entries(node).filter(([key]) => !ANNOTATIONS.has(key)));
        const keys = Object.keys(rest);
        const branches =
          keys.length === 1 && Array.isArray(rest.allOf) && rest.allOf.length === 1
            ? rest.allOf
            : keys.length === 1 && Array.isArray(rest.anyOf)
              ? rest.anyOf
              : [rest];
        for (const key of Object.keys(node)) delete node[key];
        Object.assign(node, Object.fromEntries(annotations), { anyOf: [...branches, nullSchema()] });
      }
    }
    if (node.type === 'integer') {
      if (node.minimum === Number.MIN_SAFE_INTEGER) delete node.minimum;
      if (node.maximum === Number.MAX_SAFE_INTEGER) delete node.maximum;
    }
  });
}

/**
 * One component per schema. fastify-type-provider-zod emits every registered schema twice, `X` for
 * answers and `XInput` for requests, whether used or not. An `XInput` equal to `X` is folded into it,
 * components nothing refers to are dropped (the registry is zod's global one, so anything with an `id`
 * would otherwise leak in), and an `XInput` left alone takes the name `X`.
 */
function documentComponents(document: Json): void {
  const components = isObject(document.components) ? document.components : {};
  const schemas = isObject(components.schemas) ? components.schemas : {};
  const folded = new Map<string, string>();
  const same = (a: unknown, b: unknown) => {
    const [left, right] = [structuredClone(a), structuredClone(b)];
    renameRefs(left, folded);
    renameRefs(right, folded);
    return JSON.stringify(left) === JSON.stringify(right);
  };
  for (let changed = true; changed; ) {
    changed = false;
    for (const name of Object.keys(schemas)) {
      const base = name.endsWith('Input') ? name.slice(0, -'Input'.length) : null;
      if (base && !folded.has(name) && base in schemas && same(schemas[name], schemas[base])) {
        folded.set(name, base);
        changed = true;
      }
    }
  }
  for (const name of folded.keys()) delete schemas[name];
  renameRefs(document, folded);

  const used = new Set<string>();
  const use = (value: unknown) =>
    walk(value, (node) => {
      const name = refName(node.$ref);
      if (name !== null && !used.has(name)) {
        used.add(name);
        use(schemas[name]);
      }
    });
  use({ ...document, components: { ...components, schemas: {} } });
  for (const name of Object.keys(schemas)) if (!used.has(name)) delete schemas[name];

  const renamed = new Map<string, string>();
  for (const name of Object.keys(schemas)) {
    const base = name.endsWith('Input') ? name.slice(0, -'Input'.length) : null;
    if (base && !(base in schemas)) renamed.set(name, base);
  }
  for (const [name, base] of renamed) {
    schemas[base] = schemas[name];
    delete schemas[name];
  }
  renameRefs(document, renamed);
  components.schemas = Object.fromEntries(Object.entries(schemas).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
}

/** The finishing passes over the document fastify-type-provider-zod and @fastify/swagger produce. */
function finishDocument<T>(document: T): T {
  const json = document as Json;
  documentResponses(json);
  documentOptionalBodies(json);
  documentSchemas(json);
  documentComponents(json);
  return document;
}

function trustHops(hops: number): (address: string, hop: number) => boolean {
  return (_address, hop) => hop < hops;
}

export async function buildServer(options: ServerOptions): Promise<FastifyInstance> {
  const app = Fastify({
    ...(options.logger ? { loggerInstance: options.logger.child({}, { serializers: { req: requestForLog } }) } : { logger: false }),
    // genReqId reads X-Request-Id itself so that only a well-formed one is trusted.
    requestIdHeader: false,
    // A hop count becomes the function proxy-addr would make of it (Fastify's types take no number).
    trustProxy: typeof options.trustProxy === 'number' ? trustHops(options.trustProxy) : (options.trustProxy ?? false),
    logController: new LogController({
      requestIdLogLabel: 'requestId',
      disableRequestLogging: (request) => request.url === '/healthz' || request.url === '/readyz',
    }),
    genReqId: (request) => {
      const given = request.headers['x-request-id'];
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID();
    },
    // Routes that take files raise their own limit; everything else stays small.
    bodyLimit: BODY_LIMIT_BYTES,
    return503OnClosing: true,
    routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
    // Errors the router raises before any route or hook runs: answered in the envelope like the rest.
    frameworkErrors: (error, request, reply) => {
      reply.header('x-request-id', request.id);
      const code = (error as { code?: string }).code;
      if (code === 'FST_ERR_MAX_PARAM_LENGTH' || code === 'FST_ERR_BAD_URL') {
        const problem = code === 'FST_ERR_BAD_URL' ? 'is not a valid URL component' : `is longer than ${MAX_PARAM_LENGTH} characters`;
        return sendError(reply, new ValidationError([{ field: 'path', message: problem }], 'Invalid path parameters'));
      }
      return sendError(reply, toAppError(error));
    },
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
  app.decorateRequest('session', null);
  const sessions: SessionSettings = { publicUrl: options.publicUrl, ttlMs: SESSION_TTL_MS };
  // The hash unknown emails are checked against, made now so that the first such sign-in is not slower.
  dummyHash().catch((error: unknown) => app.log.error({ err: error }, 'hashing the dummy password failed'));

  await app.register(fastifySwagger, {
    openapi: {
      openapi: '3.0.3',
      info: {
        title: 'svc REST API',
        version: API_VERSION,
        description:
          'Task delegation service for coding agents. Every /api/v1 path but sign-in needs a workspace API key ' +
          '(`Authorization: Bearer service_…`) or the session cookie of a signed-in user. ' +
          'Errors use the envelope `{ error: { code, message, details? } }`. Limits: 100 requests per minute and ' +
          '1,000 per hour per key or user.',
      },
      servers: [{ url: options.publicUrl }],
      components: {
        securitySchemes: {
          bearerAuth: { type: 'http', scheme: 'bearer', description: 'A workspace API key (`service_…`); with it, cookies are ignored' },
          sessionCookie: {
            type: 'apiKey',
            in: 'cookie',
            name: sessionCookieName(sessions),
            description:
              'The session of a signed-in user (`POST /api/v1/auth/sign-in` or a one-time sign-in link). It acts in the workspace ' +
              'whose id is in `X-Svc-Workspace` (one the user is a member of, else 403), by default the personal workspace. ' +
              'POST, PUT, PATCH and DELETE also need `X-CSRF-Token` (the `csrfToken` of the session) and, when sent, an `Origin` ' +
              'equal to the public URL\'s (else 403).',
          },
          runnerCredential: {
            type: 'http',
            scheme: 'bearer',
            description:
              'A desktop runner connection\'s own credential (`service_runner_…`), made by the runner and registered at enrollment ' +
              '(docs/runner-protocol.md). Workspace API keys and sessions are not runner credentials.',
          },
          workspaceShellToken: {
            type: 'http',
            scheme: 'bearer',
            description:
              'A temporary workspace shell token (`service_ssh_…`, valid 60 minutes) that a local run obtained with ' +
              '`POST /api/v1/runners/runs/{runId}/workspace-ssh`; it works on `POST /api/v1/workspace-shell` only.',
          },
        },
      },
      tags: [
        { name: 'tasks', description: 'Tasks, their jobs and follow-ups' },
        { name: 'routing', description: 'Routing configs selected by a leading `/trigger`' },
        { name: 'auth', description: 'Signing in and out, the session and the password of a signed-in user' },
        { name: 'members', description: 'The people of a workspace' },
        { name: 'local work', description: "The owner's side of tasks run by a desktop runner: what they ask, the answers, files" },
        { name: 'runners', description: 'The local runner protocol: what a desktop runner calls (docs/runner-protocol.md)' },
        { name: 'workspace shell', description: 'Commands in a cloud workspace with a temporary shell token (docs/runner-protocol.md)' },
      ],
    },
    transform: jsonSchemaTransform,
    transformObject: (input) => finishDocument(jsonSchemaTransformObject(input)),
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

  const authDeps = { db: options.database.db, settings: sessions };
  const environments =
    options.environments ??
    new Environments({ db: options.database.db, dataDir: options.dataDir, policy: { hiddenPaths: [options.dataDir], allowUnsandboxed: false }, logger: pino({ enabled: false }) });
  await app.register(browserSignInRoute, authDeps);
  await app.register(pairRunnerPage, { ...authDeps, rateLimits: options.rateLimits });

  await app.register(
    async (api) => {
      api.get(
        '/openapi.json',
        { schema: { hide: true, response: { 200: z.any() } } },
        async () => app.swagger(),
      );
      await api.register(signInRoutes, authDeps);
      await api.register(runnerRoutes, {
        prefix: '/runners',
        database: options.database,
        publicUrl: options.publicUrl,
        rateLimits: options.runnerRateLimits ?? DEFAULT_RUNNER_RATE_LIMITS,
        environments,
      });
      // Outside `secured`: its only credential is the shell token.
      await api.register(workspaceShellRoutes, {
        db: options.database.db,
        environments,
        dataDir: options.dataDir,
        policy: options.sandboxPolicy ?? { hiddenPaths: [options.dataDir], allowUnsandboxed: false },
        rateLimits: options.rateLimits,
      });
      await api.register(async (secured) => {
        const authenticate = makeAuthenticator(options.database.db, options.rateLimits, sessions);
        secured.addHook('onRequest', authenticate);
        // Every authenticated route documents its schemes (both, unless it names its own) and the errors
        // the edge itself can answer.
        secured.addHook('onRoute', (route) => {
          route.schema = {
            ...route.schema,
            security: route.schema?.security ?? [{ bearerAuth: [] }, { sessionCookie: [] }],
            response: { ...edgeErrorResponses(route.method), ...(route.schema?.response as object | undefined) },
          };
        });
        const deps = { db: options.database.db, publicUrl: options.publicUrl };
        await secured.register(taskRoutes, deps);
        await secured.register(routingRoutes, deps);
        await secured.register(logRoutes, { db: options.database.db, hub });
        await secured.register(pullRequestRoutes, { db: options.database.db, environments, logger: app.log, repoPaths: options.repoPaths ?? [] });
        await secured.register(sessionRoutes, authDeps);
        await secured.register(memberRoutes, deps);
        await secured.register(runnerUserRoutes, deps);
        await secured.register(localWorkRoutes, { db: options.database.db });
      });
    },
    { prefix: API_PREFIX },
  );

  return app;
}
