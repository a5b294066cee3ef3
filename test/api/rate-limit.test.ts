/**
 * The per-key sliding-window rate limit on both databases: 100 requests in any minute and 1,000 in any
 * hour (configurable), counted in the database, refused with 429 `rate_limited` and `Retry-After`.
 * Time is simulated by writing old buckets straight into `rate_limit_buckets`, never by sleeping.
 */
import { sql } from 'drizzle-orm';
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import type { LightMyRequestResponse } from 'fastify';
import { createApiKey, revokeApiKey } from '../../src/store/api-keys.js';
import { queryRows } from '../../src/store/db.js';
import { pruneRateLimitBuckets, TALLY_SECOND } from '../../src/store/rate-limit.js';
import { rateLimitBuckets } from '../../src/store/schema.js';
import { useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { postgresUrl, testDrivers } from '../support/db.js';

const TASKS = '/api/v1/tasks';
const MINUTE_MESSAGE = 'Rate limit exceeded. Max 100 requests per minute.';

/** A 429 in the error envelope whose Retry-After is a whole number of seconds within [min, max]. */
function expectRefused(response: LightMyRequestResponse, message: string, min: number, max: number): number {
  expect(response.statusCode, response.body).toBe(429);
  const { error } = response.json();
  expect(error).toMatchObject({ code: 'rate_limited', message });
  const header = response.headers['retry-after'];
  expect(header).toMatch(/^\d+$/);
  const retryAfter = Number(header);
  expect(retryAfter).toBeGreaterThanOrEqual(min);
  expect(retryAfter).toBeLessThanOrEqual(max);
  expect(error.details).toMatchObject({ retryAfterSeconds: retryAfter });
  return retryAfter;
}

/** Helpers over the test database of one API. */
function store(api: () => TestApi) {
  const db = () => api().db.database.db;
  return {
    /** The database's clock, in whole seconds: the clock the buckets are keyed by. */
    async now(): Promise<number> {
      const [row] = await queryRows<{ s: string }>(db(), sql`select floor(extract(epoch from clock_timestamp()))::bigint::text as s`);
      return Number(row!.s);
    },
    async keyIdOf(tenant: Tenant): Promise<string> {
      const [row] = await queryRows<{ id: string }>(db(), sql`select id from api_keys where workspace_id = ${tenant.workspace.id} and name = 'test'`);
      return row!.id;
    },
    /** Requests counted for a key in its real (per-second) buckets. */
    async counted(keyId: string): Promise<number> {
      const [row] = await queryRows<{ n: number }>(
        db(),
        sql`select coalesce(sum(count), 0)::int as n from rate_limit_buckets where key_id = ${keyId} and second >= 0`,
      );
      return row!.n;
    },
    async addBuckets(keyId: string, buckets: Array<[second: number, count: number]>): Promise<void> {
      await db().insert(rateLimitBuckets).values(buckets.map(([second, count]) => ({ keyId, second, count })));
    },
  };
}

describe.each(testDrivers)('rate limit per minute on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready), { rateLimits: { perMinute: 100, perHour: 1000 } });
  const { now, keyIdOf, counted, addBuckets } = store(() => api);

  it('lets requests 1-100 through and refuses request 101 with Retry-After; other keys are not limited', async () => {
    const tenant = await api.newTenant();
    const secondKey = await createApiKey(api.db.database.db, { workspaceId: tenant.workspace.id, name: 'second' });
    for (let i = 1; i <= 100; i++) {
      const response = await tenant.request('GET', TASKS);
      expect(response.statusCode, `request ${i}`).toBe(200);
    }
    expectRefused(await tenant.request('GET', TASKS), MINUTE_MESSAGE, 1, 61);
    // Any route behind the key is refused, not just the one that filled the window.
    expectRefused(await tenant.request('POST', TASKS, { command: 'Too many' }), MINUTE_MESSAGE, 1, 61);

    // A second key of the same workspace, and another workspace's key, have windows of their own.
    const sameWorkspace = await api.app.inject({ method: 'GET', url: TASKS, headers: { authorization: `Bearer ${secondKey.key}` } });
    expect(sameWorkspace.statusCode).toBe(200);
    const otherTenant = await api.newTenant();
    expect((await otherTenant.request('GET', TASKS)).statusCode).toBe(200);
    expect(await counted(await keyIdOf(tenant))).toBe(100);
  });

  it('lets exactly the limit through a concurrent burst', async () => {
    const tenant = await api.newTenant();
    const burst = await Promise.all(Array.from({ length: 150 }, () => tenant.request('GET', TASKS)));
    const codes = burst.map((response) => response.statusCode);
    expect(codes.filter((code) => code === 200)).toHaveLength(100);
    expect(codes.filter((code) => code === 429)).toHaveLength(50);
    expect(await counted(await keyIdOf(tenant))).toBe(100);
  });

  it('counts neither refused requests nor requests with a bad key', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    await addBuckets(keyId, [[s - 20, 99]]);
    expect((await tenant.request('GET', TASKS)).statusCode).toBe(200);
    for (let i = 0; i < 5; i++) expect((await tenant.request('GET', TASKS)).statusCode).toBe(429);
    expect(await counted(keyId)).toBe(100);

    // Wrong, malformed, revoked and expired keys are 401 and leave no trace in the buckets.
    const wrong = `${tenant.key.slice(0, -1)}${tenant.key.endsWith('A') ? 'B' : 'A'}`;
    const revoked = await createApiKey(api.db.database.db, { workspaceId: tenant.workspace.id, name: 'revoked' });
    await revokeApiKey(api.db.database.db, tenant.workspace.id, revoked.record.id);
    const expired = await createApiKey(api.db.database.db, { workspaceId: tenant.workspace.id, name: 'expired', expiresAt: new Date(Date.now() - 1000) });
    for (const authorization of [`Bearer ${wrong}`, 'Bearer service_short', `Basic ${tenant.key}`, `Bearer ${revoked.key}`, `Bearer ${expired.key}`]) {
      const response = await api.app.inject({ method: 'GET', url: TASKS, headers: { authorization } });
      expect(response.statusCode, authorization).toBe(401);
      expect(response.json().error).toMatchObject({ code: 'unauthorized', message: 'Invalid or missing API key' });
    }
    expect(await counted(keyId)).toBe(100);
    expect(await counted(revoked.record.id)).toBe(0);
    expect(await counted(expired.record.id)).toBe(0);
  });

  it('lets requests through again once the counted ones have slid out of the window', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    // 100 requests 61 seconds ago: outside the minute window (it counts the last 61 seconds), inside the hour.
    await addBuckets(keyId, [[s - 61, 100]]);
    expect((await tenant.request('GET', TASKS)).statusCode).toBe(200);
    // 99 more 30 seconds ago: with the one just made, the minute is full.
    await addBuckets(keyId, [[s - 30, 99]]);
    // The bucket of 30 s ago leaves the window at s + 31 (a second later if the clock turned meanwhile).
    expectRefused(await tenant.request('GET', TASKS), MINUTE_MESSAGE, 29, 32);

    // Once a refusal's oldest buckets are old enough, the same key goes on.
    const other = await api.newTenant();
    const otherKey = await keyIdOf(other);
    await addBuckets(otherKey, [[s - 59, 100]]);
    expectRefused(await other.request('GET', TASKS), MINUTE_MESSAGE, 1, 3);
    await api.db.database.db.execute(sql`update rate_limit_buckets set second = second - 3 where key_id = ${otherKey} and second >= 0`);
    expect((await other.request('GET', TASKS)).statusCode).toBe(200);
  });

  it('uses the hourly wording and wait when the hour is full', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    await addBuckets(keyId, [
      [s - 3000, 600],
      [s - 1000, 400],
    ]);
    // The bucket of 3000 s ago leaves the hour (3601 s) at s + 601.
    expectRefused(await tenant.request('GET', TASKS), 'Rate limit exceeded. Max 1000 requests per hour.', 599, 602);
    // Just over the hour ago: no longer counted.
    const other = await api.newTenant();
    await addBuckets(await keyIdOf(other), [[s - 3602, 1000]]);
    expect((await other.request('GET', TASKS)).statusCode).toBe(200);
  });

  it('keeps lastUsedAt', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const lastUsed = async () =>
      (await queryRows<{ last_used_at: unknown }>(api.db.database.db, sql`select last_used_at from api_keys where id = ${keyId}`))[0]!.last_used_at;
    expect(await lastUsed()).toBeNull();
    await tenant.request('GET', TASKS);
    expect(await lastUsed()).not.toBeNull();
  });

  it('prunes buckets older than an hour and keeps the per-key tally', async () => {
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    await tenant.request('GET', TASKS);
    const s = await now();
    await addBuckets(keyId, [
      [s - 7200, 5],
      [s - 3661, 4],
      [s - 3000, 2],
      [s - 10, 3],
    ]);
    await pruneRateLimitBuckets(api.db.database.db);
    const rows = await queryRows<{ second: string }>(
      api.db.database.db,
      sql`select second::text from rate_limit_buckets where key_id = ${keyId} order by second`,
    );
    const seconds = rows.map((row) => Number(row.second));
    expect(seconds).toContain(TALLY_SECOND);
    expect(seconds.filter((second) => second >= 0 && second < s - 3600)).toEqual([]);
    expect(seconds).toEqual(expect.arrayContaining([s - 3000, s - 10]));
    // The limit still counts what is left: 2 + 3 + the request above (+ this one) of 1000.
    expect((await tenant.request('GET', TASKS)).statusCode).toBe(200);
  });

  it.runIf(driver === 'postgres')('counts a request of an earlier second that commits while a later one runs', async () => {
    // The race of a burst across a second boundary, made deterministic: an "in-flight" request (an open
    // transaction that counted one request a second ago) and a new request whose snapshot cannot see it.
    const tenant = await api.newTenant();
    const keyId = await keyIdOf(tenant);
    const s = await now();
    await addBuckets(keyId, [[s - 10, 99]]);
    const inFlight = new pg.Client({ connectionString: postgresUrl(), options: `-c search_path=${api.db.schema}` });
    await inFlight.connect();
    try {
      const [{ pid }] = (await inFlight.query<{ pid: number }>('select pg_backend_pid() as pid')).rows as [{ pid: number }];
      await inFlight.query('begin');
      for (const second of [TALLY_SECOND, s - 1]) {
        await inFlight.query(
          `insert into rate_limit_buckets as r (key_id, second, count) values ($1, $2, 1)
           on conflict (key_id, second) do update set count = r.count + 1`,
          [keyId, second],
        );
      }
      const pending = tenant.request('GET', TASKS);
      // The new request must wait for the in-flight one rather than count without it.
      const observer = new pg.Client({ connectionString: postgresUrl() });
      await observer.connect();
      try {
        let waiting = 0;
        for (let i = 0; i < 200 && waiting === 0; i++) {
          await new Promise((resolve) => setTimeout(resolve, 25));
          const { rows } = await observer.query<{ n: number }>(
            'select count(*)::int as n from pg_stat_activity where $1 = any(pg_blocking_pids(pid))',
            [pid],
          );
          waiting = rows[0]!.n;
        }
        expect(waiting, 'the new request waits for the in-flight one').toBe(1);
      } finally {
        await observer.end();
      }
      await inFlight.query('commit');
      expectRefused(await pending, MINUTE_MESSAGE, 1, 61);
      expect(await counted(keyId)).toBe(100);
    } finally {
      await inFlight.end();
    }
  });
});

