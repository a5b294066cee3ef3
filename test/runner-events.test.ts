/**
 * Event uploads at their edges, on both databases, through the real routes: characters PostgreSQL cannot
 * store, a batch that fails unexpectedly, numbers past PostgreSQL's `integer`, staged parts and who may
 * touch them, uploads racing the owner's task actions, a cancelled run still held by its runner, and the
 * bounded run list.
 */
import { createHash } from 'node:crypto';
import { eq, sql } from 'drizzle-orm';
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import { ConflictError } from '../src/domain/errors.js';
import { claimRun as claimEngineRun, listRuns } from '../src/engine/runners/runs.js';
import { RUNNER_LIMITS } from '../src/protocol/runner.js';
import { findRunner } from '../src/store/runners.js';
import { eventParts } from '../src/store/schema.js';
import { updateTask } from '../src/store/tasks.js';
import { useTestApi, type TestApi } from './support/api.js';
import { postgresUrl, testDrivers } from './support/db.js';
import { claimRun, localTask, messageEvent, uploadEvents } from './support/local-runs.js';
import { enrolledRunner, signedInUser, type SignedIn, type TestRunner } from './support/runners.js';

const TOO_LARGE = 3_000_000_000;

describe.each(testDrivers)('runner events on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));

  async function setup(): Promise<{ owner: SignedIn; runner: TestRunner }> {
    const owner = await signedInUser(api);
    return { owner, runner: await enrolledRunner(api, owner) };
  }

  const claim = claimRun;
  const events = uploadEvents;
  const message = messageEvent;

  /** The task's journal as its logs stream it. */
  async function journal(owner: SignedIn, taskId: string): Promise<Array<{ kind: string; data: Record<string, unknown> }>> {
    const body = (await owner.request('GET', `/api/v1/tasks/${taskId}/logs`)).body;
    return body
      .split('\n')
      .filter((line) => line.startsWith('data: '))
      .map((line) => JSON.parse(line.slice(6)) as { kind?: string; data?: Record<string, unknown> })
      .flatMap((frame) => (frame.kind === undefined ? [] : [{ kind: frame.kind, data: frame.data ?? {} }]));
  }

  /** An event's entry `{ sequence, event }` as bytes, cut into parts, with its reference. */
  function staged(sequence: number, event: unknown) {
    const entry = Buffer.from(JSON.stringify({ sequence, event }));
    const ref = { type: 'event_ref', digest: createHash('sha256').update(entry).digest('hex'), sizeBytes: entry.length };
    const parts: Buffer[] = [];
    for (let offset = 0; offset < entry.length; offset += RUNNER_LIMITS.partDataBytes) parts.push(entry.subarray(offset, offset + RUNNER_LIMITS.partDataBytes));
    return { ref, parts };
  }

  const big = (text: string) => ({ kind: 'tool_result', data: { output: `${text}${'x'.repeat(RUNNER_LIMITS.inlineEventBytes)}` } });

  async function stageAll(runner: TestRunner, runId: string, generation: number, sequence: number, event: unknown) {
    const { ref, parts } = staged(sequence, event);
    for (const [part, data] of parts.entries()) {
      const answer = await runner.request('POST', `/api/v1/runners/runs/${runId}/event-parts`, { generation, sequence, part, data: data.toString('base64'), ref });
      expect(answer.statusCode, answer.body).toBe(200);
    }
    return ref;
  }

  const partsOf = async (jobId: string) => api.db.database.db.select({ sequence: eventParts.sequence }).from(eventParts).where(eq(eventParts.jobId, jobId));

  it('stores NUL and unpaired surrogates in event data as U+FFFD, inline and in parts, and compares retries with what was sent', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const other = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const otherGeneration = await claim(runner, other.job.id);
    // `cat` of a binary file: a NUL, a lone high and a lone low surrogate, in a value and in a key.
    const binary = { kind: 'tool_result', data: { output: 'a\u0000b\ud800c\udc00d', 'key\u0000': ['\u0000'] } };
    const upload = await events(runner, [
      { runId: job.id, generation, firstSequence: 1, events: [binary, message('after it')] },
      { runId: other.job.id, generation: otherGeneration, firstSequence: 1, events: [message('another run')] },
    ]);
    expect(upload.statusCode, upload.body).toBe(200);
    expect(upload.json().results).toEqual([
      { runId: job.id, acknowledgedSequence: 2 },
      { runId: other.job.id, acknowledgedSequence: 1 },
    ]);
    expect((await journal(owner, task.id)).slice(0, 2)).toEqual([
      { kind: 'tool_result', data: { output: 'a\ufffdb\ufffdc\ufffdd', 'key\ufffd': ['\ufffd'] } },
      { kind: 'message', data: { text: 'after it' } },
    ]);
    // A retry is compared with the bytes the runner sent, not with what was stored.
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [binary] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 1 }]);
    const replaced = { kind: 'tool_result', data: { output: 'a\ufffdb\ufffdc\ufffdd', 'key\ufffd': ['\ufffd'] } };
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [replaced] }])).json().results[0]).toMatchObject({
      error: { status: 409, details: { expectedSequence: 3 } },
    });

    // The same in an event staged in parts.
    const ref = await stageAll(runner, job.id, generation, 3, big('\u0000\udfff'));
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 3, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 3 }]);
    const [, , joined] = await journal(owner, task.id);
    expect(String(joined!.data.output).slice(0, 3)).toBe('\ufffd\ufffdx');

    // An identifier the server hands back is refused with such a character (a replaced one would not
    // match the runner's), in that batch's result only.
    const mixed = await events(runner, [
      { runId: job.id, generation, firstSequence: 4, events: [{ kind: 'permission', data: { requestId: 'p\u0000', tool: 'run_command' } }] },
      { runId: other.job.id, generation: otherGeneration, firstSequence: 2, events: [{ kind: 'async_question', data: { requestId: 'q', questions: [{ id: '\ud800', question: 'Why?', options: [], multiple: false, allowCustom: true }] } }] },
    ]);
    expect(mixed.statusCode).toBe(200);
    expect(mixed.json().results).toEqual([
      { runId: job.id, error: { status: 400, message: expect.any(String), details: { issues: [{ field: 'events.4.data.requestId', message: expect.stringMatching(/NUL/) }] } } },
      { runId: other.job.id, error: expect.objectContaining({ status: 400 }) },
    ]);
  });

  it('answers an unexpected failure of one batch as that batch\'s 500, and stores the other batches of the request', async () => {
    const { owner, runner } = await setup();
    const first = await localTask(owner, runner);
    const second = await localTask(owner, runner);
    const generations = [await claim(runner, first.job.id), await claim(runner, second.job.id)];
    // A fault injected in the database: this kind cannot be stored.
    const db = api.db.database.db;
    await db.execute(sql.raw(`create or replace function refuse_test_fault() returns trigger language plpgsql as $$ begin raise exception 'injected fault'; end $$`));
    await db.execute(sql.raw(`create trigger refuse_test_fault before insert on job_events for each row when (new.kind = 'test_fault') execute function refuse_test_fault()`));
    try {
      const upload = await events(runner, [
        { runId: first.job.id, generation: generations[0], firstSequence: 1, events: [{ kind: 'test_fault', data: {} }] },
        { runId: second.job.id, generation: generations[1], firstSequence: 1, events: [message('stored')] },
      ]);
      expect(upload.statusCode).toBe(200);
      expect(upload.json().results).toEqual([
        { runId: first.job.id, error: { status: 500, message: 'Server error' } },
        { runId: second.job.id, acknowledgedSequence: 1 },
      ]);
      expect(await journal(owner, first.task.id)).toEqual([]);
    } finally {
      await db.execute(sql.raw('drop trigger refuse_test_fault on job_events'));
    }
    // Nothing of the failed batch was kept: it goes in once the fault is gone.
    expect((await events(runner, [{ runId: first.job.id, generation: generations[0], firstSequence: 1, events: [message('again')] }])).json().results).toEqual([
      { runId: first.job.id, acknowledgedSequence: 1 },
    ]);
  });

  it('refuses NUL in the text of a receipt or a review answer with a 400 naming the field', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const receipt = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'done\u0000' } });
    expect(receipt.statusCode).toBe(400);
    expect(receipt.json().error).toMatchObject({ code: 'validation_error', details: { issues: [{ field: 'outcome.finalAnswer', message: 'must not contain NUL characters' }] } });
    const asked = await owner.request('POST', `/api/v1/tasks/${task.id}/review-requests`, { path: 'README.md' });
    const review = await runner.request('POST', `/api/v1/runners/review-requests/${asked.json().reviewRequest.id}`, { status: 'error', message: 'cannot read\u0000' });
    expect(review.statusCode).toBe(400);
    expect(review.json().error).toMatchObject({ code: 'validation_error', details: { issues: [{ field: 'message' }] } });
    // Both went through once clean.
    expect((await runner.request('POST', `/api/v1/runners/review-requests/${asked.json().reviewRequest.id}`, { status: 'error', message: 'cannot read' })).statusCode).toBe(204);
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'done' } })).statusCode).toBe(200);
  });

  it('refuses sequences, generations, cursors and part numbers past 2,147,483,647 with a 400 envelope', async () => {
    const { owner, runner } = await setup();
    const { job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const { ref, parts } = staged(1, big(''));
    const refused = [
      await runner.request('POST', '/api/v1/runners/signals', { runs: [{ runId: job.id, after: TOO_LARGE }], version: null, waitMs: 0 }),
      await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=${TOO_LARGE}`),
      await events(runner, [{ runId: job.id, generation, firstSequence: TOO_LARGE, events: [message('x')] }]),
      await events(runner, [{ runId: job.id, generation: TOO_LARGE, firstSequence: 1, events: [message('x')] }]),
      await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: TOO_LARGE, part: 0, data: parts[0]!.toString('base64'), ref }),
      await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 1, part: TOO_LARGE, data: parts[0]!.toString('base64'), ref }),
      await runner.request('POST', `/api/v1/runners/runs/${job.id}/syncing`, { generation: TOO_LARGE }),
      await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: TOO_LARGE, processStopped: true, outcome: { status: 'completed' } }),
    ];
    for (const answer of refused) {
      expect(answer.statusCode, answer.body).toBe(400);
      expect(answer.json().error.code).toBe('validation_error');
    }
    // The largest one is a number the database takes.
    const largest = await runner.request('POST', '/api/v1/runners/signals', { runs: [{ runId: job.id, after: 2_147_483_647 }], version: null, waitMs: 0 });
    expect(largest.statusCode, largest.body).toBe(200);
  });

  it('checks the run\'s owner before its staged parts: another runner neither drops nor learns of them', async () => {
    const { owner, runner } = await setup();
    const intruder = await enrolledRunner(api, owner);
    const { job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const ref = await stageAll(runner, job.id, generation, 1, big(''));
    const wrong = { ...ref, digest: 'f'.repeat(64) };
    expect((await events(intruder, [{ runId: job.id, generation, firstSequence: 1, events: [wrong] }])).json().results).toEqual([
      { runId: job.id, error: { status: 404, message: 'Run not found' } },
    ]);
    expect((await events(intruder, [{ runId: job.id, generation, firstSequence: 1, events: [ref] }])).json().results[0]).toMatchObject({ error: { status: 404 } });
    expect(await partsOf(job.id)).toHaveLength(2);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 1 }]);
  });

  it('drops an event\'s parts once it is stored and answers a retried reference from the stored event', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const ref = await stageAll(runner, job.id, generation, 1, big('first'));
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 1 }]);
    expect(await partsOf(job.id)).toEqual([]);
    // The retry (its answer was lost) is acknowledged without the parts; another reference at that sequence is a conflict.
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 1 }]);
    const other = staged(1, big('other')).ref;
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [other] }])).json().results[0]).toMatchObject({
      error: { status: 409, details: { expectedSequence: 2 } },
    });
    // Staging the stored event again is refused with the sequence expected (the runner then sends its reference).
    const { parts } = staged(1, big('first'));
    const again = await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 1, part: 0, data: parts[0]!.toString('base64'), ref });
    expect(again.statusCode).toBe(409);
    expect(again.json().error.details).toEqual({ expectedSequence: 2 });
    expect(await partsOf(job.id)).toEqual([]);
    expect((await journal(owner, task.id)).map((event) => event.kind)).toEqual(['tool_result']);
  });

  it('drops every part a run staged when a new generation claims it and when its receipt ends it', async () => {
    const { owner, runner } = await setup();
    const { job } = await localTask(owner, runner);
    const lost = await claim(runner, job.id);
    const { ref, parts } = staged(1, big('unsent'));
    const stageFirst = (generation: number) =>
      runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 1, part: 0, data: parts[0]!.toString('base64'), ref });
    expect((await stageFirst(lost)).statusCode).toBe(200);
    expect(await partsOf(job.id)).toHaveLength(1);
    // A restarted runner claims its executing run again: the old generation's part can never be an event.
    const generation = await claim(runner, job.id);
    expect(await partsOf(job.id)).toEqual([]);
    // The run stops with a part still staged (its output was discarded): the receipt ends the run and its parts.
    expect((await stageFirst(generation)).statusCode).toBe(200);
    const receipt = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 0, processStopped: true, outcome: { status: 'failed', error: 'stopped' } });
    expect(receipt.json()).toMatchObject({ status: 'FAILED' });
    expect(await partsOf(job.id)).toEqual([]);
  });

  it('lets the next run of a task execute only after the receipt of a cancelled run its runner still holds', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(200);
    // A follow-up right after the cancel: the cancelled run still works in the task's folder.
    const followUp = await owner.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Try again' });
    expect(followUp.statusCode, followUp.body).toBe(201);
    const next = followUp.json().job.id as string;
    const early = await runner.request('POST', `/api/v1/runners/runs/${next}/claim`, {});
    expect(early.statusCode).toBe(409);
    const receipt = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 0, processStopped: true, outcome: { status: 'cancelled' } });
    expect(receipt.json()).toMatchObject({ state: 'cancelled' });
    await claim(runner, next);
  });

  it('asks a parked session\'s wake to retry while a later cancelled run is still held', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Waiting.', parked: true } });
    const woken = (await runner.request('POST', `/api/v1/runners/runs/${job.id}/wake`, { generation })).json();
    expect(woken).toMatchObject({ started: true });
    const resumeGeneration = await claim(runner, woken.jobId);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(200);
    // The task completes meanwhile (a merged pull request completes a cancelled task), its run still held.
    await updateTask(api.db.database.db, task.id, { status: 'COMPLETED' }, ['CANCELLED']);
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/wake`, { generation })).json()).toMatchObject({ started: false, retry: true });
    await runner.request('POST', `/api/v1/runners/runs/${woken.jobId}/complete`, { generation: resumeGeneration, lastSequence: 0, processStopped: true, outcome: { status: 'cancelled' } });
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/wake`, { generation })).json()).toMatchObject({ started: false, retry: false });
  });

  it('lists every held run and queued runs oldest first, at most 100, each with its own thread and journal count', async () => {
    const { owner, runner } = await setup();
    const first = await localTask(owner, runner);
    const generation = await claim(runner, first.job.id);
    await events(runner, [{ runId: first.job.id, generation, firstSequence: 1, events: [message('one'), message('two')] }]);
    const queued: string[] = [];
    for (let index = 0; index < RUNNER_LIMITS.listedRuns; index++) queued.push((await localTask(owner, runner)).job.id);
    const behind = await owner.request('POST', `/api/v1/tasks/${first.task.id}/messages`, { message: 'And the docs' });
    const listed = (await runner.request('GET', '/api/v1/runners/runs')).json().runs as Array<{ runId: string; eventsStored: number; history: unknown[]; input: string }>;
    expect(listed.map((run) => run.runId)).toEqual([first.job.id, ...queued.slice(0, RUNNER_LIMITS.listedRuns - 1)]);
    expect(listed[0]).toMatchObject({ eventsStored: 2, history: [] });
    expect(listed[1]).toMatchObject({ eventsStored: 0, history: [], input: 'Fix the flaky test' });
    // The receipt moves the work version; the runner lists again and sees the rest.
    await runner.request('POST', `/api/v1/runners/runs/${first.job.id}/complete`, { generation, lastSequence: 2, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Done.' } });
    const rest = (await runner.request('GET', '/api/v1/runners/runs')).json().runs as Array<{ runId: string; history: Array<{ role: string; content: string }> }>;
    expect(rest.map((run) => run.runId)).toEqual([...queued, behind.json().job.id].slice(0, RUNNER_LIMITS.listedRuns));
    // Two runs more finish: the follow-up is listed now, with its task's thread.
    const followUpRun = [...queued, behind.json().job.id].at(-1);
    for (const id of queued.slice(0, 2)) {
      const claimedGeneration = await claim(runner, id);
      await runner.request('POST', `/api/v1/runners/runs/${id}/complete`, { generation: claimedGeneration, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'ok' } });
    }
    const last = (await runner.request('GET', '/api/v1/runners/runs')).json().runs as Array<{ runId: string; history: Array<{ role: string; content: string }> }>;
    expect(last.find((run) => run.runId === followUpRun)!.history).toEqual([{ role: 'user', content: 'Fix the flaky test' }]);
    expect(last.find((run) => run.runId === queued[2])!.history).toEqual([]);
  });

  it('refuses a claim past 100 held runs, so that the list of held runs stays within its bound', async () => {
    const { owner, runner } = await setup();
    const held: Array<{ taskId: string; id: string; generation: number }> = [];
    for (let index = 0; index < RUNNER_LIMITS.listedRuns; index++) {
      const { task, job } = await localTask(owner, runner);
      held.push({ taskId: task.id, id: job.id, generation: await claim(runner, job.id) });
    }
    const { job } = await localTask(owner, runner);
    const claimNext = () => runner.request('POST', `/api/v1/runners/runs/${job.id}/claim`, {});
    expect((await claimNext()).statusCode).toBe(409);
    // A run cancelled before its receipt is still held, and counts; claiming again a run it holds is no new hold.
    const [cancelled, executing] = held as [(typeof held)[number], (typeof held)[number]];
    expect((await owner.request('POST', `/api/v1/tasks/${cancelled.taskId}/cancel`)).statusCode).toBe(200);
    expect((await claimNext()).statusCode).toBe(409);
    expect((await runner.request('POST', `/api/v1/runners/runs/${executing.id}/claim`, {})).statusCode).toBe(200);
    const listed = (await runner.request('GET', '/api/v1/runners/runs')).json().runs as Array<{ runId: string }>;
    expect(listed.map((run) => run.runId)).toEqual(held.map((run) => run.id));
    // The receipt makes room.
    await runner.request('POST', `/api/v1/runners/runs/${cancelled.id}/complete`, { generation: cancelled.generation, lastSequence: 0, processStopped: true, outcome: { status: 'cancelled' } });
    await claim(runner, job.id);
  });

  it.runIf(driver === 'postgres')('counts held runs under the runner row: of two claims racing for the last place, one is refused', async () => {
    const { owner, runner } = await setup();
    for (let index = 0; index < RUNNER_LIMITS.listedRuns - 1; index++) await claim(runner, (await localTask(owner, runner)).job.id);
    const racing = [(await localTask(owner, runner)).job.id, (await localTask(owner, runner)).job.id];
    // Another transaction holds the runner row, so both claims are inside their transactions at once.
    const holder = new pg.Client({ connectionString: postgresUrl(), options: `-c search_path=${api.db.schema}` });
    const observer = new pg.Client({ connectionString: postgresUrl() });
    await holder.connect();
    await observer.connect();
    try {
      await holder.query('begin');
      await holder.query('select id from runners where id = $1 for update', [runner.id]);
      const [{ pid }] = (await holder.query<{ pid: number }>('select pg_backend_pid() as pid')).rows as [{ pid: number }];
      const settled = new Set<number>();
      const row = (await findRunner(api.db.database.db, runner.id))!;
      // The engine's claim itself (a request would first wait for the row in its authentication).
      const claims = racing.map((id, index) =>
        claimEngineRun(api.db.database.db, row, id).then(
          () => 'claimed',
          (error: unknown) => (error instanceof ConflictError ? 'refused' : Promise.reject(error)),
        ).finally(() => settled.add(index)),
      );
      // Each claim either waits for the runner row or (without its lock) has already answered.
      for (let i = 0; i < 400; i++) {
        const { rows } = await observer.query<{ n: number }>('select count(*)::int as n from pg_stat_activity where $1 = any(pg_blocking_pids(pid))', [pid]);
        if (rows[0]!.n + settled.size >= racing.length) break;
        await new Promise((resolve) => setTimeout(resolve, 25));
      }
      await holder.query('commit');
      expect((await Promise.all(claims)).sort()).toEqual(['claimed', 'refused']);
    } finally {
      await holder.end();
      await observer.end();
    }
  });

  it('lists runs in as many queries for many runs as for one', async () => {
    const { owner, runner } = await setup();
    const row = (await findRunner(api.db.database.db, runner.id))!;
    /** The database, counting the statements started on it (every query builder runs once). */
    const counting = () => {
      const db = api.db.database.db;
      let statements = 0;
      const counted = new Proxy(db, {
        get(target, key, receiver) {
          const value: unknown = Reflect.get(target, key, receiver);
          if (typeof value !== 'function' || !['select', 'insert', 'update', 'delete', 'execute', 'transaction'].includes(String(key))) return value;
          return (...args: unknown[]) => {
            statements += 1;
            return (value as (...inner: unknown[]) => unknown).apply(target, args);
          };
        },
      });
      return { db: counted, statements: () => statements };
    };
    const first = await localTask(owner, runner);
    const generation = await claim(runner, first.job.id);
    await events(runner, [{ runId: first.job.id, generation, firstSequence: 1, events: [message('one')] }]);
    const one = counting();
    expect((await listRuns(one.db, row)).runs).toHaveLength(1);
    for (let index = 0; index < 12; index++) {
      const { task } = await localTask(owner, runner);
      await owner.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'And the docs' });
    }
    const many = counting();
    expect((await listRuns(many.db, row)).runs).toHaveLength(25);
    expect(many.statements()).toBe(one.statements());
  });

  it.runIf(driver === 'postgres')('takes uploads while an owner action holds the task, without a deadlock, and a racing retry is acknowledged', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const action = new pg.Client({ connectionString: postgresUrl(), options: `-c search_path=${api.db.schema}` });
    const observer = new pg.Client({ connectionString: postgresUrl() });
    await action.connect();
    await observer.connect();
    try {
      const [{ pid }] = (await action.query<{ pid: number }>('select pg_backend_pid() as pid')).rows as [{ pid: number }];
      // An owner action: the task first…
      await action.query('begin');
      await action.query('select id from tasks where id = $1 for update', [task.id]);
      // …while the same batch is uploaded twice at once (a retry racing its original).
      const batch = [{ runId: job.id, generation, firstSequence: 1, events: [message('one'), message('two')] }];
      const uploads = [events(runner, batch), events(runner, batch)];
      let waiting = 0;
      for (let i = 0; i < 400 && waiting < 2; i++) {
        await new Promise((resolve) => setTimeout(resolve, 25));
        const { rows } = await observer.query<{ n: number }>(
          `select count(*)::int as n from pg_stat_activity a
           where $1 = any(pg_blocking_pids(a.pid)) or exists (select 1 from unnest(pg_blocking_pids(a.pid)) b where $1 = any(pg_blocking_pids(b)))`,
          [pid],
        );
        waiting = rows[0]!.n;
      }
      expect(waiting, 'both uploads wait for the owner action').toBe(2);
      // …then the job, as every task action does.
      await action.query('select id from jobs where id = $1 for update', [job.id]);
      await action.query('commit');
      const answers = await Promise.all(uploads);
      for (const answer of answers) expect(answer.json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    } finally {
      await action.end();
      await observer.end();
    }
    expect((await journal(owner, task.id)).map((event) => event.data.text)).toEqual(['one', 'two']);
  });
});
