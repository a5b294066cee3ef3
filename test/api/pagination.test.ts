/**
 * Keyset pagination on both databases: GET /tasks (newest first) and GET /tasks/{id}/jobs (newest page
 * first, chronological within a page), opaque cursors that only their own listing takes, and limits.
 */
import { describe, expect, it } from 'vitest';
import { useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const TASKS = '/api/v1/tasks';

interface Page {
  ids: string[];
  nextCursor: string | null;
}

async function page(tenant: Tenant, path: string, key: 'tasks' | 'jobs', query: { limit?: number; cursor?: string | null } = {}): Promise<Page> {
  const params = new URLSearchParams();
  if (query.limit !== undefined) params.set('limit', String(query.limit));
  if (query.cursor) params.set('cursor', query.cursor);
  const url = params.size > 0 ? `${path}${path.includes('?') ? '&' : '?'}${params}` : path;
  const response = await tenant.request('GET', url);
  expect(response.statusCode, `${url}: ${response.body}`).toBe(200);
  const body = response.json();
  expect(Object.keys(body).sort()).toEqual([key, 'nextCursor'].sort());
  return { ids: body[key].map((item: { id: string }) => item.id), nextCursor: body.nextCursor };
}

/** Follows nextCursor to the end (at most 200 pages); returns the pages' ids. */
async function walk(tenant: Tenant, path: string, key: 'tasks' | 'jobs', limit: number): Promise<string[][]> {
  const pages: string[][] = [];
  let cursor: string | null = null;
  do {
    const next: Page = await page(tenant, path, key, { limit, cursor });
    expect(next.ids.length).toBeLessThanOrEqual(limit);
    pages.push(next.ids);
    cursor = next.nextCursor;
  } while (cursor !== null && pages.length < 200);
  expect(cursor).toBeNull();
  return pages;
}

async function createTasks(tenant: Tenant, count: number, label = 'Task'): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < count; i++) {
    const response = await tenant.request('POST', TASKS, { command: `${label} ${i}` });
    expect(response.statusCode, response.body).toBe(201);
    ids.push(response.json().task.id);
  }
  return ids;
}

