/**
 * What queueing a job of a local task adds to it: the job is the runner's run (its work version moves and
 * its long polls wake), and a run of the task still executing — a harness waiting on background work —
 * is asked, once, to finish with the answer it holds (`finish_background_wait`), where its harness can.
 */
import { and, eq } from 'drizzle-orm';
import type { Capabilities } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { findRunner, bumpWorkVersion } from '../../store/runners.js';
import { insertControl } from '../../store/runs.js';
import { jobs } from '../../store/schema.js';
import type { JobRow, TaskRow } from '../../store/tasks.js';

/** The task is locked by the caller; `job` was just inserted with the task's runner. */
export async function localJobQueued(tx: Db, task: TaskRow, job: JobRow): Promise<void> {
  if (!task.runnerId) return;
  await bumpWorkVersion(tx, task.runnerId);
  if (job.status !== 'PENDING') return;
  const [executing] = await tx
    .select()
    .from(jobs)
    .where(and(eq(jobs.taskId, task.id), eq(jobs.status, 'IN_PROGRESS'), eq(jobs.runnerState, 'executing')))
    .for('update');
  if (!executing?.agentProvider) return;
  const runner = await findRunner(tx, task.runnerId);
  const controls = (runner?.capabilities as Capabilities | undefined)?.nativeControls?.[executing.agentProvider];
  // Older runners do not know the control: the follow-up simply waits its turn.
  if (controls?.finishBackgroundWait) await insertControl(tx, task.runnerId, executing.id, { type: 'finish_background_wait' });
}
