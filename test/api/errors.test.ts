/**
 * Every error the HTTP edge answers, on both databases, in the `{ error: { code, message, details? } }`
 * envelope with an `x-request-id`: unknown routes, wrong methods, malformed JSON, wrong content types, bodies
 * over the limit, every kind of bad credential, and server failures that must not leak.
 */
import { tmpdir } from 'node:os';
import { Writable } from 'node:stream';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { FILE_LIMITS, type TaskAndJob } from '../../src/protocol/rest.js';
import { buildServer } from '../../src/server/app.js';
import { createApiKey, revokeApiKey } from '../../src/store/api-keys.js';
import { listMessages } from '../../src/store/tasks.js';
import { createWorkspace } from '../../src/store/workspaces.js';
import { DEFAULT_AGENT, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { openTestDatabase, testDrivers } from '../support/db.js';

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const MiB = 1024 * 1024;
const UNAUTHORIZED = { error: { code: 'unauthorized', message: 'Invalid or missing API key' } };
const SERVER_ERROR = { error: { code: 'internal_error', message: 'Server error' } };

type ErrorBody = { error: { code: string; message: string; details?: { issues?: Array<{ field: string; message: string }>; allow?: string[] } } };

/** Checks the envelope, its JSON content type and the request id header; returns the error. */
function expectError(response: LightMyRequestResponse, status: number, code: string): ErrorBody['error'] {
  expect(response.statusCode, response.body).toBe(status);
  expect(response.headers['content-type']).toMatch(/^application\/json/);
  expect(response.headers['x-request-id']).toEqual(expect.any(String));
  const body = response.json() as ErrorBody;
  expect(Object.keys(body)).toEqual(['error']);
  expect(body.error.code).toBe(code);
  expect(body.error.message).toEqual(expect.any(String));
  return body.error;
}

/** A JSON body of exactly `bytes` bytes: `{"command":"x","pad":"yyy…"}` (the pad is not a field and is dropped). */
function bodyOfSize(bytes: number, fields: Record<string, unknown> = { command: 'x' }): string {
  const base = JSON.stringify({ ...fields, pad: '' });
  return `${base.slice(0, -2)}${'y'.repeat(bytes - base.length)}"}`;
}

describe.each(testDrivers)('HTTP errors on %s', (driver) => {
  let api: TestApi;
  let t: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant: t } = ready));

  const raw = (options: InjectOptions) => api.app.inject(options);
  const json = (method: InjectOptions['method'], url: string, payload: string, headers: Record<string, string> = t.headers) =>
    raw({ method, url, payload, headers: { ...headers, 'content-type': 'application/json' } });
  const newTask = async () => ((await t.request('POST', '/api/v1/tasks', { command: 'errors' })).json() as TaskAndJob).task;

  it('answers an unknown route with 404 not_found, authenticated or not', async () => {
    for (const [method, url, headers] of [
      ['GET', '/api/v1/nothing-here', t.headers],
      ['GET', '/api/v1/nothing-here', {}],
      ['POST', '/api/v1/tasks/some-task/explode', t.headers],
      ['GET', '/api/v1', t.headers],
      ['GET', '/nowhere?x=1', {}],
      ['GET', '/api/v2/tasks', t.headers],
    ] as const) {
      const error = expectError(await raw({ method, url, headers }), 404, 'not_found');
      expect(error).toEqual({ code: 'not_found', message: `Route ${method} ${url.split('?')[0]} not found` });
    }
  });

  it('answers a known path with the wrong method with 405 and Allow', async () => {
    const { id } = await newTask();
    for (const [method, url, allow] of [
      ['DELETE', '/api/v1/tasks', 'GET, HEAD, POST'],
      ['PUT', '/api/v1/tasks', 'GET, HEAD, POST'],
      ['DELETE', `/api/v1/tasks/${id}`, 'GET, HEAD'],
      ['PATCH', `/api/v1/tasks/${id}`, 'GET, HEAD'],
      ['GET', `/api/v1/tasks/${id}/cancel`, 'POST'],
      ['PUT', `/api/v1/tasks/${id}/archive`, 'POST'],
      ['GET', `/api/v1/tasks/${id}/approve-plan`, 'POST'],
      ['GET', `/api/v1/tasks/${id}/messages`, 'POST'],
      ['POST', `/api/v1/tasks/${id}/jobs`, 'GET, HEAD'],
      ['POST', '/api/v1/routing-configs/x', 'PUT, DELETE'],
      ['DELETE', '/api/v1/routing-configs', 'GET, HEAD'],
    ] as const) {
      const response = await raw({ method, url, headers: t.headers });
      const error = expectError(response, 405, 'method_not_allowed');
      expect(response.headers.allow, `${method} ${url}`).toBe(allow);
      expect(error.details?.allow).toEqual(allow.split(', '));
      expect(error.message).toBe(`Method ${method} is not allowed on ${url}`);
    }
  });

  it('answers malformed JSON and non-object bodies with 400 validation_error naming `body`', async () => {
    const { id } = await newTask();
    const routes = [
      ['POST', '/api/v1/tasks'],
      ['POST', `/api/v1/tasks/${id}/messages`],
      ['POST', `/api/v1/tasks/${id}/approve-plan`],
      ['PUT', '/api/v1/routing-configs/x'],
    ] as const;
    for (const [method, url] of routes) {
      // approve-plan takes an optional body, so a JSON null is "no body" there.
      const nonObjects = url.endsWith('/approve-plan') ? ['[1, 2]', '"text"', '42'] : ['[1, 2]', '"text"', 'null', '42'];
      for (const payload of ['{"command": ', '{command: "x"}', "{'a': 1}", '{"a": 1,}', ...nonObjects]) {
        const error = expectError(await json(method, url, payload), 400, 'validation_error');
        expect(error.message, `${url} ${payload}`).toBe('Invalid request body');
        expect(error.details?.issues, `${url} ${payload}`).toEqual([{ field: 'body', message: expect.any(String) }]);
      }
    }
    // The same routes accept well-formed JSON, charset or not.
    expect((await json('POST', '/api/v1/tasks', '{"command":"ok"}')).statusCode).toBe(201);
    const charset = await raw({ method: 'POST', url: '/api/v1/tasks', headers: { ...t.headers, 'content-type': 'application/json; charset=utf-8' }, payload: '{"command":"ok"}' });
    expect(charset.statusCode).toBe(201);
  });

  it('answers any content type but JSON with 415 unsupported_media_type', async () => {
    const { id } = await newTask();
    const routes = [
      ['POST', '/api/v1/tasks'],
      ['POST', `/api/v1/tasks/${id}/messages`],
      ['POST', `/api/v1/tasks/${id}/cancel`],
      ['PUT', '/api/v1/routing-configs/x'],
    ] as const;
    for (const [method, url] of routes) {
      for (const [type, payload] of [
        ['text/plain', '{"command":"x"}'],
        ['application/x-www-form-urlencoded', 'command=x'],
        ['multipart/form-data; boundary=b', '--b\r\nContent-Disposition: form-data; name="command"\r\n\r\nx\r\n--b--'],
        ['application/xml', '<command>x</command>'],
        ['application/vnd.api+json', '{"command":"x"}'],
      ]) {
        const response = await raw({ method, url, payload, headers: { ...t.headers, 'content-type': type } });
        expectError(response, 415, 'unsupported_media_type');
      }
    }
    expect(((await t.request('GET', `/api/v1/tasks/${id}`)).json() as TaskAndJob).task.status).toBe('PENDING');
    // An empty body with a JSON content type is "no body".
    expect((await raw({ method: 'POST', url: `/api/v1/tasks/${id}/cancel`, payload: '', headers: { ...t.headers, 'content-type': 'application/json' } })).statusCode).toBe(200);
  });

  it('answers a body over 1 MiB on ordinary routes with 413 payload_too_large', async () => {
    const config = { mode: 'agent', agent: 'openai/gpt-5', effort: 'low' };
    expect((await json('PUT', '/api/v1/routing-configs/big', bodyOfSize(MiB, config))).statusCode).toBe(200);
    const over = expectError(await json('PUT', '/api/v1/routing-configs/big2', bodyOfSize(MiB + 1, config)), 413, 'payload_too_large');
    expect(over.message).toBe('Request body is too large');
    const names = ((await t.request('GET', '/api/v1/routing-configs')).json() as { routingConfigs: Array<{ name: string }> }).routingConfigs;
    expect(names.map((c) => c.name)).not.toContain('big2');

    const { id } = await newTask();
    expectError(await json('POST', `/api/v1/tasks/${id}/approve-plan`, bodyOfSize(MiB + 1, { message: 'x' })), 413, 'payload_too_large');
    expectError(await json('POST', `/api/v1/tasks/${id}/cancel`, bodyOfSize(2 * MiB, {})), 413, 'payload_too_large');
    expect(((await t.request('GET', `/api/v1/tasks/${id}`)).json() as TaskAndJob).task.status).toBe('PENDING');
  });

  it('lets the routes that take files up to their larger limit, and no further', async () => {
    const limit = FILE_LIMITS.bodyLimitBytes;
    expect((await json('POST', '/api/v1/tasks', bodyOfSize(2 * MiB))).statusCode).toBe(201);
    expect((await json('POST', '/api/v1/tasks', bodyOfSize(limit))).statusCode).toBe(201);
    expectError(await json('POST', '/api/v1/tasks', bodyOfSize(limit + 1)), 413, 'payload_too_large');
    const { id } = await newTask();
    expect((await json('POST', `/api/v1/tasks/${id}/messages`, bodyOfSize(limit, { message: 'm' }))).statusCode).toBe(201);
    expectError(await json('POST', `/api/v1/tasks/${id}/messages`, bodyOfSize(limit + 1, { message: 'm' })), 413, 'payload_too_large');
  });

  it('answers 401 unauthorized "Invalid or missing API key" to every bad credential on every route', async () => {
    const db = api.db.database.db;
    const { id, slug } = await newTask();
    const expired = await createApiKey(db, { workspaceId: t.workspace.id, name: 'old', expiresAt: new Date(Date.now() - 60_000) });
    const revoked = await createApiKey(db, { workspaceId: t.workspace.id, name: 'gone' });
    const revokedHeaders = { authorization: `Bearer ${revoked.key}` };
    expect((await raw({ method: 'GET', url: '/api/v1/tasks', headers: revokedHeaders })).statusCode).toBe(200);
    expect((await revokeApiKey(db, t.workspace.id, revoked.record.id)).revoked?.revokedAt).toBeInstanceOf(Date);

    const credentials: Array<[string, Record<string, string>]> = [
      ['no header', {}],
      ['an empty header', { authorization: '' }],
      ['Bearer alone', { authorization: 'Bearer' }],
      ['Basic', { authorization: `Basic ${Buffer.from(`user:${t.key}`).toString('base64')}` }],
      ['another scheme with the key', { authorization: `Token ${t.key}` }],
      ['the bare key', { authorization: t.key }],
      ['two tokens', { authorization: `Bearer ${t.key} extra` }],
      ['a malformed key', { authorization: 'Bearer not-a-key' }],
      ['a short key', { authorization: 'Bearer service_short' }],
      ['a key with a bad character', { authorization: `Bearer ${t.key.slice(0, -1)}!` }],
      ['an unknown key', { authorization: `Bearer service_${'x'.repeat(43)}` }],
      ['a key with one character more', { authorization: `Bearer ${t.key}x` }],
      ['a runner credential', { authorization: `Bearer service_runner_${'y'.repeat(43)}` }],
      ['an expired key', { authorization: `Bearer ${expired.key}` }],
      ['a revoked key', revokedHeaders],
    ];
    const routes: Array<[InjectOptions['method'], string, unknown?]> = [
      ['POST', '/api/v1/tasks', { command: 'x' }],
      ['GET', '/api/v1/tasks'],
      ['GET', `/api/v1/tasks/${id}`],
      ['GET', `/api/v1/tasks/${slug}/jobs`],
      ['GET', `/api/v1/tasks/${id}/logs`],
      ['POST', `/api/v1/tasks/${id}/messages`, { message: 'x' }],
      ['POST', `/api/v1/tasks/${id}/approve-plan`],
      ['POST', `/api/v1/tasks/${id}/cancel`],
      ['POST', `/api/v1/tasks/${id}/archive`],
      ['GET', '/api/v1/routing-configs'],
      ['PUT', '/api/v1/routing-configs/x', { mode: 'agent', agent: 'openai/gpt-5', effort: 'low' }],
      ['DELETE', '/api/v1/routing-configs/x'],
    ];
    for (const [label, headers] of credentials) {
      for (const [method, url, payload] of routes) {
        const response = await raw({ method, url, headers, ...(payload === undefined ? {} : { payload: payload as object }) });
        expectError(response, 401, 'unauthorized');
        expect(response.json(), `${label}: ${method} ${url}`).toEqual(UNAUTHORIZED);
      }
    }
    // Nothing was done: the task is untouched and no config was made.
    expect(((await t.request('GET', `/api/v1/tasks/${id}/jobs`)).json() as { jobs: unknown[] }).jobs).toHaveLength(1);
    expect(((await t.request('GET', `/api/v1/tasks/${id}`)).json() as TaskAndJob).task.status).toBe('PENDING');
    // The scheme is case-insensitive and the key itself is fine.
    expect((await raw({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `bearer ${t.key}` } })).statusCode).toBe(200);
  });

  it('checks the credential before the body, the content type, the size and the task', async () => {
    const { id } = await newTask();
    const cases: InjectOptions[] = [
      { method: 'POST', url: '/api/v1/tasks', headers: { 'content-type': 'application/json' }, payload: '{"command": ' },
      { method: 'POST', url: '/api/v1/tasks', headers: { 'content-type': 'application/json' }, payload: '{}' },
      { method: 'POST', url: '/api/v1/tasks', headers: { 'content-type': 'text/plain' }, payload: 'x' },
      { method: 'PUT', url: '/api/v1/routing-configs/x', headers: { 'content-type': 'application/json' }, payload: bodyOfSize(2 * MiB) },
      { method: 'GET', url: '/api/v1/tasks/00000000-0000-4000-8000-000000000000' },
      { method: 'GET', url: '/api/v1/tasks?limit=0' },
      { method: 'POST', url: `/api/v1/tasks/${id}/cancel` },
    ];
    for (const options of cases) expect((await raw(options)).json(), `${options.method} ${options.url}`).toEqual(UNAUTHORIZED);
  });

  it('answers health and readiness without a key', async () => {
    for (const url of ['/healthz', '/readyz']) {
      const response = await raw({ method: 'GET', url });
      expect(response.statusCode, url).toBe(200);
      expect(response.json()).toEqual({ status: 'ok' });
      expect(response.headers['x-request-id']).toMatch(UUID);
    }
  });

  it('gives every answer a request id and echoes a well-formed incoming one', async () => {
    const seen = new Set<string>();
    for (const response of [
      await t.request('GET', '/api/v1/tasks'),
      await t.request('GET', '/api/v1/tasks/missing-task'),
      await t.request('POST', '/api/v1/tasks', {}),
      await raw({ method: 'GET', url: '/api/v1/tasks' }),
      await raw({ method: 'GET', url: '/nowhere' }),
      await raw({ method: 'DELETE', url: '/api/v1/tasks', headers: t.headers }),
    ]) {
      const id = response.headers['x-request-id'];
      expect(id).toMatch(UUID);
      seen.add(String(id));
    }
    expect(seen.size).toBe(6);

    for (const options of [
      { method: 'GET', url: '/api/v1/tasks', headers: t.headers },
      { method: 'GET', url: '/api/v1/tasks' },
      { method: 'GET', url: '/api/v1/tasks/missing-task', headers: t.headers },
      { method: 'POST', url: '/api/v1/tasks', headers: { ...t.headers, 'content-type': 'text/plain' }, payload: 'x' },
      { method: 'PUT', url: '/api/v1/routing-configs/x', headers: { ...t.headers, 'content-type': 'application/json' }, payload: bodyOfSize(2 * MiB) },
      { method: 'GET', url: '/nowhere' },
    ] as InjectOptions[]) {
      const kept = await raw({ ...options, headers: { ...options.headers, 'x-request-id': 'trace-123.abc:X_9' } });
      expect(kept.headers['x-request-id'], `${options.method} ${options.url}`).toBe('trace-123.abc:X_9');
    }
    for (const bad of ['bad id with spaces', 'x'.repeat(129), 'semi;colon', '']) {
      const replaced = await raw({ method: 'GET', url: '/api/v1/tasks', headers: { ...t.headers, 'x-request-id': bad } });
      expect(replaced.headers['x-request-id']).toMatch(UUID);
    }
    expect((await raw({ method: 'GET', url: '/api/v1/tasks', headers: { ...t.headers, 'x-request-id': 'y'.repeat(128) } })).headers['x-request-id']).toBe('y'.repeat(128));
  });
});

