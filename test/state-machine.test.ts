/** Every move the state machines do not allow is refused by the store's conditional updates. */
import { eq } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { JOB_TRANSITIONS, jobStatesInto, TASK_TRANSITIONS, taskStatesInto } from '../src/domain/states.js';
import { finishJob, StaleGenerationError, startJob } from '../src/engine/jobs.js';
import { JobStatus, TaskStatus } from '../src/protocol/rest.js';
import { jobs, tasks } from '../src/store/schema.js';
import { updateJob, updateTask } from '../src/store/tasks.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

describe.each(testDrivers)('state machines in the store on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  const db = () => api.db.database.db;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  async function newTask() {
    const { task, job } = (await tenant.request('POST', '/api/v1/tasks', { command: 'state' })).json();
    return { taskId: task.id as string, jobId: job.id as string };
  }

  it('refuses every job move not in the table, and performs every move in it', async () => {
    for (const from of JobStatus.options) {
      for (const to of JobStatus.options) {
        const { jobId } = await newTask();
        await db().update(jobs).set({ status: from }).where(eq(jobs.id, jobId));
        const moved = await updateJob(db(), jobId, { status: to }, jobStatesInto(to));
        const [row] = await db().select().from(jobs).where(eq(jobs.id, jobId));
        if (JOB_TRANSITIONS[from].includes(to)) {
          expect(moved?.status, `${from} > ${to}`).toBe(to);
        } else {
          expect(moved, `${from} > ${to}`).toBeNull();
          expect(row?.status).toBe(from);
        }
      }
    }
  });

  it('refuses every task move not in the table', async () => {
    for (const from of TaskStatus.options) {
      for (const to of TaskStatus.options) {
        const { taskId } = await newTask();
        await db().update(tasks).set({ status: from }).where(eq(tasks.id, taskId));
        const moved = await updateTask(db(), taskId, { status: to }, taskStatesInto(to));
        expect(moved?.status ?? null, `${from} > ${to}`).toBe(TASK_TRANSITIONS[from].includes(to) ? to : null);
      }
    }
  });

  it('starts only pending jobs and refuses reports from a stale generation or after the end', async () => {
    const { jobId } = await newTask();
    const started = await startJob(db(), jobId);
    expect(started).toMatchObject({ status: 'IN_PROGRESS', generation: 1 });
    expect(await startJob(db(), jobId)).toBeNull();
    await expect(finishJob(db(), jobId, 0, { status: 'COMPLETED' })).rejects.toBeInstanceOf(StaleGenerationError);
    const finished = await finishJob(db(), jobId, 1, { status: 'COMPLETED', finalAnswer: 'ok' });
    expect(finished.status).toBe('COMPLETED');
    await expect(finishJob(db(), jobId, 1, { status: 'FAILED' })).rejects.toBeInstanceOf(StaleGenerationError);
    expect(await startJob(db(), jobId)).toBeNull();

    // A job cancelled while running cannot be completed by its executor afterwards.
    const other = await newTask();
    const running = await startJob(db(), other.jobId);
    await tenant.request('POST', `/api/v1/tasks/${other.taskId}/cancel`);
    await expect(finishJob(db(), other.jobId, running!.generation, { status: 'COMPLETED' })).rejects.toBeInstanceOf(StaleGenerationError);
    const task = (await tenant.request('GET', `/api/v1/tasks/${other.taskId}`)).json();
    expect(task.task.status).toBe('CANCELLED');
    expect(task.latestJob.status).toBe('CANCELLED');
  });
});
