/**
 * The runs side of the runner protocol on both databases, through the real routes: local tasks and who
 * sees them, claims and generations, event batches and parts, signals, controls from the owner's answers,
 * syncing, the completion receipt, cancel, wake, async questions and review requests.
 */
import { createHash, randomUUID } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { claimNextJob } from '../src/engine/queue.js';
import { RUNNER_LIMITS } from '../src/protocol/runner.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { claimRun, LOCAL_AGENT, localTask, messageEvent, uploadEvents } from './support/local-runs.js';
import { enrolledRunner, signedInUser, type SignedIn, type TestRunner } from './support/runners.js';

describe.each(testDrivers)('runner runs on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  async function setup(options: Parameters<typeof enrolledRunner>[2] = {}): Promise<{ owner: SignedIn; runner: TestRunner }> {
    const owner = await signedInUser(api);
    return { owner, runner: await enrolledRunner(api, owner, options) };
  }

  const claim = claimRun;
  const events = uploadEvents;
  const message = messageEvent;

  it('creates local work only for a signed-in owner, hides it from API keys and other people, and never lets an executor claim it', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    expect(task.status).toBe('PENDING');
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}`)).statusCode).toBe(200);
    expect((await owner.request('GET', '/api/v1/tasks')).json().tasks.map((item: { id: string }) => item.id)).toContain(task.id);

    // The personal workspace's own API key sees nothing of it.
    const key = (await api.db.database.db.transaction(async (tx) => (await import('../src/store/api-keys.js')).createApiKey(tx, { workspaceId: owner.personal.id, name: 'k' }))).key;
    const byKey = (method: 'GET' | 'POST', url: string, body?: unknown) =>
      api.app.inject({ method, url, headers: { authorization: `Bearer ${key}` }, ...(body === undefined ? {} : { payload: body as object }) });
    expect((await byKey('GET', `/api/v1/tasks/${task.id}`)).statusCode).toBe(404);
    expect((await byKey('GET', `/api/v1/tasks/${task.id}/logs`)).statusCode).toBe(404);
    expect((await byKey('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(404);
    expect((await byKey('GET', '/api/v1/tasks')).json().tasks).toEqual([]);
    const keyLocal = await byKey('POST', '/api/v1/tasks', { command: 'x', agent: LOCAL_AGENT, local: { runnerId: runner.id, projectId: runner.projectId } });
    expect(keyLocal.statusCode).toBe(403);
    expect((await byKey('GET', `/api/v1/tasks/${task.id}/requests`)).statusCode).toBe(403);
    // Another person neither sees it nor can start work on this runner.
    const stranger = await signedInUser(api);
    expect((await stranger.request('GET', `/api/v1/tasks/${task.id}`)).statusCode).toBe(404);
    const foreign = await stranger.request('POST', '/api/v1/tasks', { command: 'x', agent: LOCAL_AGENT, local: { runnerId: runner.id, projectId: runner.projectId } });
    expect(foreign.statusCode).toBe(400);
    // A model the runner's catalog does not offer, or a project it does not have, is refused.
    expect((await owner.request('POST', '/api/v1/tasks', { command: 'x', agent: 'openai-compatible/other', local: { runnerId: runner.id, projectId: runner.projectId } })).statusCode).toBe(400);
    expect((await owner.request('POST', '/api/v1/tasks', { command: 'x', agent: LOCAL_AGENT, local: { runnerId: runner.id, projectId: randomUUID() } })).statusCode).toBe(400);

    // Executors never claim a local run; the runner lists it.
    expect(await claimNextJob(api.db.database.db, { owner: 'test', leaseMs: 60_000 })).toBeNull();
    const listed = await runner.request('GET', '/api/v1/runners/runs');
    expect(listed.statusCode).toBe(200);
    expect(listed.json().runs).toEqual([
      expect.objectContaining({ runId: job.id, taskId: task.id, state: 'queued', generation: 0, harness: 'openai-compatible', model: 'fake', permissionMode: 'ask', input: 'Fix the flaky test', eventsStored: 0, resumeParked: false }),
    ]);
    // Another runner does not see or claim it.
    const other = await enrolledRunner(api, owner);
    expect((await other.request('GET', '/api/v1/runners/runs')).json().runs).toEqual([]);
    expect((await other.request('POST', `/api/v1/runners/runs/${job.id}/claim`, {})).statusCode).toBe(404);
  });

  it('claims under a new generation each time, refusing the older one, and stores each event once', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    // The claim's answer was lost: the runner claims again, and only the generation it got counts.
    const lost = await claim(runner, job.id);
    const generation = await claim(runner, job.id);
    expect(generation).toBe(lost + 1);
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}`)).json().task.status).toBe('IN_PROGRESS');
    const stale = await events(runner, [{ runId: job.id, generation: lost, firstSequence: 1, events: [message('old')] }]);
    expect(stale.json().results[0]).toMatchObject({ runId: job.id, error: { status: 409 } });

    const first = [message('one'), message('two')];
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: first }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    // A duplicate is acknowledged again; other bytes at the same sequence and a gap are refused with the sequence expected.
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: first }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [message('TWO')] }])).json().results[0]).toMatchObject({ error: { status: 409, details: { expectedSequence: 3 } } });
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 5, events: [message('five')] }])).json().results[0]).toMatchObject({ error: { status: 409, details: { expectedSequence: 3 } } });
    // One run's error never fails another's.
    const second = await localTask(owner, runner);
    const mixed = await events(runner, [
      { runId: second.job.id, generation: 7, firstSequence: 1, events: [message('unclaimed')] },
      { runId: job.id, generation, firstSequence: 3, events: [message('three')] },
      { runId: randomUUID(), generation: 1, firstSequence: 1, events: [message('nobody')] },
    ]);
    expect(mixed.json().results).toEqual([
      { runId: second.job.id, error: expect.objectContaining({ status: 409 }) },
      { runId: job.id, acknowledgedSequence: 3 },
      { runId: expect.any(String), error: expect.objectContaining({ status: 404 }) },
    ]);
    const logs = (await owner.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    expect(logs.match(/"kind":"message"/g)).toHaveLength(3);
    // Nobody but its runner posts events for a run; API keys are not runner credentials.
    const withKey = await api.app.inject({ method: 'POST', url: '/api/v1/runners/events', headers: { authorization: `Bearer ${tenant.key}` }, payload: { batches: [] } });
    expect(withKey.statusCode).toBe(401);
  });

  it('takes an event of exactly 240 KiB inline, sends a larger one in parts, and never shows part of one', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    // An entry `{ sequence, event }` of exactly the inline limit, and one byte more.
    const sized = (sequence: number, bytes: number) => {
      const event = { kind: 'tool_result', data: { output: '' } };
      const overhead = Buffer.byteLength(JSON.stringify({ sequence, event }));
      event.data.output = 'x'.repeat(bytes - overhead);
      return event;
    };
    expect(Buffer.byteLength(JSON.stringify({ sequence: 1, event: sized(1, RUNNER_LIMITS.inlineEventBytes) }))).toBe(RUNNER_LIMITS.inlineEventBytes);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [sized(1, RUNNER_LIMITS.inlineEventBytes)] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 1 }]);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [sized(2, RUNNER_LIMITS.inlineEventBytes + 1)] }])).json().results[0]).toMatchObject({ error: { status: 413 } });

    // The same event in parts.
    const event = sized(2, RUNNER_LIMITS.inlineEventBytes + 1);
    const entry = Buffer.from(JSON.stringify({ sequence: 2, event }));
    const ref = { type: 'event_ref', digest: createHash('sha256').update(entry).digest('hex'), sizeBytes: entry.length };
    const chunks = [entry.subarray(0, RUNNER_LIMITS.partDataBytes), entry.subarray(RUNNER_LIMITS.partDataBytes)];
    const part = (index: number, data: Buffer, overrides: Record<string, unknown> = {}) =>
      runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 2, part: index, data: data.toString('base64'), ref, ...overrides });
    expect((await part(0, chunks[0]!)).json()).toEqual({ runId: job.id, sequence: 2, part: 0, receivedBytes: chunks[0]!.length });
    // A repeat is fine; other bytes for a staged part, or a part for an event that is not next, are not.
    expect((await part(0, chunks[0]!)).statusCode).toBe(200);
    expect((await part(0, Buffer.alloc(chunks[0]!.length, 1))).statusCode).toBe(409);
    expect((await part(0, chunks[0]!, { sequence: 3 })).statusCode).toBe(409);
    expect((await part(0, Buffer.alloc(RUNNER_LIMITS.partDataBytes + 1))).statusCode).toBe(413);
    // The reference before every part is there: refused, nothing stored, nothing shown.
    const early = await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [ref] }]);
    expect(early.json().results[0]).toMatchObject({ error: { status: 400, details: { issues: [{ message: expect.stringMatching(/a part is missing/) }] } } });
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}/logs`)).body.match(/"kind":"tool_result"/g)).toHaveLength(1);
    expect((await part(1, chunks[1]!)).json().receivedBytes).toBe(entry.length);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    // The reference retried is checked against the same parts, and acknowledged again.
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [ref] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    const stored = (await owner.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    expect(stored.match(/"kind":"tool_result"/g)).toHaveLength(2);
    // The whole event came back (compared by length: searching a repetitive string is quadratic).
    const outputs = stored
      .split('\n')
      .filter((line) => line.startsWith('data: '))
      .map((line) => JSON.parse(line.slice(6)) as { kind: string; data: { output?: string } })
      .filter((item) => item.kind === 'tool_result')
      .map((item) => item.data.output?.length);
    expect(outputs).toEqual([sized(1, RUNNER_LIMITS.inlineEventBytes).data.output.length, event.data.output.length]);

    // A corrupted part: the digest does not match, nothing is stored.
    const big = sized(3, RUNNER_LIMITS.inlineEventBytes + 10);
    const bigEntry = Buffer.from(JSON.stringify({ sequence: 3, event: { ...big, data: { output: `${big.data.output.slice(0, -10)}${'y'.repeat(10)}` } } }));
    const bigRef = { type: 'event_ref', digest: createHash('sha256').update(bigEntry).digest('hex'), sizeBytes: bigEntry.length + 0 };
    const corrupt = Buffer.from(bigEntry);
    corrupt[100] = corrupt[100]! ^ 1;
    await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 3, part: 0, data: corrupt.subarray(0, RUNNER_LIMITS.partDataBytes).toString('base64'), ref: bigRef });
    await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 3, part: 1, data: corrupt.subarray(RUNNER_LIMITS.partDataBytes).toString('base64'), ref: bigRef });
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 3, events: [bigRef] }])).json().results[0]).toMatchObject({
      error: { status: 400, details: { issues: [{ message: expect.stringMatching(/do not match its digest; its parts were dropped/) }] } },
    });
    // The corrupted parts are gone: staged again right, the event is stored.
    for (const [index, chunk] of [bigEntry.subarray(0, RUNNER_LIMITS.partDataBytes), bigEntry.subarray(RUNNER_LIMITS.partDataBytes)].entries()) {
      expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, { generation, sequence: 3, part: index, data: chunk.toString('base64'), ref: bigRef })).statusCode).toBe(200);
    }
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 3, events: [bigRef] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 3 }]);
    // A logical event over 32 MiB is refused by its reference alone.
    const huge = await runner.request('POST', `/api/v1/runners/runs/${job.id}/event-parts`, {
      generation,
      sequence: 4,
      part: 0,
      data: 'AAAA',
      ref: { type: 'event_ref', digest: 'a'.repeat(64), sizeBytes: RUNNER_LIMITS.logicalEventBytes + 1 },
    });
    expect(huge.statusCode).toBe(400);
  });

  it('answers signals at once on a new version, a control or a missing run, and wakes a waiting poll when the owner answers', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const signals = (body: unknown) => runner.request('POST', '/api/v1/runners/signals', body);
    const first = (await signals({ runs: [], version: null, waitMs: 10_000 })).json();
    expect(first).toMatchObject({ controls: [], missing: [], reviewRequests: [] });
    const generation = await claim(runner, job.id);
    const gone = randomUUID();
    expect((await signals({ runs: [{ runId: gone, after: 0 }], version: first.version, waitMs: 10_000 })).json().missing).toEqual([gone]);

    // A permission question from the run; the poll waits (same version, nothing after the cursor).
    const question = { id: 'q1', question: 'Which database?', options: [{ label: 'PostgreSQL' }, { label: 'SQLite' }], multiple: false, allowCustom: false };
    await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [{ kind: 'permission', data: { requestId: 'p1', kind: 'question', questions: [question] } }] }]);
    const version = (await runner.request('GET', '/api/v1/runners/runs')).json().version;
    const waiting = signals({ runs: [{ runId: job.id, after: 0 }], version, waitMs: 10_000 });
    const requests = (await owner.request('GET', `/api/v1/tasks/${task.id}/requests`)).json().requests;
    expect(requests).toEqual([expect.objectContaining({ requestId: 'p1', kind: 'question', status: 'pending', questions: [question] })]);
    // Invalid answers leave it pending; the valid one becomes the run's control and wakes the poll.
    for (const bad of [{ decision: 'allow' }, { decision: 'allow', answers: [{ questionId: 'q1', values: ['MySQL'] }] }, { decision: 'allow', answers: [{ questionId: 'q1', values: ['PostgreSQL', 'SQLite'] }] }, { decision: 'deny', answers: [] }]) {
      expect((await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/p1`, bad)).statusCode).toBe(400);
    }
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}/requests`)).json().requests[0].status).toBe('pending');
    const stranger = await signedInUser(api);
    expect((await stranger.request('POST', `/api/v1/tasks/${task.id}/permissions/p1`, { decision: 'deny' })).statusCode).toBe(404);
    const answered = await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/p1`, { decision: 'allow', answers: [{ questionId: 'q1', values: ['PostgreSQL'] }] });
    expect(answered.statusCode, answered.body).toBe(200);
    const woke = (await waiting).json();
    expect(woke.controls).toEqual([{ runId: job.id, sequence: 1, message: { type: 'permission', requestId: 'p1', decision: 'allow', answers: [{ questionId: 'q1', values: ['PostgreSQL'] }] } }]);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/p1`, { decision: 'deny' })).statusCode).toBe(409);
    // The legacy poll sees the same control.
    expect((await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=0`)).json().controls).toHaveLength(1);
    expect((await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=1`)).json().controls).toHaveLength(0);
  });

  it('holds a long poll over real HTTP until a control arrives', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [{ kind: 'permission', data: { requestId: 'http-1', tool: 'run_command' } }] }]);
    const version = (await runner.request('GET', '/api/v1/runners/runs')).json().version;
    // The app is closed with the block (useTestApi); listening lets a real client hold a connection.
    const address = api.app.server.listening ? `http://127.0.0.1:${(api.app.server.address() as { port: number }).port}` : await api.app.listen({ port: 0, host: '127.0.0.1' });
    let settled = false;
    const waiting = fetch(`${address}/api/v1/runners/signals`, {
      method: 'POST',
      headers: { authorization: `Bearer ${runner.credential}`, 'content-type': 'application/json' },
      body: JSON.stringify({ runs: [{ runId: job.id, after: 0 }], version, waitMs: 10_000 }),
    }).then(async (response) => {
      settled = true;
      return (await response.json()) as { controls: unknown[] };
    });
    // The poll stays open: a request stream that ended is not a client that left.
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(settled).toBe(false);
    await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/http-1`, { decision: 'allow' });
    expect((await waiting).controls).toEqual([expect.objectContaining({ runId: job.id, sequence: 1 })]);

    // A control too large for its NOTIFY to carry it: the poll looks it up instead.
    const question = { id: 'q', question: 'Anything to add?', options: [], multiple: false, allowCustom: true };
    await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [{ kind: 'permission', data: { requestId: 'http-2', kind: 'question', questions: [question] } }] }]);
    const large = 'x'.repeat(9_000);
    const next = fetch(`${address}/api/v1/runners/signals`, {
      method: 'POST',
      headers: { authorization: `Bearer ${runner.credential}`, 'content-type': 'application/json' },
      body: JSON.stringify({ runs: [{ runId: job.id, after: 1 }], version, waitMs: 10_000 }),
    }).then(async (response) => (await response.json()) as { controls: Array<{ sequence: number; message: { answers?: Array<{ values: string[] }> } }> });
    await new Promise((resolve) => setTimeout(resolve, 300));
    await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/http-2`, { decision: 'allow', answers: [{ questionId: 'q', values: [large] }] });
    const looked = (await next).controls;
    expect(looked.map((control) => control.sequence)).toEqual([2]);
    expect(looked[0]!.message.answers![0]!.values[0]).toHaveLength(9_000);
  });

  it('syncs and completes a run only once every event is delivered, then lets the next run of the task go', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [{ kind: 'permission', data: { requestId: 'p2', tool: 'run_command', input: { command: 'ls' } } }] }]);
    // A follow-up behind the executing run asks it (once) to finish its background wait.
    await owner.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'And also the docs' });
    await owner.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'And the changelog' });
    const controls = (await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=0`)).json().controls;
    expect(controls.map((control: { message: { type: string } }) => control.message.type)).toEqual(['finish_background_wait']);
    // The next run waits its turn.
    const queued = (await runner.request('GET', '/api/v1/runners/runs')).json().runs.filter((run: { runId: string }) => run.runId !== job.id);
    expect(queued).toHaveLength(2);
    expect((await runner.request('POST', `/api/v1/runners/runs/${queued[0].runId}/claim`, {})).statusCode).toBe(409);

    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/syncing`, { generation })).json()).toMatchObject({ state: 'syncing', status: 'IN_PROGRESS' });
    // Syncing cleared the pending permission; the run must not start again.
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}/requests`)).json().requests[0].status).toBe('cleared');
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/p2`, { decision: 'allow' })).statusCode).toBe(409);
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/claim`, {})).statusCode).toBe(409);
    await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [message('synced output')] }]);

    const receipt = { generation, lastSequence: 1, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Done.', sessionId: 'session-1' } };
    const early = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, receipt);
    expect(early.statusCode).toBe(409);
    expect(early.json().error.details).toEqual({ expectedSequence: 3 });
    const done = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { ...receipt, lastSequence: 2 });
    expect(done.json()).toEqual({ runId: job.id, state: 'completed', status: 'COMPLETED', generation });
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { ...receipt, lastSequence: 2 })).json()).toEqual(done.json());
    const jobs = (await owner.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs;
    expect(jobs[0]).toMatchObject({ id: job.id, status: 'COMPLETED', finalAnswer: 'Done.' });
    // The next run carries the task's session and is claimable now; the finished one left the list.
    const listed = (await runner.request('GET', '/api/v1/runners/runs')).json().runs;
    expect(listed.map((run: { runId: string }) => run.runId)).not.toContain(job.id);
    expect(listed[0]).toMatchObject({ sessionId: 'session-1', input: 'And also the docs' });
    expect((await runner.request('POST', `/api/v1/runners/runs/${listed[0].runId}/claim`, {})).statusCode).toBe(200);
  });

  it('hands a cancel to the runner, which finishes the run as cancelled, and wakes a parked session once', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const before = (await runner.request('GET', '/api/v1/runners/runs')).json().version;
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/cancel`)).statusCode).toBe(200);
    const after = (await runner.request('POST', '/api/v1/runners/signals', { runs: [{ runId: job.id, after: 0 }], version: before, waitMs: 10_000 })).json();
    expect(after.version).not.toBe(before);
    expect((await runner.request('GET', '/api/v1/runners/runs')).json().runs).toEqual([expect.objectContaining({ runId: job.id, state: 'cancelled' })]);
    // Its remaining output is still taken, then the receipt; the task stays cancelled.
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [message('stopping')] }])).json().results[0]).toEqual({ runId: job.id, acknowledgedSequence: 1 });
    const receipt = await runner.request('POST', `/api/v1/runners/runs/${job.id}/complete`, { generation, lastSequence: 1, processStopped: true, outcome: { status: 'cancelled' } });
    expect(receipt.json()).toMatchObject({ state: 'cancelled', status: 'CANCELLED' });
    expect((await runner.request('GET', '/api/v1/runners/runs')).json().runs).toEqual([]);
    expect((await owner.request('GET', `/api/v1/tasks/${task.id}`)).json().task.status).toBe('CANCELLED');

    // A run that parked its CLI: a wake queues a resume run, once.
    const parked = await localTask(owner, runner);
    const parkedGeneration = await claim(runner, parked.job.id);
    await runner.request('POST', `/api/v1/runners/runs/${parked.job.id}/complete`, { generation: parkedGeneration, lastSequence: 0, processStopped: true, outcome: { status: 'completed', finalAnswer: 'Waiting on the build.', parked: true } });
    const wake = (await runner.request('POST', `/api/v1/runners/runs/${parked.job.id}/wake`, { generation: parkedGeneration })).json();
    expect(wake).toEqual({ started: true, jobId: expect.any(String) });
    expect((await runner.request('GET', '/api/v1/runners/runs')).json().runs).toEqual([expect.objectContaining({ runId: wake.jobId, resumeParked: true, state: 'queued' })]);
    expect((await runner.request('POST', `/api/v1/runners/runs/${parked.job.id}/wake`, { generation: parkedGeneration })).json()).toMatchObject({ started: false, retry: true });
    // A run that did not park cannot be woken.
    expect((await runner.request('POST', `/api/v1/runners/runs/${job.id}/wake`, { generation })).json()).toMatchObject({ started: false, retry: false });
  });

  it('settles an async answer by its id: once reported delivered, a later report that it was not queues no follow-up', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const questions = [{ id: 'a', question: 'Name it?', options: [], multiple: false, allowCustom: true }];
    await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [{ kind: 'async_question', data: { requestId: 'item-1', questions } }] }]);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/questions/item-1`, { text: 'Call it svc' })).statusCode).toBe(200);
    const [control] = (await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=0`)).json().controls;
    const result = (delivered: boolean) => ({ kind: 'async_question_answer_result', data: { id: control.message.id, delivered } });
    // Delivered to the run; then the same answer reported undelivered (a runner that lost its own dedupe).
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [result(true)] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 2 }]);
    expect((await events(runner, [{ runId: job.id, generation, firstSequence: 3, events: [result(false)] }])).json().results).toEqual([{ runId: job.id, acknowledgedSequence: 3 }]);
    const jobs = (await owner.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs as Array<{ id: string; input: string }>;
    expect(jobs.map((item) => item.id)).toEqual([job.id]);
    expect((await runner.request('GET', '/api/v1/runners/runs')).json().runs.map((run: { input: string }) => run.input)).not.toContain('Call it svc');
  });

  it('delivers an async answer as a control to a runner that takes them, as a follow-up otherwise (once, never to a cancelled task); answers review requests', async () => {
    const { owner, runner } = await setup();
    const { task, job } = await localTask(owner, runner);
    const generation = await claim(runner, job.id);
    const questions = [{ id: 'a', question: 'Name it?', options: [], multiple: false, allowCustom: true }];
    await events(runner, [{ runId: job.id, generation, firstSequence: 1, events: [{ kind: 'async_question', data: { requestId: 'item-1', questions } }] }]);
    // Answering it through the permission route is refused: it does not pause the run.
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/permissions/item-1`, { decision: 'allow' })).statusCode).toBe(409);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/questions/item-1`, { text: 'Call it svc' })).statusCode).toBe(200);
    const [control] = (await runner.request('GET', `/api/v1/runners/runs/${job.id}/controls?after=0`)).json().controls;
    expect(control.message).toEqual({ type: 'async_question_answer', id: expect.any(String), requestId: 'item-1', text: 'Call it svc' });
    // The runner could not deliver it (the turn had ended): it becomes a follow-up.
    const undelivered = { kind: 'async_question_answer_result', data: { id: control.message.id, delivered: false } };
    await events(runner, [{ runId: job.id, generation, firstSequence: 2, events: [undelivered] }]);
    const runs = (await runner.request('GET', '/api/v1/runners/runs')).json().runs;
    expect(runs.map((run: { input: string }) => run.input)).toContain('Call it svc');
    // Reported again (a harness that retried): still one follow-up.
    await events(runner, [{ runId: job.id, generation, firstSequence: 3, events: [undelivered] }]);
    const jobs = async (taskId: string) => (await owner.request('GET', `/api/v1/tasks/${taskId}/jobs`)).json().jobs as Array<{ input: string }>;
    expect((await jobs(task.id)).filter((item) => item.input === 'Call it svc')).toHaveLength(1);

    // An answer never restarts a cancelled task: reported undelivered after the cancel, it is dropped…
    const cancelled = await localTask(owner, runner);
    const cancelledGeneration = await claim(runner, cancelled.job.id);
    const ask = (sequence: number, requestId: string) =>
      events(runner, [{ runId: cancelled.job.id, generation: cancelledGeneration, firstSequence: sequence, events: [{ kind: 'async_question', data: { requestId, questions } }] }]);
    await ask(1, 'item-3');
    await owner.request('POST', `/api/v1/tasks/${cancelled.task.id}/questions/item-3`, { text: 'Later' });
    const [late] = (await runner.request('GET', `/api/v1/runners/runs/${cancelled.job.id}/controls?after=0`)).json().controls;
    await owner.request('POST', `/api/v1/tasks/${cancelled.task.id}/cancel`);
    const result = { kind: 'async_question_answer_result', data: { id: late.message.id, delivered: false } };
    expect((await events(runner, [{ runId: cancelled.job.id, generation: cancelledGeneration, firstSequence: 2, events: [result] }])).json().results).toEqual([
      { runId: cancelled.job.id, acknowledgedSequence: 2 },
    ]);
    expect((await jobs(cancelled.task.id)).map((item) => item.input)).not.toContain('Later');
    expect((await owner.request('GET', `/api/v1/tasks/${cancelled.task.id}`)).json().task.status).toBe('CANCELLED');
    // …and the owner's answer to a cancelled task's question is refused, the request still pending.
    await ask(3, 'item-4');
    expect((await owner.request('POST', `/api/v1/tasks/${cancelled.task.id}/questions/item-4`, { text: 'Too late' })).statusCode).toBe(409);
    const requests = (await owner.request('GET', `/api/v1/tasks/${cancelled.task.id}/requests`)).json().requests as Array<{ requestId: string; status: string }>;
    expect(requests.find((request) => request.requestId === 'item-4')?.status).toBe('pending');

    // A runner whose harness takes no async answers: the answer is a follow-up at once.
    const { owner: other, runner: older } = await setup({ capabilities: { models: { 'openai-compatible': [{ id: 'fake', name: 'Fake' }] } } });
    const oldTask = await localTask(other, older);
    const oldGeneration = await claim(older, oldTask.job.id);
    await events(older, [{ runId: oldTask.job.id, generation: oldGeneration, firstSequence: 1, events: [{ kind: 'async_question', data: { requestId: 'item-2', questions } }] }]);
    await other.request('POST', `/api/v1/tasks/${oldTask.task.id}/questions/item-2`, { text: 'Later' });
    expect((await older.request('GET', `/api/v1/runners/runs/${oldTask.job.id}/controls?after=0`)).json().controls).toEqual([]);
    expect((await older.request('GET', '/api/v1/runners/runs')).json().runs.map((run: { input: string }) => run.input)).toContain('Later');

    // Review requests: asked by the owner, seen in signals, answered by the runner.
    const asked = await owner.request('POST', `/api/v1/tasks/${task.id}/review-requests`, { path: 'src/index.ts' });
    expect(asked.statusCode, asked.body).toBe(201);
    expect((await owner.request('POST', `/api/v1/tasks/${task.id}/review-requests`, { path: '../etc/passwd' })).statusCode).toBe(400);
    const id = asked.json().reviewRequest.id;
    const version = (await runner.request('GET', '/api/v1/runners/runs')).json().version;
    const signal = (await runner.request('POST', '/api/v1/runners/signals', { runs: [], version, waitMs: 10_000 })).json();
    expect(signal.reviewRequests).toEqual([expect.objectContaining({ id, path: 'src/index.ts', taskId: task.id })]);
    expect((await runner.request('GET', '/api/v1/runners/review-requests')).json().reviewRequests.map((request: { id: string }) => request.id)).toEqual([id]);
    expect((await runner.request('POST', `/api/v1/runners/review-requests/${id}`, { status: 'ok', content: Buffer.from('export {};\n').toString('base64') })).statusCode).toBe(204);
    expect((await runner.request('POST', `/api/v1/runners/review-requests/${id}`, { status: 'ok', content: 'AAAA' })).statusCode).toBe(409);
    const read = (await owner.request('GET', `/api/v1/tasks/${task.id}/review-requests/${id}`)).json().reviewRequest;
    expect(read).toMatchObject({ status: 'answered', content: Buffer.from('export {};\n').toString('base64') });
  });
});