describe.each(testDrivers)('rate limit per hour on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready), { rateLimits: { perMinute: 1000, perHour: 20 } });
  const { now, keyIdOf, addBuckets } = store(() => api);

  it('refuses request 21 of the hour in the hourly wording', async () => {
    const tenant = await api.newTenant();
    for (let i = 1; i <= 20; i++) expect((await tenant.request('GET', TASKS)).statusCode, `request ${i}`).toBe(200);
    // Everything was counted within the last seconds: they leave the hour in about 3601 s.
    expectRefused(await tenant.request('GET', TASKS), 'Rate limit exceeded. Max 20 requests per hour.', 3590, 3601);
    const other = await api.newTenant();
    expect((await other.request('GET', TASKS)).statusCode).toBe(200);
  });

  it('counts requests spread over the hour', async () => {
    const tenant = await api.newTenant();
    const s = await now();
    await addBuckets(await keyIdOf(tenant), [
      [s - 3500, 5],
      [s - 1800, 5],
      [s - 600, 5],
      [s - 5, 4],
    ]);
    expect((await tenant.request('GET', TASKS)).statusCode).toBe(200);
    // The oldest bucket has to go before one more fits: it leaves at s - 3500 + 3601.
    expectRefused(await tenant.request('GET', TASKS), 'Rate limit exceeded. Max 20 requests per hour.', 99, 102);
  });
});
