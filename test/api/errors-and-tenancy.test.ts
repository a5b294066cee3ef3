import { tmpdir } from 'node:os';
import { describe, expect, it } from 'vitest';
import { z } from 'zod';
import { buildServer } from '../../src/server/app.js';
import { createApiKey, revokeApiKey } from '../../src/store/api-keys.js';
import { useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { openTestDatabase, testDrivers } from '../support/db.js';

const UNAUTHORIZED = { error: { code: 'unauthorized', message: 'Invalid or missing API key' } };

describe.each(testDrivers)('errors on %s', (driver) => {
  let api: TestApi;
  let t: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant: t } = ready));

  it('answers 401 for every kind of bad credential', async () => {
    const db = api.db.database.db;
    const expired = await createApiKey(db, { workspaceId: t.workspace.id, name: 'old', expiresAt: new Date(Date.now() - 1000) });
    const revoked = await createApiKey(db, { workspaceId: t.workspace.id, name: 'gone' });
    await revokeApiKey(db, t.workspace.id, revoked.record.id);
    const headers: Array<Record<string, string>> = [
      {},
      { authorization: '' },
      { authorization: 'Bearer' },
      { authorization: `Basic ${Buffer.from('a:b').toString('base64')}` },
      { authorization: `Token ${t.key}` },
      { authorization: 'Bearer not-a-key' },
      { authorization: 'Bearer service_short' },
      { authorization: `Bearer service_${'x'.repeat(43)}` },
      { authorization: `Bearer ${t.key}x` },
      { authorization: `Bearer service_runner_${'y'.repeat(43)}` },
      { authorization: `Bearer ${expired.key}` },
      { authorization: `Bearer ${revoked.key}` },
    ];
    for (const header of headers) {
      for (const [method, url] of [['GET', '/api/v1/tasks'], ['POST', '/api/v1/tasks'], ['GET', '/api/v1/routing-configs']] as const) {
        const response = await api.app.inject({ method, url, headers: header, payload: method === 'POST' ? { command: 'x' } : undefined });
        expect(response.statusCode, `${JSON.stringify(header)} ${method} ${url}`).toBe(401);
        expect(response.json()).toEqual(UNAUTHORIZED);
      }
    }
    // The same key, well formed, is accepted (so the refusals above are about the credential).
    expect((await t.request('GET', '/api/v1/tasks')).statusCode).toBe(200);
    const lowercaseScheme = await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `bearer ${t.key}` } });
    expect(lowercaseScheme.statusCode).toBe(200);
  });

  it('answers unknown routes with 404 and wrong methods with 405 and Allow', async () => {
    const unknown = await t.request('GET', '/api/v1/nothing-here');
    expect(unknown.statusCode).toBe(404);
    expect(unknown.json().error.code).toBe('not_found');
    const outside = await api.app.inject({ method: 'GET', url: '/nowhere' });
    expect(outside.statusCode).toBe(404);
    expect(outside.json().error.code).toBe('not_found');

    const wrong = await t.request('DELETE', '/api/v1/tasks');
    expect(wrong.statusCode).toBe(405);
    expect(wrong.json().error.code).toBe('method_not_allowed');
    expect(wrong.headers.allow).toContain('GET');
    expect(wrong.headers.allow).toContain('POST');
    const wrongParam = await t.request('PUT', '/api/v1/tasks/some-slug/cancel');
    expect(wrongParam.statusCode).toBe(405);
    expect(wrongParam.headers.allow).toBe('POST');
  });

  it('answers malformed JSON, wrong content types and oversized bodies with the envelope', async () => {
    const malformed = await api.app.inject({
      method: 'POST',
      url: '/api/v1/tasks',
      headers: { ...t.headers, 'content-type': 'application/json' },
      payload: '{"command": ',
    });
    expect(malformed.statusCode).toBe(400);
    expect(malformed.json().error).toMatchObject({ code: 'validation_error', message: 'Invalid request body', details: { issues: [{ field: 'body' }] } });

    const notJson = await api.app.inject({
      method: 'POST',
      url: '/api/v1/tasks',
      headers: { ...t.headers, 'content-type': 'text/plain' },
      payload: 'command=hello',
    });
    expect(notJson.statusCode).toBe(415);
    expect(notJson.json().error.code).toBe('unsupported_media_type');

    const array = await t.request('POST', '/api/v1/tasks', [1, 2]);
    expect(array.statusCode).toBe(400);
    expect(array.json().error.details.issues[0].field).toBe('body');

    const big = await t.request('PUT', '/api/v1/routing-configs/big', {
      mode: 'agent',
      agent: 'openai/gpt-5',
      effort: 'low',
      instructions: 'x'.repeat(1024 * 1024 + 10),
    });
    expect(big.statusCode).toBe(413);
    expect(big.json().error.code).toBe('payload_too_large');

    const huge = await t.request('POST', '/api/v1/tasks', { command: 'x', pad: 'y'.repeat(37 * 1024 * 1024) });
    expect(huge.statusCode).toBe(413);
    expect(huge.json().error.code).toBe('payload_too_large');

    // An empty body with a JSON content type is "no body": POST /cancel still works.
    const created = (await t.request('POST', '/api/v1/tasks', { command: 'empty body' })).json();
    const cancel = await api.app.inject({
      method: 'POST',
      url: `/api/v1/tasks/${created.task.id}/cancel`,
      headers: { ...t.headers, 'content-type': 'application/json' },
      payload: '',
    });
    expect(cancel.statusCode).toBe(200);
  });

  it('refuses NUL characters, which PostgreSQL text cannot hold, without a 500', async () => {
    const created = await t.request('POST', '/api/v1/tasks', { command: 'a\u0000b' });
    expect(created.statusCode).toBe(400);
    expect(created.json().error.details.issues).toEqual([{ field: 'command', message: 'must not contain NUL characters' }]);
    const nested = await t.request('POST', '/api/v1/tasks', { command: 'ok', files: [{ name: 'x\u0000', url: 'https://example.com/a' }] });
    expect(nested.json().error.details.issues[0].field).toBe('files.0.name');
    expect((await t.request('GET', '/api/v1/tasks/%00')).json()).toEqual({ error: { code: 'not_found', message: 'Task not found' } });
    expect((await t.request('GET', '/api/v1/tasks?status=%00')).statusCode).toBe(400);
    const config = await t.request('PUT', '/api/v1/routing-configs/nul', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low', instructions: '\u0000' });
    expect(config.statusCode).toBe(400);
    expect((await t.request('DELETE', '/api/v1/routing-configs/%00')).statusCode).toBe(400);
    // A file name decoded from a URL loses its control characters instead.
    const decoded = await t.request('POST', '/api/v1/tasks', { command: 'file', files: [{ url: 'https://example.com/%00' }] });
    expect(decoded.statusCode).toBe(201);
  });

  it('gives every answer a request id and keeps a well-formed incoming one', async () => {
    const fresh = await t.request('GET', '/api/v1/tasks');
    expect(fresh.headers['x-request-id']).toMatch(/^[0-9a-f-]{36}$/);
    const kept = await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { ...t.headers, 'x-request-id': 'trace-123.abc' } });
    expect(kept.headers['x-request-id']).toBe('trace-123.abc');
    const replaced = await api.app.inject({ method: 'GET', url: '/api/v1/nope', headers: { 'x-request-id': 'bad id with spaces' } });
    expect(replaced.headers['x-request-id']).not.toBe('bad id with spaces');
    expect(replaced.headers['x-request-id']).toMatch(/^[0-9a-f-]{36}$/);
  });

  it('answers health and readiness', async () => {
    expect((await api.app.inject({ method: 'GET', url: '/healthz' })).json()).toEqual({ status: 'ok' });
    const ready = await api.app.inject({ method: 'GET', url: '/readyz' });
    expect(ready.statusCode).toBe(200);
  });
});