describe.each(testDrivers)('server failures on %s', (driver) => {
  it('answers 500 internal_error "Server error" without leaking, and logs the cause', async () => {
    const lines: string[] = [];
    const sink = new Writable({
      write(chunk, _encoding, done) {
        lines.push(String(chunk));
        done();
      },
    });
    const testDb = await openTestDatabase(driver);
    const app = await buildServer({
      database: testDb.database,
      publicUrl: 'http://svc.test',
      dataDir: tmpdir(),
      rateLimits: { perMinute: 1000, perHour: 10_000 },
      logger: pino({ level: 'info' }, sink),
    });
    app.get('/api/v1/explode', async () => {
      throw new Error('secret internals at /srv/app/db.ts:12');
    });
    app.get('/api/v1/explode-value', async () => {
      throw 'secret string thrown';
    });
    app.get('/api/v1/explode-status', async () => {
      throw Object.assign(new Error('secret upstream detail'), { statusCode: 502, code: 'E_UPSTREAM' });
    });
    await app.ready();
    const workspace = await createWorkspace(testDb.database.db, { name: 'failing', plan: 'free', defaultAgent: DEFAULT_AGENT });
    const { key } = await createApiKey(testDb.database.db, { workspaceId: workspace!.id, name: 'k' });
    const headers = { authorization: `Bearer ${key}`, 'x-request-id': 'req-500' };
    try {
      for (const url of ['/api/v1/explode', '/api/v1/explode-value', '/api/v1/explode-status']) {
        const response = await app.inject({ method: 'GET', url, headers });
        expect(response.statusCode, url).toBe(500);
        expect(response.json()).toEqual(SERVER_ERROR);
        expect(response.headers['x-request-id']).toBe('req-500');
        expect(response.body).not.toMatch(/secret|\.ts|stack|E_UPSTREAM/);
      }
      const logged = lines.join('');
      expect(logged).toContain('secret internals at /srv/app/db.ts:12');
      expect(logged).toContain('"stack"');
      expect(logged).toContain('"requestId":"req-500"');

      // The database goes away under a running server.
      expect((await app.inject({ method: 'GET', url: '/api/v1/tasks', headers })).statusCode).toBe(200);
      await testDb.close();
      for (const [method, url, payload] of [
        ['GET', '/api/v1/tasks', undefined],
        ['POST', '/api/v1/tasks', { command: 'x' }],
        ['GET', '/api/v1/routing-configs', undefined],
      ] as const) {
        const down = await app.inject({ method, url, headers, ...(payload ? { payload } : {}) });
        expect(down.statusCode, `${method} ${url}`).toBe(500);
        expect(down.json()).toEqual(SERVER_ERROR);
        expect(down.headers['x-request-id']).toBe('req-500');
      }
      const ready = await app.inject({ method: 'GET', url: '/readyz' });
      expect(ready.statusCode).toBe(503);
      expect(ready.json()).toEqual({ error: { code: 'service_unavailable', message: 'Database unavailable' } });
    } finally {
      await app.close();
      await testDb.close().catch(() => undefined);
    }
  });
});

