/**
 * The OpenAPI document: valid 3.0.3, every route the server registers documented with its inputs,
 * security and answers, every answer the server gives on the probes below one the document describes,
 * and the committed document and generated types equal to what the server publishes.
 */
import { randomBytes } from 'node:crypto';
import { subscribe, unsubscribe } from 'node:diagnostics_channel';
import { readFileSync } from 'node:fs';
import SwaggerParser from '@apidevtools/swagger-parser';
import type { FastifyInstance, InjectOptions, LightMyRequestResponse, RouteOptions } from 'fastify';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  answerProblems,
  buildDocument,
  documentText,
  DOCUMENT_PATH,
  oas30Problems,
  schemaProblems,
  typesText,
  TYPES_PATH,
  type Json,
} from '../../scripts/openapi.js';
import { challengeOf } from '../../src/domain/runners.js';
import { hashSecret } from '../../src/domain/secrets.js';
import { createPairing, enroll } from '../../src/engine/runners/enrollment.js';
import { findOrCreateAccount } from '../../src/engine/users.js';
import { FILE_LIMITS } from '../../src/protocol/rest.js';
import { SSH_TOKEN_PREFIX } from '../../src/protocol/runner.js';
import { workspaceSshGrants } from '../../src/store/schema.js';
import { addMembership } from '../../src/store/users.js';
import { buildServer } from '../../src/server/app.js';
import { DEFAULT_AGENT, startTestApi, TEST_PUBLIC_URL, type TestApi } from '../support/api.js';

type Schema = { $ref?: string; allOf?: Schema[] };
type Parameter = { in: string; name: string; required?: boolean };
type Response = { content?: Record<string, { schema: Schema }>; headers?: Record<string, unknown> };
type Operation = { security?: unknown; parameters?: Parameter[]; requestBody?: { required?: boolean }; responses: Record<string, Response> };
type Document = Json & {
  openapi: string;
  info: { version: string };
  paths: Record<string, Record<string, Operation>>;
  components: { schemas: Record<string, Json>; securitySchemes: Record<string, unknown> };
};

const ENVELOPE = '#/components/schemas/ErrorEnvelope';
/** The routes that need no credential (signing in, enrolling a runner), and those only a signed-in user may use. */
const PUBLIC = new Set(['POST /api/v1/auth/sign-in', 'POST /api/v1/auth/sign-in-link', 'POST /api/v1/runners/enroll']);
const SESSION_ONLY = new Set([
  'GET /api/v1/auth/session',
  'POST /api/v1/auth/sign-out',
  'POST /api/v1/auth/password',
  // The user's side of desktop runners: a workspace API key may not pair, list or revoke them.
  'POST /api/v1/runner-pairings',
  'GET /api/v1/runners',
  'POST /api/v1/runners/{id}/revoke',
  // The owner's side of local work: only the runner's owner, signed in.
  'GET /api/v1/tasks/{taskIdOrSlug}/requests',
  'POST /api/v1/tasks/{taskIdOrSlug}/permissions/{requestId}',
  'POST /api/v1/tasks/{taskIdOrSlug}/questions/{requestId}',
  'POST /api/v1/tasks/{taskIdOrSlug}/review-requests',
  'GET /api/v1/tasks/{taskIdOrSlug}/review-requests/{id}',
]);
/** Everything else under /api/v1/runners/ is the runner protocol, behind the runner's own credential. */
const RUNNER_ROUTE = /^\w+ \/api\/v1\/runners\//;
/** The workspace shell takes nothing but a temporary shell token. */
const SHELL_ROUTE = 'POST /api/v1/workspace-shell';
const securityOf = (name: string) =>
  PUBLIC.has(name)
    ? []
    : SESSION_ONLY.has(name)
      ? [{ sessionCookie: [] }]
      : name === SHELL_ROUTE
        ? [{ workspaceShellToken: [] }]
        : RUNNER_ROUTE.test(name)
          ? [{ runnerCredential: [] }]
          : [{ bearerAuth: [] }, { sessionCookie: [] }];