describe.each(testDrivers)('failures inside the server on %s', (driver) => {
  it('answers 500 internal_error "Server error" without a stack, and 503 from /readyz, when the database is gone', async () => {
    const testDb = await openTestDatabase(driver);
    const app = await buildServer({ database: testDb.database, publicUrl: 'http://x', dataDir: tmpdir(), rateLimits: { perMinute: 100, perHour: 1000 } });
    app.get('/api/v1/explode', { schema: { response: { 200: z.object({ ok: z.boolean() }) } } }, async () => {
      throw new Error('secret internals at /srv/app.ts:12');
    });
    await app.ready();
    const exploded = await app.inject({ method: 'GET', url: '/api/v1/explode' });
    expect(exploded.statusCode).toBe(500);
    expect(exploded.json()).toEqual({ error: { code: 'internal_error', message: 'Server error' } });
    expect(exploded.body).not.toContain('secret');

    await testDb.close();
    const key = `service_${'k'.repeat(43)}`;
    const down = await app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `Bearer ${key}` } });
    expect(down.statusCode).toBe(500);
    expect(down.json()).toEqual({ error: { code: 'internal_error', message: 'Server error' } });
    const ready = await app.inject({ method: 'GET', url: '/readyz' });
    expect(ready.statusCode).toBe(503);
    expect(ready.json().error.code).toBe('service_unavailable');
    await app.close();
  });
});