describe.each(testDrivers)('pagination on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));

  it('lists tasks newest first, 30 by default, and walks every task exactly once', async () => {
    const tenant = await api.newTenant();
    const created = await createTasks(tenant, 35);
    const newestFirst = [...created].reverse();

    const first = await page(tenant, TASKS, 'tasks');
    expect(first.ids).toEqual(newestFirst.slice(0, 30));
    expect(first.nextCursor).toEqual(expect.any(String));
    const rest = await page(tenant, TASKS, 'tasks', { cursor: first.nextCursor });
    expect(rest).toEqual({ ids: newestFirst.slice(30), nextCursor: null });

    for (const limit of [1, 8, 35, 100]) {
      const pages = await walk(tenant, TASKS, 'tasks', limit);
      expect(pages.flat(), `limit ${limit}`).toEqual(newestFirst);
      expect(pages.slice(0, -1).every((ids) => ids.length === limit)).toBe(true);
    }
    // A page that ends exactly at the last task says so (no empty page after it).
    expect(await walk(tenant, TASKS, 'tasks', 7)).toHaveLength(5);
  });

  it('takes limit 100 and no more', async () => {
    const tenant = await api.newTenant();
    const created = await createTasks(tenant, 101);
    const full = await page(tenant, TASKS, 'tasks', { limit: 100 });
    expect(full.ids).toEqual([...created].reverse().slice(0, 100));
    expect(await page(tenant, TASKS, 'tasks', { limit: 100, cursor: full.nextCursor })).toEqual({ ids: [created[0]], nextCursor: null });
  });

  it('has no duplicates and no gaps while tasks are inserted during the walk', async () => {
    const tenant = await api.newTenant();
    const existing = await createTasks(tenant, 40, 'Old');
    let walking = true;
    const inserted: string[] = [];
    // The writer keeps inserting for as long as the walk lasts (bounded), concurrently with it.
    const writer = (async () => {
      for (let i = 0; walking && i < 200; i++) {
        const response = await tenant.request('POST', TASKS, { command: `New ${i}` });
        inserted.push(response.json().task.id);
      }
    })();
    const seen: string[] = [];
    try {
      let cursor: string | null = null;
      do {
        await new Promise((resolve) => setImmediate(resolve));
        const next: Page = await page(tenant, TASKS, 'tasks', { limit: 3, cursor });
        seen.push(...next.ids);
        cursor = next.nextCursor;
      } while (cursor !== null && seen.length < 1000);
    } finally {
      walking = false;
      await writer;
    }
    expect(inserted.length).toBeGreaterThan(0);
    expect(new Set(seen).size).toBe(seen.length);
    // Every task that existed before the walk, once, in order; new ones only ever in front of them.
    const seenOld = seen.filter((id) => existing.includes(id));
    expect(seenOld).toEqual([...existing].reverse());
    const firstOld = seen.indexOf(existing[existing.length - 1]!);
    expect(seen.slice(firstOld)).toEqual([...existing].reverse());
    expect(seen.slice(0, firstOld).every((id) => inserted.includes(id))).toBe(true);
    // And after the walk, a fresh one finds everything once.
    const all = (await walk(tenant, TASKS, 'tasks', 50)).flat();
    expect(all).toEqual([...existing, ...inserted].reverse());
  });

  it('pages jobs: newest page first, chronological within a page, null cursor at the end', async () => {
    const tenant = await api.newTenant();
    const created = await tenant.request('POST', TASKS, { command: 'Many jobs' });
    const { task, job } = created.json();
    const ids: string[] = [job.id];
    for (let i = 0; i < 6; i++) {
      const response = await tenant.request('POST', `${TASKS}/${task.id}/messages`, { message: `Follow-up ${i}` });
      expect(response.statusCode, response.body).toBe(201);
      ids.push(response.json().job.id);
    }
    const path = `${TASKS}/${task.id}/jobs`;

    const first = await page(tenant, path, 'jobs', { limit: 3 });
    expect(first.ids).toEqual(ids.slice(4, 7));
    expect(await walk(tenant, path, 'jobs', 3)).toEqual([ids.slice(4, 7), ids.slice(1, 4), ids.slice(0, 1)]);
    expect(await walk(tenant, path, 'jobs', 7)).toEqual([ids]);
    expect(await walk(tenant, path, 'jobs', 1)).toEqual([...ids].reverse().map((id) => [id]));
    expect(await page(tenant, path, 'jobs')).toEqual({ ids, nextCursor: null });
    // By slug as by id.
    expect(await page(tenant, `${TASKS}/${task.slug}/jobs`, 'jobs', { limit: 3 })).toEqual(first);
  });

  it('refuses cursors of another listing, garbage cursors and bad limits', async () => {
    const tenant = await api.newTenant();
    const [taskId] = await createTasks(tenant, 2);
    for (let i = 0; i < 2; i++) await tenant.request('POST', `${TASKS}/${taskId}/messages`, { message: `m${i}` });
    const taskCursor = (await page(tenant, TASKS, 'tasks', { limit: 1 })).nextCursor;
    const jobCursor = (await page(tenant, `${TASKS}/${taskId}/jobs`, 'jobs', { limit: 1 })).nextCursor;
    expect(taskCursor).toEqual(expect.any(String));
    expect(jobCursor).toEqual(expect.any(String));

    const forged = (value: unknown) => Buffer.from(JSON.stringify(value)).toString('base64url');
    const badCursors = [jobCursor!, 'not-a-cursor', '%7B%7D', forged({ k: 'tasks', s: -4 }), forged({ k: 'tasks', s: 1.5 }), forged({ k: 'tasks' }), forged([1])];
    const refusals: Array<[url: string, field: string]> = [
      ...badCursors.map((cursor): [string, string] => [`${TASKS}?cursor=${encodeURIComponent(cursor)}`, 'cursor']),
      [`${TASKS}/${taskId}/jobs?cursor=${encodeURIComponent(taskCursor!)}`, 'cursor'],
      [`${TASKS}/${taskId}/jobs?cursor=garbage`, 'cursor'],
    ];
    for (const path of [TASKS, `${TASKS}/${taskId}/jobs`]) {
      for (const limit of ['0', '101', 'abc', '-1', '1.5', '']) refusals.push([`${path}?limit=${limit}`, 'limit']);
    }
    for (const [url, field] of refusals) {
      const response = await tenant.request('GET', url);
      expect(response.statusCode, url).toBe(400);
      const { error } = response.json();
      expect(error.code, url).toBe('validation_error');
      expect(error.details.issues.map((issue: { field: string }) => issue.field), url).toContain(field);
    }
  });
});
