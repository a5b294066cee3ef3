import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { createApiKey } from '../../src/store/api-keys.js';
import { queryRows } from '../../src/store/db.js';
import { pruneRateLimitBuckets } from '../../src/store/rate-limit.js';
import { rateLimitBuckets } from '../../src/store/schema.js';
import { useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

describe.each(testDrivers)('rate limits on %s', (driver) => {
  let api: TestApi;
  const db = () => api.db.database.db;
  useTestApi(driver, (ready) => ({ api } = ready), { rateLimits: { perMinute: 100, perHour: 1000 } });

  async function now(): Promise<number> {
    const [row] = await queryRows<{ s: string }>(db(), sql`select floor(extract(epoch from clock_timestamp()))::bigint::text as s`);
    return Number(row!.s);
  }

  async function keyIdOf(tenant: Tenant): Promise<string> {
    const [row] = await queryRows<{ id: string }>(db(), sql`select id from api_keys where workspace_id = ${tenant.workspace.id} limit 1`);
    return row!.id;
  }

  it('refuses request 101 of a minute with 429 and Retry-After; other keys go on', async () => {
    const tenant = await api.newTenant();
    const statuses: number[] = [];
    for (let i = 0; i < 100; i++) statuses.push((await tenant.request('GET', '/api/v1/tasks')).statusCode);
    expect(statuses.every((status) => status === 200)).toBe(true);
    const refused = await tenant.request('GET', '/api/v1/tasks');
    expect(refused.statusCode).toBe(429);
    expect(refused.json().error).toMatchObject({ code: 'rate_limited', message: 'Rate limit exceeded. Max 100 requests per minute.' });
    const retryAfter = Number(refused.headers['retry-after']);
    expect(Number.isInteger(retryAfter)).toBe(true);
    expect(retryAfter).toBeGreaterThanOrEqual(1);
    expect(retryAfter).toBeLessThanOrEqual(61);

    const sameWorkspace = await createApiKey(db(), { workspaceId: tenant.workspace.id, name: 'second' });
    const other = await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `Bearer ${sameWorkspace.key}` } });
    expect(other.statusCode).toBe(200);
    const otherTenant = await api.newTenant();
    expect((await otherTenant.request('GET', '/api/v1/tasks')).statusCode).toBe(200);
  });

  it('lets exactly the limit through a concurrent burst and does not count refusals or bad keys', async () => {
    const tenant = await api.newTenant();
    const burst = await Promise.all(Array.from({ length: 150 }, () => tenant.request('GET', '/api/v1/tasks')));
    const codes = burst.map((response) => response.statusCode);
    expect(codes.filter((code) => code === 200)).toHaveLength(100);
    expect(codes.filter((code) => code === 429)).toHaveLength(50);
    const keyId = await keyIdOf(tenant);
    const [counted] = await queryRows<{ n: number }>(db(), sql`select coalesce(sum(count), 0)::int as n from rate_limit_buckets where key_id = ${keyId} and second >= 0`);
    expect(counted!.n).toBe(100);

    for (let i = 0; i < 5; i++) {
      expect((await tenant.request('GET', '/api/v1/tasks')).statusCode).toBe(429);
      const bad = await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { authorization: `Bearer ${tenant.key.slice(0, -1)}${tenant.key.endsWith('A') ? 'B' : 'A'}` } });
      expect(bad.statusCode).toBe(401);
    }
    const [after] = await queryRows<{ n: number }>(db(), sql`select coalesce(sum(count), 0)::int as n from rate_limit_buckets where key_id = ${keyId} and second >= 0`);
    expect(after!.n).toBe(100);
  });

  it('lets requests through again once the counted buckets are older than the window', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    // 100 requests 61 seconds ago: outside the minute window, inside the hour.
    await db().insert(rateLimitBuckets).values({ keyId, second: s - 61, count: 100 });
    expect((await tenant.request('GET', '/api/v1/tasks')).statusCode).toBe(200);
    // 99 more 30 seconds ago: with the one above, the minute is full.
    await db().insert(rateLimitBuckets).values({ keyId, second: s - 30, count: 99 });
    const refused = await tenant.request('GET', '/api/v1/tasks');
    expect(refused.statusCode).toBe(429);
    // The bucket of 30 s ago leaves the window at s + 31; the request of "now" at s + 61.
    const retryAfter = Number(refused.headers['retry-after']);
    expect(retryAfter).toBeGreaterThanOrEqual(29);
    expect(retryAfter).toBeLessThanOrEqual(32);
  });

  it('uses the hourly wording when the hour is full', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    await db().insert(rateLimitBuckets).values([
      { keyId, second: s - 3000, count: 600 },
      { keyId, second: s - 1000, count: 400 },
    ]);
    const refused = await tenant.request('GET', '/api/v1/tasks');
    expect(refused.statusCode).toBe(429);
    expect(refused.json().error.message).toBe('Rate limit exceeded. Max 1000 requests per hour.');
    const retryAfter = Number(refused.headers['retry-after']);
    expect(retryAfter).toBeGreaterThanOrEqual(599);
    expect(retryAfter).toBeLessThanOrEqual(602);
  });

  it('prunes buckets older than an hour', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    await db().insert(rateLimitBuckets).values([
      { keyId, second: s - 7200, count: 5 },
      { keyId, second: s - 10, count: 3 },
    ]);
    await pruneRateLimitBuckets(db());
    const rows = await queryRows<{ second: string }>(db(), sql`select second::text from rate_limit_buckets where key_id = ${keyId}`);
    expect(rows.map((row) => Number(row.second))).toEqual([s - 10]);
  });

  it('keeps lastUsedAt', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const [before] = await queryRows<{ last_used_at: unknown }>(db(), sql`select last_used_at from api_keys where id = ${keyId}`);
    expect(before!.last_used_at).toBeNull();
    await tenant.request('GET', '/api/v1/tasks');
    const [after] = await queryRows<{ last_used_at: unknown }>(db(), sql`select last_used_at from api_keys where id = ${keyId}`);
    expect(after!.last_used_at).not.toBeNull();
  });
});

