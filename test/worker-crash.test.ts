/**
 * A `svc worker` killed with SIGKILL in the middle of a job, on PostgreSQL (the scaled deployment): its
 * lease expires, another worker fails the job with a clear error, the sandboxed command died with it, a
 * late report from the dead generation is refused, and the journal keeps what it had.
 */
import { execFileSync } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { LEASE_EXPIRED_ERROR } from '../src/engine/queue.js';
import { openDatabase, queryRows } from '../src/store/db.js';
import { appendEvents } from '../src/store/journal.js';
import { sql } from 'drizzle-orm';
import { createTestSchema, dropTestSchema, postgresUrl } from './support/db.js';
import { startFakeModel } from './support/fake-model.js';
import { bootstrapKeyOf, eventually, killAll, startSvcServer, startSvcWorker, urlWithSchema } from './support/processes.js';

afterEach(() => killAll());

const sleeping = (marker: string): boolean => execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' }).split('\n').some((line) => line.startsWith(`sleep ${marker}`));

describe.skipIf(!process.env.DATABASE_URL)('a worker killed mid-job', () => {
  it('fails the job once its lease expires, refuses the dead generation and keeps the journal', async () => {
    const schema = await createTestSchema();
    const marker = `${Math.floor(Math.random() * 1e6) + 1000}.25`;
    const model = await startFakeModel([{ toolCalls: [{ name: 'run_command', arguments: { command: `sleep ${marker}` } }] }]);
    const database = await openDatabase({ driver: 'postgres', url: postgresUrl(), schema, poolSize: 2 }, { migrate: false });
    try {
      const dataDir = mkdtempSync(join(tmpdir(), 'svc-crash-'));
      const env = {
        DATABASE_URL: urlWithSchema(postgresUrl(), schema),
        SVC_DATA_DIR: dataDir,
        SVC_JOB_LEASE_MS: '2000',
        SVC_EXECUTOR_CONCURRENCY: '1',
        OPENAI_COMPATIBLE_BASE_URL: model.baseUrl,
      };
      const server = await startSvcServer([], { ...env, SVC_EXECUTOR_CONCURRENCY: '0' });
      const key = bootstrapKeyOf(server.stdout())!;
      const worker = await startSvcWorker([], env);
      const created = await fetch(`${server.url}/api/v1/tasks`, {
        method: 'POST',
        headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
        body: JSON.stringify({ command: 'Take your time', agent: 'openai-compatible/fake' }),
      });
      const { task, job } = (await created.json()) as { task: { id: string }; job: { id: string } };
      expect(await eventually(() => sleeping(marker), 60_000)).toBe(true);

      worker.child.kill('SIGKILL');
      // The sandboxed command goes with its worker (bubblewrap dies with its parent).
      expect(await eventually(() => !sleeping(marker), 10_000)).toBe(true);
      const [running] = await queryRows<{ status: string; generation: number }>(database.db, sql`select status, generation from jobs where id = ${job.id}`);
      expect(running).toMatchObject({ status: 'IN_PROGRESS' });
      const journaled = await queryRows<{ kind: string }>(database.db, sql`select kind from job_events where job_id = ${job.id} order by sequence`);
      expect(journaled.map((row) => row.kind)).toContain('tool_call');

      // Another worker finds the expired lease and fails the job, saying why.
      const rescuer = await startSvcWorker([], env);
      let ended: { status: string; error: string | null } | undefined;
      for (let i = 0; i < 300; i++) {
        [ended] = await queryRows<{ status: string; error: string | null }>(database.db, sql`select status, error from jobs where id = ${job.id}`);
        if (ended?.status !== 'IN_PROGRESS') break;
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      expect(ended).toEqual({ status: 'FAILED', error: LEASE_EXPIRED_ERROR });
      const [taskRow] = await queryRows<{ status: string }>(database.db, sql`select status from tasks where id = ${task.id}`);
      expect(taskRow!.status).toBe('FAILED');

      // The dead generation's late report is refused; the journal is as it was.
      const late = await appendEvents(database.db, { jobId: job.id, generation: running!.generation, firstSequence: journaled.length + 1, events: [{ kind: 'final', data: { answer: 'late' } }] });
      expect(late.ok).toBe(false);
      const after = await queryRows<{ kind: string }>(database.db, sql`select kind from job_events where job_id = ${job.id} order by sequence`);
      expect(after).toEqual(journaled);

      expect(await rescuer.stop()).toBe(0);
      expect(await server.stop()).toBe(0);
    } finally {
      await database.close();
      await model.close();
      await dropTestSchema(schema);
    }
  }, 240_000);
});