const isRunnerRoute = (name: string) => securityOf(name).some((scheme) => 'runnerCredential' in scheme);

/** A new user's runner connection, enrolled through the engine as `svc runner pair` would. */
async function enrolledRunnerOf(api: TestApi): Promise<{ userId: string; runnerId: string; credential: string }> {
  const db = api.db.database.db;
  const email = `probe-${randomBytes(4).toString('hex')}@example.com`;
  const { user } = await db.transaction((tx) => findOrCreateAccount(tx, { email, defaultAgent: DEFAULT_AGENT }));
  const verifier = randomBytes(32).toString('base64url');
  const { pairingCode } = await createPairing(db, { userId: user.id, challenge: challengeOf(verifier) });
  const credential = `service_runner_${randomBytes(32).toString('base64url')}`;
  const { runnerId } = await enroll(db, { pairingCode, verifier, credential, name: 'probe' });
  return { userId: user.id, runnerId, credential };
}
const runnerCredentialOf = async (api: TestApi): Promise<string> => (await enrolledRunnerOf(api)).credential;
/**
 * A workspace shell token for the tenant's workspace, granted as a local run of one of its members would
 * get it: to the member's runner connection, which must stay live for the token to work.
 */
async function shellTokenOf(api: TestApi, workspaceId: string): Promise<string> {
  const db = api.db.database.db;
  const { userId, runnerId } = await enrolledRunnerOf(api);
  await addMembership(db, { workspaceId, userId, role: 'member' });
  const token = `${SSH_TOKEN_PREFIX}${randomBytes(32).toString('base64url')}`;
  await db.insert(workspaceSshGrants).values({ tokenHash: hashSecret(token), userId, workspaceId, runnerId, expiresAt: new Date(Date.now() + 60 * 60_000) });
  return token;
}

/** The component a schema points at, directly or through a described `allOf` wrapper. */
const refOf = (schema: Schema | undefined): string | undefined => schema?.$ref ?? schema?.allOf?.[0]?.$ref;
const keysOf = (zodObject: unknown): string[] => Object.keys((zodObject as { shape?: object } | undefined)?.shape ?? {}).sort();
const toHeaders = (response: LightMyRequestResponse) =>
  new Headers(Object.entries(response.headers).flatMap(([name, value]) => (value === undefined ? [] : [[name, String(value)] as [string, string]])));

/** Starts a test API and records every route its Fastify instance registers, as Fastify sees it. */
async function startRecordingRoutes(): Promise<{ api: TestApi; routes: RouteOptions[] }> {
  const routes: RouteOptions[] = [];
  // Fastify announces each new instance on this channel before any plugin registers a route.
  const record = (message: unknown) => {
    (message as { fastify: FastifyInstance }).fastify.addHook('onRoute', (route) => {
      routes.push(route);
    });
  };
  subscribe('fastify.initialization', record);
  try {
    return { api: await startTestApi('pglite'), routes };
  } finally {
    unsubscribe('fastify.initialization', record);
  }
}