describe.each(testDrivers)('pagination on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));

  async function walk(tenant: Tenant, path: string, limit: number, key: 'tasks' | 'jobs') {
    const pages: string[][] = [];
    let cursor: string | null = null;
    do {
      const separator = path.includes('?') ? '&' : '?';
      const url = `${path}${separator}limit=${limit}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`;
      const response = await tenant.request('GET', url);
      expect(response.statusCode, response.body).toBe(200);
      const body = response.json();
      expect(body[key].length).toBeLessThanOrEqual(limit);
      pages.push(body[key].map((item: { id: string }) => item.id));
      cursor = body.nextCursor;
    } while (cursor !== null && pages.length < 100);
    return pages;
  }

  it('walks every task exactly once, newest first, with the default limit of 30', async () => {
    const tenant = await api.newTenant();
    const created: string[] = [];
    for (let i = 0; i < 35; i++) created.push((await tenant.request('POST', '/api/v1/tasks', { command: `Task ${i}` })).json().task.id);
    const first = (await tenant.request('GET', '/api/v1/tasks')).json();
    expect(first.tasks).toHaveLength(30);
    expect(first.nextCursor).toEqual(expect.any(String));
    const pages = await walk(tenant, '/api/v1/tasks', 8, 'tasks');
    expect(pages.flat()).toEqual([...created].reverse());
    expect(pages.map((page) => page.length)).toEqual([8, 8, 8, 8, 3]);
  });

  it('has no duplicates and no gaps while tasks are inserted during the walk', async () => {
    const tenant = await api.newTenant();
    const existing: string[] = [];
    for (let i = 0; i < 40; i++) existing.push((await tenant.request('POST', '/api/v1/tasks', { command: `Old ${i}` })).json().task.id);
    let inserting = true;
    const inserted: string[] = [];
    const writer = (async () => {
      for (let i = 0; i < 30 && inserting; i++) {
        inserted.push((await tenant.request('POST', '/api/v1/tasks', { command: `New ${i}` })).json().task.id);
      }
    })();
    const seen: string[] = [];
    let cursor: string | null = null;
    do {
      const response = await tenant.request('GET', `/api/v1/tasks?limit=5${cursor ? `&cursor=${cursor}` : ''}`);
      const body = response.json();
      seen.push(...body.tasks.map((item: { id: string }) => item.id));
      cursor = body.nextCursor;
    } while (cursor);
    inserting = false;
    await writer;
    expect(new Set(seen).size).toBe(seen.length);
    const seenOld = seen.filter((id) => existing.includes(id));
    expect(seenOld).toEqual([...existing].reverse());
    // Anything new that was seen came before every old task (newest first).
    const firstOld = seen.indexOf(seenOld[0]!);
    expect(seen.slice(firstOld).every((id) => existing.includes(id))).toBe(true);
  });

  it('pages jobs newest page first, chronological within a page', async () => {
    const tenant = await api.newTenant();
    const { task, job } = (await tenant.request('POST', '/api/v1/tasks', { command: 'Many jobs' })).json();
    const ids = [job.id];
    for (let i = 0; i < 6; i++) ids.push((await tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: `m${i}` })).json().job.id);
    const pages = await walk(tenant, `/api/v1/tasks/${task.id}/jobs`, 3, 'jobs');
    expect(pages).toEqual([ids.slice(4, 7), ids.slice(1, 4), ids.slice(0, 1)]);
    const all = (await tenant.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json();
    expect(all.jobs.map((item: { id: string }) => item.id)).toEqual(ids);
    expect(all.nextCursor).toBeNull();
  });

  it('refuses cursors of another listing, garbage cursors and bad limits', async () => {
    const tenant = await api.newTenant();
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'a' })).json();
    await tenant.request('POST', '/api/v1/tasks', { command: 'b' });
    for (let i = 0; i < 2; i++) await tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: `m${i}` });
    const taskCursor = (await tenant.request('GET', '/api/v1/tasks?limit=1')).json().nextCursor;
    const jobCursor = (await tenant.request('GET', `/api/v1/tasks/${task.id}/jobs?limit=1`)).json().nextCursor;
    expect(taskCursor).toEqual(expect.any(String));
    expect(jobCursor).toEqual(expect.any(String));
    const refusals = [
      `/api/v1/tasks?cursor=${jobCursor}`,
      `/api/v1/tasks/${task.id}/jobs?cursor=${taskCursor}`,
      '/api/v1/tasks?cursor=not-a-cursor',
      `/api/v1/tasks?cursor=${Buffer.from('{"k":"tasks","s":-4}').toString('base64url')}`,
      `/api/v1/tasks/${task.id}/jobs?limit=0`,
      `/api/v1/tasks/${task.id}/jobs?limit=101`,
      `/api/v1/tasks/${task.id}/jobs?limit=abc`,
    ];
    for (const url of refusals) {
      const response = await tenant.request('GET', url);
      expect(response.statusCode, url).toBe(400);
      expect(response.json().error.code).toBe('validation_error');
    }
    const cursorIssue = (await tenant.request('GET', '/api/v1/tasks?cursor=zzz')).json().error.details.issues[0];
    expect(cursorIssue.field).toBe('cursor');
  });
});