describe.each(testDrivers)('tenant isolation on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));

  it('hides every task and routing config of one workspace from another', async () => {
    const owner = await api.newTenant();
    const stranger = await api.newTenant();
    const { task } = (await owner.request('POST', '/api/v1/tasks', { command: 'Private work' })).json();
    await owner.request('PUT', '/api/v1/routing-configs/secret', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low' });
    const before = (await owner.request('GET', `/api/v1/tasks/${task.id}`)).json();

    for (const key of [task.id, task.slug]) {
      const attempts: Array<[string, string, unknown?]> = [
        ['GET', `/api/v1/tasks/${key}`],
        ['GET', `/api/v1/tasks/${key}/jobs`],
        ['POST', `/api/v1/tasks/${key}/messages`, { message: 'hijack' }],
        ['POST', `/api/v1/tasks/${key}/approve-plan`],
        ['POST', `/api/v1/tasks/${key}/cancel`],
        ['POST', `/api/v1/tasks/${key}/archive`],
      ];
      for (const [method, url, body] of attempts) {
        const response = await stranger.request(method as 'GET', url, body);
        expect(response.statusCode, `${method} ${url}`).toBe(404);
        expect(response.json()).toEqual({ error: { code: 'not_found', message: 'Task not found' } });
      }
    }
    expect((await stranger.request('GET', '/api/v1/tasks?archived=include&limit=100')).json().tasks).toEqual([]);
    const configs = (await stranger.request('GET', '/api/v1/routing-configs')).json().routingConfigs;
    expect(configs.map((config: { name: string }) => config.name)).toEqual(['default']);
    expect((await stranger.request('DELETE', '/api/v1/routing-configs/secret')).statusCode).toBe(404);

    // A trigger of another workspace selects nothing here.
    const created = (await stranger.request('POST', '/api/v1/tasks', { command: '/secret hello' })).json();
    expect(created.job.input).toBe('/secret hello');
    expect(created.task.mode).toBe('agent');

    const after = (await owner.request('GET', `/api/v1/tasks/${task.id}`)).json();
    expect(after).toEqual(before);
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs).toHaveLength(1);
    expect((await owner.request('GET', '/api/v1/routing-configs')).json().routingConfigs.map((c: { name: string }) => c.name)).toEqual(['default', 'secret']);
  });
});

describe.each(testDrivers)('routing configs on %s', (driver) => {
  let t: Tenant;
  useTestApi(driver, (ready) => ({ tenant: t } = ready));

  it('starts with an undeletable default of agent mode and medium effort', async () => {
    const { routingConfigs } = (await t.request('GET', '/api/v1/routing-configs')).json();
    expect(routingConfigs).toEqual([
      expect.objectContaining({ name: 'default', trigger: null, mode: 'agent', effort: 'medium', instructions: null }),
    ]);
    const deleted = await t.request('DELETE', '/api/v1/routing-configs/default');
    expect(deleted.statusCode).toBe(409);
    expect(deleted.json().error.code).toBe('conflict');
  });

  it('creates, replaces and deletes a trigger config', async () => {
    const created = await t.request('PUT', '/api/v1/routing-configs/fix', { mode: 'goal', agent: 'codex/gpt-5-codex', effort: 'xhigh', instructions: 'Run tests.' });
    expect(created.statusCode).toBe(200);
    expect(created.json().routingConfig).toMatchObject({ name: 'fix', trigger: '/fix', mode: 'goal', agent: 'codex/gpt-5-codex', effort: 'xhigh', instructions: 'Run tests.' });
    const replaced = await t.request('PUT', '/api/v1/routing-configs/fix', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low' });
    expect(replaced.json().routingConfig).toMatchObject({ mode: 'ask', instructions: null });
    const edited = await t.request('PUT', '/api/v1/routing-configs/default', { mode: 'plan', agent: 'openai/gpt-5', effort: 'high' });
    expect(edited.statusCode).toBe(200);
    const task = (await t.request('POST', '/api/v1/tasks', { command: 'uses default' })).json();
    expect(task.task).toMatchObject({ mode: 'plan', agent: 'openai/gpt-5', effort: 'high' });
    expect((await t.request('DELETE', '/api/v1/routing-configs/fix')).statusCode).toBe(204);
    expect((await t.request('DELETE', '/api/v1/routing-configs/fix')).statusCode).toBe(404);
  });

  it.each([
    ['Bad Name', { mode: 'agent', agent: 'openai/gpt-5', effort: 'low' }, 'name'],
    ['-dash', { mode: 'agent', agent: 'openai/gpt-5', effort: 'low' }, 'name'],
    ['ok', { mode: 'agent', agent: 'openai', effort: 'low' }, 'agent'],
    ['ok', { mode: 'dev_env', agent: 'openai/gpt-5', effort: 'low' }, 'mode'],
    ['ok', { mode: 'agent', agent: 'openai/gpt-5', effort: 'ultracode' }, 'effort'],
    ['ok', { mode: 'agent', agent: 'openai/gpt-5' }, 'effort'],
  ])('refuses config %s %j naming %s', async (name, body, field) => {
    const response = await t.request('PUT', `/api/v1/routing-configs/${encodeURIComponent(name)}`, body);
    expect(response.statusCode).toBe(400);
    expect(response.json().error.details.issues.map((issue: { field: string }) => issue.field)).toContain(field);
  });
});