describe('the OpenAPI document', () => {
  let api: TestApi;
  let routes: RouteOptions[];
  let document: Document;
  const operations = () =>
    Object.entries(document.paths).flatMap(([path, item]) => Object.entries(item).map(([method, operation]) => ({ path, method: method.toUpperCase(), operation })));

  beforeAll(async () => {
    ({ api, routes } = await startRecordingRoutes());
    const response = await api.app.inject({ method: 'GET', url: '/api/v1/openapi.json' });
    expect(response.statusCode).toBe(200);
    document = response.json();
  });
  afterAll(async () => {
    await api?.close();
  });

  it('is served without a key as valid OpenAPI 3.0.3, API version 1.0.0, with a bearer scheme and a session cookie', async () => {
    expect(document.openapi).toBe('3.0.3');
    expect(document.info.version).toBe('1.0.0');
    await expect(SwaggerParser.validate(structuredClone(document) as never)).resolves.toBeTruthy();
    expect(document.components.securitySchemes).toEqual({
      bearerAuth: expect.objectContaining({ type: 'http', scheme: 'bearer' }),
      sessionCookie: expect.objectContaining({ type: 'apiKey', in: 'cookie', name: 'svc_session' }),
      runnerCredential: expect.objectContaining({ type: 'http', scheme: 'bearer' }),
      workspaceShellToken: expect.objectContaining({ type: 'http', scheme: 'bearer' }),
    });
    const withBadKey = await api.app.inject({ method: 'GET', url: '/api/v1/openapi.json', headers: { authorization: 'Bearer nonsense' } });
    expect(withBadKey.statusCode).toBe(200);
    expect(withBadKey.json()).toEqual(document);
    expect(Object.keys(document.paths)).not.toContain('/api/v1/openapi.json');
  });

  it('uses only what OpenAPI 3.0.3 has, meaning what the zod schemas mean', () => {
    expect(oas30Problems(document)).toEqual([]);
    // Every component is used, once: no unused `…Input` twins, nothing leaked from zod's global registry.
    const text = JSON.stringify({ ...document, components: { ...document.components, schemas: {} } });
    const reachable = new Set<string>();
    const follow = (json: string) => {
      for (const [, name] of json.matchAll(/"#\/components\/schemas\/([^"]+)"/g)) {
        if (name && !reachable.has(name)) {
          reachable.add(name);
          follow(JSON.stringify(document.components.schemas[name]));
        }
      }
    };
    follow(text);
    expect(Object.keys(document.components.schemas).sort()).toEqual([...reachable].sort());
    expect(Object.keys(document.components.schemas).filter((name) => name.endsWith('Input') && name !== 'FileInput')).toEqual([]);
    // A nullable reference accepts null and what it refers to, and nothing else.
    const job = { $ref: '#/components/schemas/Job' };
    const latestJob = (document.components.schemas.GetTaskResponse as { properties: Record<string, Json> }).properties.latestJob!;
    expect(schemaProblems(document, latestJob, null)).toEqual([]);
    expect(schemaProblems(document, latestJob, 'READY')).not.toEqual([]);
    expect(schemaProblems(document, job, null)).not.toEqual([]);
  });

  it('has checks that catch what they are for', () => {
    const bad = {
      openapi: '3.0.3',
      paths: {},
      components: {
        schemas: {
          TypeList: { type: ['string', 'null'] },
          TypeNull: { type: 'null' },
          Const: { const: 'x' },
          Exclusive: { type: 'number', exclusiveMinimum: 0 },
          Dialect: { $schema: 'https://json-schema.org/draft/2020-12/schema', type: 'object' },
          NullableRef: { nullable: true, allOf: [{ $ref: '#/components/schemas/Letter' }] },
          Letter: { type: 'string', enum: ['a'] },
          NullableEnum: { type: 'string', enum: ['a'], nullable: true },
          Huge: { type: 'integer', minimum: Number.MIN_SAFE_INTEGER },
          RefSibling: { $ref: '#/components/schemas/Letter', description: 'ignored in 3.0' },
        },
      },
    };
    const flagged = new Set(oas30Problems(bad).map((problem) => /schemas\/(\w+)/.exec(problem)?.[1]));
    expect([...flagged].sort()).toEqual(['Const', 'Dialect', 'Exclusive', 'Huge', 'NullableEnum', 'NullableRef', 'RefSibling', 'TypeList', 'TypeNull']);
    // Read as 3.0.3 says, `nullable` beside `allOf` lets no null through: the form zod emits for a nullable reference.
    expect(schemaProblems(bad, { $ref: '#/components/schemas/NullableRef' }, null)).not.toEqual([]);
    expect(schemaProblems(bad, { type: 'object', properties: {}, additionalProperties: false }, { extra: 1 })).not.toEqual([]);
    const answer = { method: 'GET', path: '/api/v1/tasks', status: 418, headers: new Headers(), body: '' };
    expect(answerProblems(document, answer)).toEqual([expect.stringContaining('status not documented')]);
  });

  it('documents every route the server registers under /api/v1, with its inputs, security and every answer', () => {
    const registered = routes
      .flatMap((route) => (Array.isArray(route.method) ? route.method : [route.method]).map((method) => ({ method: method.toUpperCase(), route })))
      .filter(({ method, route }) => method !== 'HEAD' && route.url.startsWith('/api/v1/') && route.url !== '/api/v1/openapi.json');
    const asDocumented = ({ method, route }: (typeof registered)[number]) => `${method} ${route.url.replace(/:(\w+)/g, '{$1}')}`;
    expect(registered.length).toBeGreaterThanOrEqual(12);
    expect(operations().map(({ method, path }) => `${method} ${path}`).sort()).toEqual(registered.map(asDocumented).sort());

    for (const entry of registered) {
      const name = asDocumented(entry);
      const [, path] = name.split(' ') as [string, string];
      const schema = entry.route.schema ?? {};
      const operation = document.paths[path]![entry.method.toLowerCase()]!;
      expect(operation.security, name).toEqual(securityOf(name));

      // Inputs: the path, query and header parameters and the body of the route's own zod schemas.
      const parameters = (place: string) => (operation.parameters ?? []).filter((parameter) => parameter.in === place);
      expect(parameters('path').map((parameter) => parameter.name).sort(), name).toEqual(keysOf(schema.params));
      expect(keysOf(schema.params), name).toEqual([...path.matchAll(/\{(\w+)\}/g)].map((match) => match[1]).sort());
      expect(parameters('path').every((parameter) => parameter.required), name).toBe(true);
      expect(parameters('query').map((parameter) => parameter.name).sort(), name).toEqual(keysOf(schema.querystring));
      expect(parameters('header').map((parameter) => parameter.name).sort(), name).toEqual(keysOf(schema.headers));
      expect(operation.requestBody !== undefined, name).toBe(schema.body !== undefined);

      // Answers: exactly the statuses the route declares; one success; errors in the envelope.
      expect(Object.keys(operation.responses).sort(), name).toEqual(Object.keys(schema.response as object).sort());
      const statuses = Object.keys(operation.responses);
      expect(statuses.filter((status) => status.startsWith('2')), name).toHaveLength(1);
      expect(statuses, name).toEqual(expect.arrayContaining(['401', '429', '500']));
      for (const status of statuses.filter((code) => !code.startsWith('2'))) {
        expect(refOf(operation.responses[status]!.content?.['application/json']?.schema), `${name} ${status}`).toBe(ENVELOPE);
      }
      for (const [status, response] of Object.entries(operation.responses)) {
        expect(response.headers, `${name} ${status}`).toHaveProperty('X-Request-Id');
        expect((response as { description?: string }).description, `${name} ${status}`).not.toMatch(/^(Default Response)?$/);
      }
      expect(operation.responses['429']!.headers, name).toHaveProperty('Retry-After');
    }
  });

  it('documents the bodies and parameters the spec names', () => {
    const operation = (method: string, path: string) => document.paths[`/api/v1${path}`]![method]!;
    const bodyRef = (op: Operation) => refOf((op.requestBody as { content: Record<string, { schema: Schema }> }).content['application/json']!.schema);
    expect(bodyRef(operation('post', '/tasks'))).toBe('#/components/schemas/CreateTaskBody');
    expect(operation('post', '/tasks').requestBody!.required).toBe(true);
    expect(bodyRef(operation('post', '/tasks/{taskIdOrSlug}/messages'))).toBe('#/components/schemas/SendMessageBody');
    // approve-plan takes an optional body: a POST without one is fine.
    expect(operation('post', '/tasks/{taskIdOrSlug}/approve-plan').requestBody!.required).toBe(false);
    expect(bodyRef(operation('put', '/routing-configs/{name}'))).toBe('#/components/schemas/PutRoutingConfigBody');
    expect(document.components.schemas.CreateTaskBody).toMatchObject({ required: ['command'] });
    expect(document.components.schemas.SendMessageBody).toMatchObject({ required: ['message'] });
    const query = (op: Operation) => Object.fromEntries((op.parameters ?? []).filter((p) => p.in === 'query').map((p) => [p.name, (p as unknown as { schema: Json }).schema]));
    expect(query(operation('get', '/tasks'))).toMatchObject({ limit: { type: 'integer', minimum: 1, maximum: 100, default: 30 }, cursor: {}, status: {}, archived: {} });
    expect(query(operation('get', '/tasks/{taskIdOrSlug}/jobs'))).toMatchObject({ limit: { type: 'integer', minimum: 1, maximum: 100, default: 30 }, cursor: {} });
    expect(operation('delete', '/routing-configs/{name}').responses['204']!.content).toBeUndefined();
    expect(Object.keys(operation('get', '/tasks/{taskIdOrSlug}/logs').responses['200']!.content!)).toEqual(['text/event-stream']);
  });

  it('answers, on every route, only with statuses, headers and bodies the document describes', async () => {
    const tenant = await api.newTenant();
    const created = await tenant.request('POST', '/api/v1/tasks', { command: 'Probe the routes' });
    expect(created.statusCode).toBe(201);
    const slug: string = created.json().task.slug;
    const tooLarge = Buffer.alloc(FILE_LIMITS.bodyLimitBytes + 1, 0x20);
    // A body every route with one takes (each ignores the fields it does not know).
    const anyBody = JSON.stringify({
      command: 'Probe',
      message: 'Probe',
      mode: 'ask',
      agent: 'openai/gpt-5',
      effort: 'low',
      email: 'probe@example.com',
      password: 'not the password',
      token: 'not-a-link',
      pairingCode: 'ACDE-FGHK',
      verifier: 'v'.repeat(43),
      credential: `service_runner_${'c'.repeat(43)}`,
      name: 'Probe',
    });
    // Runner routes take the runner's own credential: with a key they would answer nothing but 401.
    const runnerHeaders = { authorization: `Bearer ${await runnerCredentialOf(api)}` };
    const shellHeaders = { authorization: `Bearer ${await shellTokenOf(api, tenant.workspace.id)}` };
    const problems: string[] = [];
    const seen = new Map<string, Set<number>>();

    for (const { path, method } of operations()) {
      const name = `${method} ${path}`;
      seen.set(name, new Set());
      const takesBody = ['POST', 'PUT', 'PATCH', 'DELETE'].includes(method);
      const url = (id: string, query = '') => `${path.replace(/\{\w+\}/g, id)}${query}`;
      const probe = async (options: InjectOptions & { url: string }) => {
        const response = await api.app.inject({ method: method as 'GET', ...options });
        seen.get(name)!.add(response.statusCode);
        problems.push(...answerProblems(document, { method, path, status: response.statusCode, headers: toHeaders(response), body: response.body }));
      };
      const credential = isRunnerRoute(name) ? runnerHeaders : name === SHELL_ROUTE ? shellHeaders : tenant.headers;
      const json = { 'content-type': 'application/json', ...credential };
      await probe({ url: url(slug) });
      await probe({ url: url(slug), headers: { authorization: `Bearer service_${'x'.repeat(43)}` } });
      await probe({ url: url('no-such-task-aaaaaa'), headers: json, ...(takesBody ? { payload: anyBody } : {}) });
      await probe({ url: url('x'.repeat(201)), headers: json, ...(takesBody ? { payload: '{}' } : {}) });
      await probe({ url: url('x'.repeat(300)), headers: json, ...(takesBody ? { payload: '{}' } : {}) });
      await probe({ url: url('%E0%A4%A'), headers: json, ...(takesBody ? { payload: '{}' } : {}) });
      await probe({ url: url(slug, '?limit=0&archived=never&follow=maybe'), headers: credential });
      await probe({ url: url(slug, '?probe=%00'), headers: credential });
      if (takesBody) {
        await probe({ url: url(slug), headers: { ...credential, 'content-type': 'text/plain' }, payload: 'hello' });
        await probe({ url: url(slug), headers: json, payload: '{"unterminated' });
        await probe({ url: url(slug), headers: json, payload: tooLarge });
      }
    }
    expect(problems).toEqual([]);

    // The probes reached the answers they aim at.
    for (const [name, statuses] of seen) {
      expect([...statuses], name).toContain(401);
      // A session-only route refuses the key's probes with 403 before it looks for the task.
      // (or refuses its body first).
      if (name.includes('{taskIdOrSlug}')) expect([...statuses], name).toEqual(expect.arrayContaining(SESSION_ONLY.has(name) ? [400] : [400, 404]));
      // Every route with path, query or body input refuses a bad one (GET /routing-configs has none).
      const [method, path] = name.split(' ') as [string, string];
      const operation = document.paths[path]![method.toLowerCase()]!;
      if ((operation.parameters ?? []).length > 0 || operation.requestBody) expect([...statuses], name).toContain(400);
      if (/^(POST|PUT|DELETE) /.test(name)) expect([...statuses], name).toEqual(expect.arrayContaining([400, 413, 415]));
    }
  });

  it('answers 429 with Retry-After, as documented, on every route', async () => {
    const limited = await startTestApi('pglite', { rateLimits: { perMinute: 1, perHour: 100 } });
    // Runner connections have limits of their own.
    const runnerLimited = await buildServer({
      database: limited.db.database,
      publicUrl: TEST_PUBLIC_URL,
      dataDir: limited.dataDir,
      environments: limited.environments,
      rateLimits: { perMinute: 1, perHour: 100 },
      runnerRateLimits: { perMinute: 1, perHour: 100 },
    });
    try {
      const tenant = await limited.newTenant();
      expect((await tenant.request('GET', '/api/v1/routing-configs')).statusCode).toBe(200);
      const runnerHeaders = { authorization: `Bearer ${await runnerCredentialOf(limited)}` };
      expect((await runnerLimited.inject({ method: 'GET', url: '/api/v1/runners/identity', headers: runnerHeaders })).statusCode).toBe(200);
      const shellHeaders = { authorization: `Bearer ${await shellTokenOf(limited, tenant.workspace.id)}` };
      expect((await limited.app.inject({ method: 'POST', url: '/api/v1/workspace-shell', headers: shellHeaders, payload: {} })).statusCode).toBe(400);
      const problems: string[] = [];
      // Signing in and enrolling need no key, so no key's limit applies there.
      for (const { path, method } of operations().filter(({ path, method }) => !PUBLIC.has(`${method} ${path}`))) {
        const url = path.replace(/\{\w+\}/g, 'any-task-aaaaaa');
        const response = isRunnerRoute(`${method} ${path}`)
          ? await runnerLimited.inject({ method: method as 'GET', url, headers: runnerHeaders })
          : `${method} ${path}` === SHELL_ROUTE
            ? await limited.app.inject({ method: 'POST', url, headers: shellHeaders })
            : await tenant.request(method as 'GET', url);
        expect(response.statusCode, `${method} ${path}`).toBe(429);
        problems.push(...answerProblems(document, { method, path, status: 429, headers: toHeaders(response), body: response.body }));
      }
      expect(problems).toEqual([]);
    } finally {
      await runnerLimited.close();
      await limited.close();
    }
  });

  it('matches the committed docs/openapi.json and src/protocol/openapi.d.ts (run `npm run openapi`)', async () => {
    const fresh = await buildDocument();
    expect(documentText(fresh), 'docs/openapi.json is stale: run `npm run openapi`').toBe(readFileSync(DOCUMENT_PATH, 'utf8'));
    expect(await typesText(fresh), 'src/protocol/openapi.d.ts is stale: run `npm run openapi`').toBe(readFileSync(TYPES_PATH, 'utf8'));
    // The served document is the committed one but for the server's own address.
    expect({ ...document, servers: fresh.servers }).toEqual(fresh);
  });
});