describe.each(testDrivers)('validation errors of task bodies on %s', (driver) => {
  let api: TestApi;
  let t: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant: t } = ready));

  const db = () => api.db.database.db;
  const fieldsOf = (response: LightMyRequestResponse) =>
    expectError(response, 400, 'validation_error').details!.issues!.map((issue) => issue.field).sort();
  const listIds = async (query: string) =>
    ((await t.request('GET', `/api/v1/tasks${query}`)).json() as { tasks: Array<{ id: string }> }).tasks.map((task) => task.id);
  async function create(body: Record<string, unknown>): Promise<TaskAndJob> {
    const response = await t.request('POST', '/api/v1/tasks', body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json() as TaskAndJob;
  }

  it('refuses an agent that is not a complete <provider>/<model> id', async () => {
    const before = await listIds('?archived=include&limit=100');
    for (const [agent, message] of [
      ['openai', /provider alone/],
      ['claude-code', /provider alone/],
      ['nosuch/model', /unknown provider "nosuch"/],
      ['/gpt-5', /unknown provider ""/],
      ['openai/', /model/],
      ['anthropic/claude sonnet', /model/],
    ] as const) {
      const error = expectError(await t.request('POST', '/api/v1/tasks', { command: 'x', agent }), 400, 'validation_error');
      expect(error.details?.issues, agent).toEqual([{ field: 'agent', message: expect.stringMatching(message) }]);
    }
    expect(await listIds('?archived=include&limit=100')).toEqual(before);
  });

  it('refuses an unknown userIntent or effort, ultracode without claude-code, and a blank or long title', async () => {
    const before = await listIds('?archived=include&limit=100');
    for (const [body, field] of [
      [{ userIntent: 'DEPLOY' }, 'userIntent'],
      [{ effort: 'max' }, 'effort'],
      [{ effort: 'ultracode' }, 'effort'],
      [{ effort: 'ultracode', agent: 'openai/gpt-5' }, 'effort'],
      [{ effort: 'ultracode', agent: 'codex/gpt-5-codex' }, 'effort'],
      [{ title: '   ' }, 'title'],
      [{ title: 'x'.repeat(201) }, 'title'],
      [{ files: 'nope' }, 'files'],
      [{ files: [{ name: '', url: 'https://e.test/a' }] }, 'files.0.name'],
      [{ files: [{ url: '' }] }, 'files.0.url'],
    ] as const) {
      expect(fieldsOf(await t.request('POST', '/api/v1/tasks', { command: 'x', ...body })), JSON.stringify(body)).toEqual([field]);
    }
    expect(fieldsOf(await t.request('POST', '/api/v1/tasks', { command: '', agent: 'openai' }))).toEqual(['agent', 'command']);
    expect(await listIds('?archived=include&limit=100')).toEqual(before);
  });

    it.each([
      ['invalid base64', 'data:text/plain;base64,@@@', /base64/],
      ['no comma', 'data:text/plain;base64', /comma/],
      ['bad media type', 'data:not a type,x', /media type/],
      ['bad percent-encoding', 'data:,%E0%A4%A', /percent/],
      ['ftp: scheme', 'ftp://example.com/a', /data:, http: or https:/],
      ['file: scheme', 'file:///etc/passwd', /data:, http: or https:/],
      ['no scheme', 'notes.txt', /data:, http: or https:/],
      ['broken http URL', 'http://', /invalid URL/],
    ])('refuses a file with %s (400 naming files.1.url and the file)', async (_label, url, message) => {
      const before = await listIds('?archived=include&limit=100');
      const response = await t.request('POST', '/api/v1/tasks', { command: 'x', files: [{ url: 'https://e.test/ok' }, { name: 'bad.bin', url }] });
      const error = expectError(response, 400, 'validation_error');
      expect(error.details?.issues).toEqual([{ field: 'files.1.url', message: expect.stringMatching(message) }]);
      expect(error.details?.issues?.[0]?.message).toContain('"bad.bin"');
      expect(await listIds('?archived=include&limit=100')).toEqual(before);
    });

    it('enforces the file count, per-file and total size limits', async () => {
      const https = (n: number) => Array.from({ length: n }, (_, i) => ({ url: `https://e.test/${i}.png` }));
      expect(fieldsOf(await t.request('POST', '/api/v1/tasks', { command: 'x', files: https(11) }))).toEqual(['files']);
      expect((await create({ command: 'x', files: https(10) })).job.status).toBe('PENDING');

      const data = (bytes: number) => `data:application/octet-stream;base64,${Buffer.alloc(bytes, 7).toString('base64')}`;
      const atLimit = await create({ command: 'x', files: [{ name: 'max.bin', url: data(10 * MiB) }] });
      expect((await listMessages(db(), atLimit.task.id))[0]!.files[0]!.sizeBytes).toBe(10 * MiB);
      const over = expectError(
        await t.request('POST', '/api/v1/tasks', { command: 'x', files: [{ name: 'big.bin', url: data(10 * MiB + 1) }] }),
        400,
        'validation_error',
      );
      expect(over.details?.issues).toEqual([{ field: 'files.0.url', message: expect.stringContaining('"big.bin"') }]);
      const total = await t.request('POST', '/api/v1/tasks', {
        command: 'x',
        files: [{ url: data(10 * MiB) }, { url: data(10 * MiB) }, { url: data(5 * MiB + 1) }],
      });
      expect(fieldsOf(total)).toEqual(['files']);
    });
});
