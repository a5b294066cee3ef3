import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startTestApi, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

describe.each(testDrivers)('API smoke on %s', (driver) => {
  let api: TestApi;
  beforeAll(async () => {
    api = await startTestApi(driver);
  });
  afterAll(async () => {
    await api?.close();
  });

  it('creates a task and reads it back by id and by slug', async () => {
    const tenant = await api.newTenant();
    const created = await tenant.request('POST', '/api/v1/tasks', { command: 'Fix the login bug' });
    expect(created.statusCode).toBe(201);
    const { task, job } = created.json();
    expect(task.status).toBe('PENDING');
    expect(job.status).toBe('PENDING');
    for (const id of [task.id, task.slug]) {
      const got = await tenant.request('GET', `/api/v1/tasks/${id}`);
      expect(got.statusCode).toBe(200);
      expect(got.json().task.id).toBe(task.id);
      expect(got.json().latestJob.id).toBe(job.id);
    }
  });
});
