import { eq } from 'drizzle-orm';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { finishJob, StaleGenerationError } from '../src/engine/jobs.js';
import { claimNextJob, failExpiredLeases, JOBS_CHANNEL, LEASE_EXPIRED_ERROR, renewLease } from '../src/engine/queue.js';
import { jobs } from '../src/store/schema.js';
import { startTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

describe.each(testDrivers)('the job queue on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  const db = () => api.db.database.db;
  const claim = (leaseMs = 60_000) => claimNextJob(db(), { owner: 'test-executor', leaseMs });

  beforeEach(async () => {
    api = await startTestApi(driver);
    tenant = await api.newTenant();
  });
  afterEach(async () => {
    await api?.close();
  });

  async function newTask(command = 'queued work') {
    const { task, job } = (await tenant.request('POST', '/api/v1/tasks', { command })).json();
    return { taskId: task.id as string, jobId: job.id as string };
  }

  it('claims the oldest runnable job under a new generation and a lease, one job per task at a time', async () => {
    const first = await newTask('first');
    const second = await newTask('second');
    const followUp = (await tenant.request('POST', `/api/v1/tasks/${first.taskId}/messages`, { message: 'then this' })).json().job;

    const a = await claim();
    expect(a).toMatchObject({ id: first.jobId, status: 'IN_PROGRESS', generation: 1, leaseOwner: 'test-executor' });
    expect(a!.leaseExpiresAt!.getTime()).toBeGreaterThan(Date.now());
    expect((await tenant.request('GET', `/api/v1/tasks/${first.taskId}`)).json().task.status).toBe('IN_PROGRESS');
    // The follow-up waits behind the running job of its task; the other task's job goes first.
    expect((await claim())?.id).toBe(second.jobId);
    expect(await claim()).toBeNull();

    await finishJob(db(), a!.id, a!.generation, { status: 'COMPLETED', finalAnswer: 'done' });
    expect((await tenant.request('GET', `/api/v1/tasks/${first.taskId}`)).json().task.status).toBe('PENDING');
    expect((await claim())?.id).toBe(followUp.id);
    expect(await claim()).toBeNull();
  });

  it('never claims a job twice or two jobs of one task at once under concurrent executors', async () => {
    const taskJobs = new Map<string, string[]>();
    for (let i = 0; i < 8; i++) {
      const { taskId, jobId } = await newTask(`task ${i}`);
      const next = (await tenant.request('POST', `/api/v1/tasks/${taskId}/messages`, { message: 'again' })).json().job.id;
      taskJobs.set(taskId, [jobId, next]);
    }
    const claimed: Array<{ taskId: string; jobId: string }> = [];
    const running = new Set<string>();
    let overlap = false;
    const executor = async () => {
      for (let idle = 0; idle < 3; ) {
        const job = await claim();
        if (!job) {
          idle++;
          await new Promise((resolve) => setTimeout(resolve, 5));
          continue;
        }
        if (running.has(job.taskId)) overlap = true;
        running.add(job.taskId);
        claimed.push({ taskId: job.taskId, jobId: job.id });
        await new Promise((resolve) => setTimeout(resolve, 1));
        running.delete(job.taskId);
        await finishJob(db(), job.id, job.generation, { status: 'COMPLETED' });
      }
    };
    await Promise.all([executor(), executor(), executor(), executor()]);
    expect(overlap).toBe(false);
    expect(claimed.map((entry) => entry.jobId).sort()).toEqual([...taskJobs.values()].flat().sort());
    for (const [taskId, ids] of taskJobs) {
      expect(claimed.filter((entry) => entry.taskId === taskId).map((entry) => entry.jobId)).toEqual(ids);
    }
  });

  it('fails a job whose lease expired and refuses its executor afterwards', async () => {
    const { taskId } = await newTask();
    const held = await newTask('held');
    const lost = await claim(1);
    const kept = await claim(60_000);
    expect(kept?.id).toBe(held.jobId);
    await new Promise((resolve) => setTimeout(resolve, 50));

    const failed = await failExpiredLeases(db());
    expect(failed.map((job) => job.id)).toEqual([lost!.id]);
    const [row] = await db().select().from(jobs).where(eq(jobs.id, lost!.id));
    expect(row).toMatchObject({ status: 'FAILED', error: LEASE_EXPIRED_ERROR });
    expect((await tenant.request('GET', `/api/v1/tasks/${taskId}`)).json().task.status).toBe('FAILED');

    expect(await renewLease(db(), lost!.id, lost!.generation, 60_000)).toBe(false);
    await expect(finishJob(db(), lost!.id, lost!.generation, { status: 'COMPLETED' })).rejects.toBeInstanceOf(StaleGenerationError);
    expect(await renewLease(db(), kept!.id, kept!.generation, 60_000)).toBe(true);
    expect(await renewLease(db(), kept!.id, kept!.generation - 1, 60_000)).toBe(false);
    expect(await failExpiredLeases(db())).toEqual([]);
  });

  it('wakes listeners when a job is queued', async () => {
    const received: string[] = [];
    const stop = await api.db.database.listen(JOBS_CHANNEL, (payload) => received.push(payload));
    try {
      const { jobId } = await newTask('wake up');
      // Channels are database-wide: other test files' jobs may be heard as well; ours must be among them.
      for (let waited = 0; !received.includes(jobId) && waited < 10_000; waited += 20) await new Promise((resolve) => setTimeout(resolve, 20));
      expect(received).toContain(jobId);
    } finally {
      await stop();
    }
  });
});
