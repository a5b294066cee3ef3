/**
 * The runner protocol under faults (STYLE.md 5 and 6): the real runner (`RunnerDaemon` in-process, or
 * `svc runner start` in a child process where it must be killed) with the built-in loop against the fake
 * model, the real server on a port of 127.0.0.1, and between them a proxy that injects faults per request
 * (test/support/fault-proxy.ts): answers lost, requests refused, duplicated, reordered, cut off and
 * changed on the way, the server down while the runner restarts. The assertions read the server's journal
 * (as the owner), the job states and what crossed the proxy, never timings.
 */
import { mkdtempSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { eq } from 'drizzle-orm';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { RECONNECT_STOPPED_RUN } from '../src/engine/runners/enrollment.js';
import { RUNNER_LIMITS, type RunnerEvent } from '../src/protocol/runner.js';
import { STOPPED_WHILE_EXECUTING, RunnerDaemon } from '../src/runner/daemon.js';
import { RunnerHome } from '../src/runner/home.js';
import { RunOutbox } from '../src/runner/outbox.js';
import { addProject } from '../src/runner/projects.js';
import { RunRecords, groupExists } from '../src/runner/run-state.js';
import { jobs } from '../src/store/schema.js';
import { startTestApi, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { startFakeModel, type ScriptedAnswer } from './support/fake-model.js';
import { FaultProxy, changeFirstEventText, flipPartByte, type Exchange } from './support/fault-proxy.js';
import {
  finishAllowing,
  journalOf,
  pairFor,
  pendingRequests,
  runnerEnv,
  startLocalTask,
  startRunnerProcess,
  taskView,
  waitFor,
  widgetsRepository,
  type JournalEntry,
} from './support/runner-e2e.js';
import { signedInUser } from './support/runners.js';

const KiB = 1024;
const EVENTS = '/runners/events';
const PARTS = /\/event-parts$/;

interface SentBatch {
  runId: string;
  generation: number;
  firstSequence: number;
  events: Array<RunnerEvent | { type: 'event_ref'; digest: string; sizeBytes: number }>;
}

const batchesOf = (body: string) => (JSON.parse(body) as { batches: SentBatch[] }).batches;
const resultsOf = (exchange: Exchange) =>
  (JSON.parse(exchange.answer!) as { results: Array<{ runId: string; acknowledgedSequence?: number; error?: { status: number; message: string; details?: Record<string, unknown> } }> }).results;
const partOf = (body: string) => JSON.parse(body) as { generation: number; sequence: number; part: number; data: string; ref: { digest: string; sizeBytes: number } };
const isRef = (event: SentBatch['events'][number]): event is { type: 'event_ref'; digest: string; sizeBytes: number } => 'type' in event && event.type === 'event_ref';

/**
 * What the runner sent of `runId`, per sequence, from the bytes it put on the wire (before any change on
 * the way): inline events, and events joined from their parts. A sequence sent twice must carry the same
 * bytes both times: the runner never sends an event differently.
 */
function sentByRunner(proxy: FaultProxy, runId: string): Map<number, RunnerEvent> {
  const sent = new Map<number, string>();
  const keep = (sequence: number, text: string) => {
    const earlier = sent.get(sequence);
    if (earlier === undefined) sent.set(sequence, text);
    else expect(text, `sequence ${sequence} was sent again with other bytes`).toBe(earlier);
  };
  for (const exchange of proxy.find({ method: 'POST', path: EVENTS })) {
    for (const batch of batchesOf(exchange.body)) {
      if (batch.runId !== runId) continue;
      batch.events.forEach((event, index) => {
        if (!isRef(event)) keep(batch.firstSequence + index, JSON.stringify(event));
      });
    }
  }
  const parts = new Map<number, Map<number, string>>();
  for (const exchange of proxy.find({ method: 'POST', path: `/runs/${runId}/event-parts` })) {
    const part = partOf(exchange.body);
    const ofEvent = parts.get(part.sequence) ?? new Map<number, string>();
    parts.set(part.sequence, ofEvent);
    const earlier = ofEvent.get(part.part);
    if (earlier === undefined) ofEvent.set(part.part, part.data);
    else expect(part.data, `part ${part.part} of ${part.sequence} was sent again with other bytes`).toBe(earlier);
  }
  for (const [sequence, ofEvent] of parts) {
    const bytes = Buffer.concat([...ofEvent.keys()].sort((a, b) => a - b).map((part) => Buffer.from(ofEvent.get(part)!, 'base64')));
    const entry = JSON.parse(bytes.toString('utf8')) as { sequence: number; event: RunnerEvent };
    expect(entry.sequence).toBe(sequence);
    keep(sequence, JSON.stringify(entry.event));
  }
  return new Map([...sent].sort(([a], [b]) => a - b).map(([sequence, text]) => [sequence, JSON.parse(text) as RunnerEvent]));
}

/** The run's journal holds every sequence from 1 exactly once, with the content the runner sent. */
function expectJournalIsWhatTheRunnerSent(journal: JournalEntry[], runId: string, sent: Map<number, RunnerEvent>): void {
  const entries = journal.filter((entry) => entry.jobId === runId);
  const sequences = Array.from({ length: sent.size }, (_, index) => index + 1);
  expect([...sent.keys()]).toEqual(sequences);
  expect(entries.map((entry) => entry.sequence)).toEqual(sequences);
  expect(entries.map((entry) => ({ kind: entry.kind, data: entry.data }))).toEqual([...sent.values()].map((event) => ({ kind: event.kind, data: event.data ?? null })));
}

/**
 * One HTTP request on a connection of its own: a keep-alive connection left in the test's pool would hold
 * the server's close until the server's keep-alive timeout (72 s).
 */
function plainRequest(method: 'GET' | 'POST', url: string, body?: string, headers: Record<string, string> = {}): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const sent = httpRequest(url, { method, agent: false, headers: { ...headers, ...(body === undefined ? {} : { 'content-type': 'application/json' }) } }, (answer) => {
      let text = '';
      answer.setEncoding('utf8');
      answer.on('data', (chunk: string) => (text += chunk));
      answer.on('end', () => resolve({ status: answer.statusCode ?? 0, body: text }));
    });
    sent.on('error', reject);
    sent.end(body);
  });
}

const writeFile = (path: string, content: string): ScriptedAnswer => ({ toolCalls: [{ name: 'write_file', arguments: { path, content } }] });
const runCommand = (command: string): ScriptedAnswer => ({ toolCalls: [{ name: 'run_command', arguments: { command } }] });
const finish = (summary: string): ScriptedAnswer => ({ toolCalls: [{ name: 'finish', arguments: { summary } }] });

/**
 * A write_file call whose `tool_call` journal entry is exactly `entryBytes` long. With `full` permissions
 * each model call of the built-in loop journals tool_call, tool_result and usage, so call `step` (from 1,
 * of a fresh fake model: its tool call id is `call_<step>_0`) has its tool_call at 3·(step − 1) + 1.
 */
function writeFileOfEntrySize(step: number, path: string, entryBytes: number): { answer: ScriptedAnswer; sequence: number; content: string } {
  const sequence = 3 * (step - 1) + 1;
  const entry = (content: string) => Buffer.byteLength(JSON.stringify({ sequence, event: { kind: 'tool_call', data: { id: `call_${step}_0`, name: 'write_file', input: { path, content } } } }));
  const content = 'x'.repeat(entryBytes - entry(''));
  expect(entry(content)).toBe(entryBytes);
  return { answer: writeFile(path, content), sequence, content };
}

describe.each(testDrivers)('the runner protocol with faults injected per request, on %s', (driver) => {
  let api: TestApi;
  let serverOrigin = '';
  const cleanups: Array<() => Promise<unknown>> = [];

  beforeAll(async () => {
    api = await startTestApi(driver);
    await api.app.listen({ port: 0, host: '127.0.0.1' });
    serverOrigin = `http://127.0.0.1:${(api.app.server.address() as AddressInfo).port}`;
  });
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup().catch(() => undefined);
  });
  afterAll(async () => {
    await api?.close();
  });

  /** A paired runner home behind a fresh proxy, a fake model with `script`, and a way to start daemons. */
  async function setup(script: ScriptedAnswer[]) {
    const model = await startFakeModel(script, { models: ['fake-coder'] });
    cleanups.push(() => model.close());
    const proxy = await FaultProxy.start(serverOrigin);
    cleanups.push(() => proxy.close());
    const owner = await signedInUser(api);
    const home = new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-faults-home-'))).ensure();
    const project = await addProject(home, widgetsRepository());
    const env = runnerEnv(model.baseUrl);
    const server = `${proxy.origin}/api/v1`;
    const { receipt } = await pairFor(owner, home, env, server);
    const logs: string[] = [];
    const startDaemon = () => {
      const own: string[] = [];
      const log = (line: string) => {
        own.push(line);
        logs.push(line);
      };
      // A small, fixed jitter: retries come quickly and every run of the test waits alike.
      const daemon = new RunnerDaemon({ home, env, log, client: { random: () => 0.1 } });
      const running = daemon.run();
      const stop = async () => {
        daemon.stop();
        await running;
      };
      cleanups.push(() => stop());
      /** Resolves once this daemon found the server unreachable (its client logs the first retry). */
      const refused = () => waitFor('the daemon to find the server unreachable', async () => own.some((line) => /trying again/.test(line)));
      return { daemon, running, stop, refused };
    };
    const target = (permissionMode: 'full' | 'ask') => ({ runnerId: receipt.runnerId, projectId: project.id, permissionMode });
    const runIdOf = (taskId: string) => waitFor('the run to be claimed', async () => {
      const view = await taskView(owner, taskId);
      return view.latestJob.status === 'IN_PROGRESS' ? view.latestJob.id : null;
    });
    /**
     * A runner request made by hand with the current (or a given) credential, straight to the server: what
     * crossed the proxy stays what the runner sent.
     */
    const runnerRequest = async (method: 'GET' | 'POST', path: string, body?: unknown, credential = home.readConnection()!.credential) => {
      const response = await plainRequest(method, `${serverOrigin}/api/v1/runners${path}`, body === undefined ? undefined : JSON.stringify(body), { authorization: `Bearer ${credential}` });
      return { status: response.status, json: JSON.parse(response.body) as Record<string, unknown> };
    };
    return { model, proxy, owner, home, env, server, receipt, logs, startDaemon, target, runIdOf, runnerRequest };
  }

  it('claims again when the claim answer is lost, executes once, and refuses the first generation', async () => {
    const t = await setup([writeFile('widgets/a.txt', 'a\n'), finish('Done once.')]);
    t.proxy.on({ method: 'POST', path: '/claim', nth: 1, fault: { kind: 'dropAnswer' } });
    t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('ask'));
    // The run waits for its owner: it executes under the generation its runner received.
    await waitFor('the permission', async () => (await pendingRequests(t.owner, taskId)).length > 0);
    const runId = (await taskView(t.owner, taskId)).latestJob.id;

    const claims = t.proxy.find({ method: 'POST', path: `/runs/${runId}/claim` });
    expect(claims.map((claim) => [claim.fault, claim.status, claim.delivered])).toEqual([
      ['dropAnswer', 200, false],
      ['pass', 200, true],
    ]);
    expect(claims.map((claim) => (JSON.parse(claim.answer!) as { run: { generation: number } }).run.generation)).toEqual([1, 2]);
    const uploaded = t.proxy.find({ method: 'POST', path: EVENTS }).filter((exchange) => exchange.status === 200);
    expect(uploaded.flatMap((exchange) => batchesOf(exchange.body).map((batch) => batch.generation))).toEqual(uploaded.map(() => 2));

    // One recorded batch replayed under the first generation is refused; under the current one it is a
    // retry, acknowledged again: the refusal is the generation's.
    const batch = batchesOf(uploaded[0]!.body)[0]!;
    const stale = await t.runnerRequest('POST', '/events', { batches: [{ ...batch, generation: 1 }] });
    expect(stale.status).toBe(200);
    expect(stale.json.results).toEqual([{ runId, error: expect.objectContaining({ status: 409, details: expect.objectContaining({ reason: 'stale_generation' }) }) }]);
    const current = await t.runnerRequest('POST', '/events', { batches: [batch] });
    expect(current.json.results).toEqual([{ runId, acknowledgedSequence: batch.firstSequence + batch.events.length - 1 }]);
    const refusedDetails = async (path: string, body: unknown) => {
      const answer = await t.runnerRequest('POST', path, body);
      return [answer.status, (answer.json.error as { details?: unknown } | undefined)?.details];
    };
    const nextSequence = batch.firstSequence + batch.events.length;
    const part = { sequence: nextSequence, part: 0, data: Buffer.from('{').toString('base64'), ref: { type: 'event_ref', digest: '0'.repeat(64), sizeBytes: 300 * KiB } };
    expect(await refusedDetails(`/runs/${runId}/event-parts`, { ...part, generation: 1 })).toEqual([409, { generation: 2 }]);
    expect(await refusedDetails(`/runs/${runId}/syncing`, { generation: 1 })).toEqual([409, { generation: 2 }]);
    expect(await refusedDetails(`/runs/${runId}/complete`, { generation: 1, lastSequence: 0, processStopped: true, outcome: { status: 'failed' } })).toEqual([409, { generation: 2 }]);

    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Done once.']);
    // Each scripted model call was made once: nothing executed under the first generation.
    expect(t.model.requests).toHaveLength(2);
    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    expect(journal.filter((entry) => entry.kind === 'tool_call').map((entry) => (entry.data as { name: string }).name)).toEqual(['write_file', 'finish']);
    expect(journal.filter((entry) => entry.kind === 'final')).toHaveLength(1);
  });

  it('stores every sequence once, as the runner wrote it, when batches are duplicated, reordered, cut off and retried with other bytes', async () => {
    const t = await setup([runCommand('echo one'), runCommand('echo two'), runCommand('echo three'), runCommand('echo four'), finish('Four echoes.')]);
    const events = { method: 'POST', path: EVENTS } as const;
    t.proxy
      .on({ ...events, nth: 1, fault: { kind: 'duplicate' } })
      .on({ ...events, nth: 2, fault: { kind: 'dropAnswer' } })
      // The retry of the batch whose answer was lost, changed on the way: the server holds the original.
      .on({ ...events, nth: 3, fault: { kind: 'mutate', change: changeFirstEventText } })
      // Reset at once (the runner sends it again), it reaches the server after the batch that follows.
      .on({ ...events, nth: 4, fault: { kind: 'late', until: { ...events, nth: 2 } } })
      .on({ ...events, nth: 7, fault: { kind: 'cutOff' } });
    t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('ask'));
    // Each permission ends a stretch of events, so that every stretch has batches of its own.
    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Four echoes.']);
    const runId = view.latestJob.id;
    await t.proxy.waitFor('the late batch to reach the server', () => t.proxy.find(events).every((exchange) => exchange.settled));

    const uploads = t.proxy.find(events);
    expect(uploads.slice(0, 8).map((exchange) => exchange.fault), t.proxy.summary()).toEqual(['duplicate', 'dropAnswer', 'mutate', 'late', 'pass', 'pass', 'cutOff', 'pass']);
    const [duplicated, dropped, mutated, late, lateRetry, following, cut, cutRetry] = uploads as [Exchange, Exchange, Exchange, Exchange, Exchange, Exchange, Exchange, Exchange];

    // Duplicated: the same bytes twice, acknowledged twice alike.
    expect(duplicated.answers).toHaveLength(2);
    expect(duplicated.answers[1]).toEqual(duplicated.answers[0]);
    expect(resultsOf(duplicated)[0]).toHaveProperty('acknowledgedSequence');
    // The answer lost: the runner sent the very same bytes again, which the proxy changed; the server
    // refused them with the sequence it expects, and the runner went on from exactly there.
    expect([dropped.status, dropped.delivered]).toEqual([200, false]);
    expect(mutated.body).toBe(dropped.body);
    expect(mutated.forwardedBody).not.toBe(mutated.body);
    const refused = resultsOf(mutated)[0]!;
    expect(refused.error).toMatchObject({ status: 409, details: { expectedSequence: expect.any(Number) } });
    const expectedSequence = refused.error!.details!.expectedSequence as number;
    const droppedBatch = batchesOf(dropped.body)[0]!;
    expect(expectedSequence).toBe(droppedBatch.firstSequence + droppedBatch.events.length);
    expect(batchesOf(late.body)[0]!.firstSequence).toBe(expectedSequence);
    // Reordered: the stale copy reached the server after the batch that followed its retry, and was only a repeat.
    expect(lateRetry.body).toBe(late.body);
    expect(late.forwardedAt).toBeGreaterThan(following.forwardedAt!);
    expect(batchesOf(following.body)[0]!.firstSequence).toBeGreaterThan(batchesOf(late.body)[0]!.firstSequence);
    expect(resultsOf(late)[0]).toHaveProperty('acknowledgedSequence');
    // Cut off: the server never answered the partial body; the retry carried the whole.
    expect([cut.status, cut.delivered]).toEqual([null, false]);
    expect(cutRetry.body).toBe(cut.body);
    expect(resultsOf(cutRetry)[0]).toHaveProperty('acknowledgedSequence');

    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    expect(JSON.stringify(journal)).not.toContain('changed on the way');
    expect(journal.filter((entry) => entry.kind === 'tool_result')).toHaveLength(5);
  });

  it('completes a run whose server went away at syncing while the runner restarted: every event delivered, nothing executed twice', async () => {
    const t = await setup([runCommand('echo hi'), finish('Said hi.')]);
    // No event gets through before the run finished, and the server is gone from its `syncing` on.
    t.proxy.on({ method: 'POST', path: EVENTS, fault: { kind: 'refuse' } }).on({ method: 'POST', path: '/syncing', fault: { kind: 'down' } });
    const first = t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('full'));
    const runId = await t.runIdOf(taskId);
    await t.proxy.waitFor('syncing to be refused', () => t.proxy.find({ method: 'POST', path: '/syncing' }).length > 0);
    await first.stop();

    // Everything the run produced waits in its outbox, none of it acknowledged.
    const outbox = RunOutbox.inspect(t.home.runDir(runId));
    expect(outbox.acknowledgedSequence).toBe(0);
    expect(outbox.entries).toBe(outbox.lastSequence);
    expect(new RunRecords(t.home).read(runId)?.phase).toBe('finished');

    // A new daemon on the same home, while the server is still away.
    await t.startDaemon().refused();
    t.proxy.clearRules().up();

    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Said hi.']);
    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    expect(journal).toHaveLength(outbox.lastSequence);
    expect(journal.map((entry) => entry.kind)).not.toContain('error');
    const receipts = await t.proxy.waitFor('the receipt\'s answer', () => {
      const answered = t.proxy.find({ method: 'POST', path: `/runs/${runId}/complete` }).filter((exchange) => exchange.status === 200);
      return answered.length > 0 && answered;
    });
    expect(receipts.map((exchange) => JSON.parse(exchange.body) as { lastSequence: number; outcome: { status: string } })).toEqual([
      expect.objectContaining({ lastSequence: outbox.lastSequence, outcome: expect.objectContaining({ status: 'completed' }) }),
    ]);
    expect(t.proxy.find({ method: 'POST', path: '/claim' })).toHaveLength(1);
    expect(t.model.requests).toHaveLength(2);
  });

  it('finalizes once the run of a killed runner that reconnects, refuses the old credential, and takes new work on the same runner id', async () => {
    const t = await setup([runCommand('sleep 300'), finish('Fresh start.')]);
    const runner = await startRunnerProcess(t.home.dir, t.env);
    cleanups.push(async () => {
      runner.child.kill('SIGKILL');
      await runner.exited;
    });
    const taskId = await startLocalTask(t.owner, t.target('full'));
    const runId = await t.runIdOf(taskId);
    const records = new RunRecords(t.home);
    // Mid-run: the command's process group runs and is recorded.
    const groups = await waitFor('the command to run', async () => {
      const recorded = records.recordedGroups(runId);
      return recorded.length > 0 ? recorded : null;
    });
    cleanups.push(async () => {
      for (const pid of groups) if (groupExists(pid)) process.kill(-pid, 'SIGKILL');
    });
    runner.child.kill('SIGKILL');
    expect(await runner.exited).toBe('SIGKILL');
    // The daemon died; the group it started did not.
    expect(groups.every(groupExists)).toBe(true);

    const oldCredential = t.home.readConnection()!.credential;
    const revoked = await t.owner.request('POST', `/api/v1/runners/${t.receipt.runnerId}/revoke`);
    expect(revoked.statusCode, revoked.body).toBe(200);
    expect((await t.runnerRequest('GET', '/runs', undefined, oldCredential)).status).toBe(401);

    // Pairing again reconnects; its first answer is lost and the same enrollment is retried.
    t.proxy.on({ method: 'POST', path: '/enroll', nth: 1, fault: { kind: 'dropAnswer' } });
    const again = await pairFor(t.owner, t.home, t.env, t.server, { random: () => 0 });
    expect([again.reconnected, again.receipt.runnerId, again.receipt.finalizedRuns]).toEqual([true, t.receipt.runnerId, [runId]]);
    const enrollments = t.proxy.find({ method: 'POST', path: '/enroll' }).slice(1);
    expect(enrollments.map((exchange) => [exchange.fault, exchange.status, exchange.delivered])).toEqual([
      ['dropAnswer', 200, false],
      ['pass', 200, true],
    ]);
    expect(enrollments[1]!.body).toBe(enrollments[0]!.body);
    expect(JSON.parse(enrollments[1]!.answer!)).toEqual(JSON.parse(enrollments[0]!.answer!));
    // Reconnecting needs nothing of the old connection running: its group was stopped first.
    expect(groups.some(groupExists)).toBe(false);

    const failed = await taskView(t.owner, taskId);
    expect([failed.latestJob.id, failed.latestJob.status, failed.latestJob.error]).toEqual([runId, 'FAILED', RECONNECT_STOPPED_RUN]);
    const jobRow = async () => (await api.db.database.db.select().from(jobs).where(eq(jobs.id, runId)))[0];
    const finalized = await jobRow();
    // One more retry of the same enrollment: the same receipt, and nothing finalized again.
    const replayed = await plainRequest('POST', `${serverOrigin}/api/v1/runners/enroll`, enrollments[0]!.body);
    expect(replayed.status).toBe(200);
    expect(JSON.parse(replayed.body)).toEqual(JSON.parse(enrollments[0]!.answer!));
    expect(await jobRow()).toEqual(finalized);

    for (const path of ['/identity', '/runs']) expect((await t.runnerRequest('GET', path, undefined, oldCredential)).status, path).toBe(401);
    expect((await t.runnerRequest('GET', '/identity')).json).toMatchObject({ runnerId: t.receipt.runnerId, revoked: false });

    // No lockout: the same runner id takes and completes new work.
    const restarted = await startRunnerProcess(t.home.dir, t.env);
    cleanups.push(async () => {
      restarted.child.kill('SIGKILL');
      await restarted.exited;
    });
    expect(restarted.stderr()).toContain(`runner ${t.receipt.runnerId} for`);
    const next = await startLocalTask(t.owner, t.target('full'), 'Start over');
    const done = await finishAllowing(t.owner, next);
    expect([done.latestJob.status, done.latestJob.finalAnswer], restarted.stderr()).toEqual(['COMPLETED', 'Fresh start.']);
    expect((await taskView(t.owner, taskId)).latestJob.status).toBe('FAILED');
    restarted.child.kill('SIGTERM');
    expect(await restarted.exited).toBe(0);
  }, 120_000);

  it('sends events of 240 KiB − 1 and 240 KiB inline, 240 KiB + 1 in parts, and replaces one of 32 MiB + 1 before upload', async () => {
    const inlineLimit = RUNNER_LIMITS.inlineEventBytes;
    const calls = [
      writeFileOfEntrySize(1, 'widgets/below.txt', inlineLimit - 1),
      writeFileOfEntrySize(2, 'widgets/at.txt', inlineLimit),
      writeFileOfEntrySize(3, 'widgets/above.txt', inlineLimit + 1),
      writeFileOfEntrySize(4, 'widgets/huge.txt', RUNNER_LIMITS.logicalEventBytes + 1),
    ];
    const t = await setup([...calls.map((call) => call.answer), finish('Sizes written.')]);
    t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('full'));
    const view = await finishAllowing(t.owner, taskId, 120_000);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Sizes written.']);
    const runId = view.latestJob.id;
    const [below, at, above, huge] = calls as [(typeof calls)[number], (typeof calls)[number], (typeof calls)[number], (typeof calls)[number]];

    // What crossed: each inline event's entry size, and each reference.
    const inline = new Map<number, number>();
    const refs = new Map<number, number>();
    for (const exchange of t.proxy.find({ method: 'POST', path: EVENTS })) {
      for (const batch of batchesOf(exchange.body)) {
        batch.events.forEach((event, index) => {
          const sequence = batch.firstSequence + index;
          if (isRef(event)) refs.set(sequence, event.sizeBytes);
          else inline.set(sequence, Buffer.byteLength(JSON.stringify({ sequence, event })));
        });
      }
    }
    expect([inline.get(below.sequence), inline.get(at.sequence), inline.has(above.sequence)]).toEqual([inlineLimit - 1, inlineLimit, false]);
    expect([...refs]).toEqual([[above.sequence, inlineLimit + 1]]);
    const parts = t.proxy.find({ method: 'POST', path: PARTS }).map((exchange) => partOf(exchange.body));
    expect(parts.map((part) => [part.sequence, part.part, Buffer.from(part.data, 'base64').length])).toEqual([
      [above.sequence, 0, RUNNER_LIMITS.partDataBytes],
      [above.sequence, 1, inlineLimit + 1 - RUNNER_LIMITS.partDataBytes],
    ]);
    // The 32 MiB + 1 event never left the computer whole: far less than it crossed in all.
    const crossed = t.proxy.exchanges.reduce((sum, exchange) => sum + Buffer.byteLength(exchange.body), 0);
    expect(crossed).toBeLessThan(RUNNER_LIMITS.logicalEventBytes);
    expect(inline.get(huge.sequence)).toBeLessThan(inlineLimit);

    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    const contentAt = (sequence: number) => (journal.find((entry) => entry.sequence === sequence)!.data as { input: { content: string }; truncated?: boolean });
    expect([below, at, above].map((call) => contentAt(call.sequence).input.content === call.content)).toEqual([true, true, true]);
    const replaced = contentAt(huge.sequence);
    expect(replaced.truncated).toBe(true);
    expect(replaced.input.content.startsWith('x'.repeat(64 * KiB))).toBe(true);
    expect(replaced.input.content).toMatch(/more characters cut: the event was over the 32 MiB limit/);
  }, 180_000);

  it('stages a large event again after a part is dropped, repeated and corrupted on the way, and stores it intact once', async () => {
    const big = 'y'.repeat(700 * KiB);
    const t = await setup([writeFile('widgets/big.txt', big), finish('Big file written.')]);
    const part = (n: number) => (body: string) => partOf(body).part === n;
    t.proxy
      .on({ method: 'POST', path: PARTS, body: part(0), nth: 1, fault: { kind: 'dropAnswer' } })
      .on({ method: 'POST', path: PARTS, body: part(1), nth: 1, fault: { kind: 'duplicate' } })
      .on({ method: 'POST', path: PARTS, body: part(2), nth: 1, fault: { kind: 'mutate', change: flipPartByte } });
    t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('full'));
    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Big file written.']);
    const runId = view.latestJob.id;

    const parts = t.proxy.find({ method: 'POST', path: PARTS });
    const described = parts.map((exchange) => [partOf(exchange.body).part, exchange.fault, exchange.status, exchange.delivered]);
    // First round: part 0's answer lost and the part sent again, part 1 twice, part 2 changed; then the
    // reference is refused, and every part is staged again from the start.
    expect(described, t.proxy.summary()).toEqual([
      [0, 'dropAnswer', 200, false],
      [0, 'pass', 200, true],
      [1, 'duplicate', 200, true],
      [2, 'mutate', 200, true],
      [3, 'pass', 200, true],
      [0, 'pass', 200, true],
      [1, 'pass', 200, true],
      [2, 'pass', 200, true],
      [3, 'pass', 200, true],
    ]);
    expect(parts[2]!.answers.map((answer) => answer.body)).toEqual([parts[2]!.answers[0]!.body, parts[2]!.answers[0]!.body]);
    // The server dropped the parts when the digest did not match: the second round starts from nothing.
    const received = (exchange: Exchange) => (JSON.parse(exchange.answer!) as { receivedBytes: number }).receivedBytes;
    expect(received(parts[5]!)).toBe(RUNNER_LIMITS.partDataBytes);
    const refBatches = t.proxy.find({ method: 'POST', path: EVENTS }).filter((exchange) => batchesOf(exchange.body).some((batch) => batch.events.some(isRef)));
    expect(refBatches.map((exchange) => resultsOf(exchange)[0])).toEqual([
      { runId, error: expect.objectContaining({ status: 400, details: { issues: [{ field: 'events.0', message: expect.stringMatching(/do not match its digest; its parts were dropped/) }] } }) },
      { runId, acknowledgedSequence: 1 },
    ]);
    expect(refBatches[0]!.id).toBeLessThan(parts[5]!.id);

    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    expect((journal[0]!.data as { input: { content: string } }).input.content === big).toBe(true);
  });

  it('stores a large event once, intact, when the runner stops between its parts and a new one takes over', async () => {
    const big = 'z'.repeat(500 * KiB);
    const t = await setup([writeFile('widgets/big.txt', big), finish('Big file written.')]);
    const part = (n: number) => (body: string) => partOf(body).part === n;
    // The first part waits until the run finished executing (its `syncing` answered), so that the stop
    // comes while the run delivers; the server goes away at the second part.
    t.proxy
      .on({ method: 'POST', path: PARTS, body: part(0), nth: 1, fault: { kind: 'hold', until: { method: 'POST', path: '/syncing' } } })
      .on({ method: 'POST', path: PARTS, body: part(1), nth: 1, fault: { kind: 'down' } });
    const first = t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('full'));
    const runId = await t.runIdOf(taskId);
    await t.proxy.waitFor('the second part to be refused', () => t.proxy.find({ method: 'POST', path: PARTS, body: part(1) }).length > 0);
    await first.stop();
    expect(new RunRecords(t.home).read(runId)?.phase).toBe('synced');

    await t.startDaemon().refused();
    t.proxy.up();

    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Big file written.']);
    const firstParts = t.proxy.find({ method: 'POST', path: PARTS, body: part(0) });
    // Part 0 reached the server in both lives of the runner, the same bytes acknowledged twice.
    expect(firstParts.filter((exchange) => exchange.status === 200).map((exchange) => exchange.body)).toEqual([firstParts[0]!.body, firstParts[0]!.body]);
    const journal = await journalOf(t.owner, taskId);
    expectJournalIsWhatTheRunnerSent(journal, runId, sentByRunner(t.proxy, runId));
    expect(journal.filter((entry) => entry.kind === 'tool_call' && (entry.data as { name: string }).name === 'write_file')).toHaveLength(1);
    expect((journal[0]!.data as { input: { content: string } }).input.content === big).toBe(true);
    expect(journal.map((entry) => (entry.data as { message?: string }).message)).not.toContain(STOPPED_WHILE_EXECUTING);
    expect(t.model.requests).toHaveLength(2);
  });

  it('delivers a control whose answer was lost, or that was answered while the server was unreachable, with the first signals request after reconnecting', async () => {
    const t = await setup([writeFile('widgets/a.txt', 'a\n'), writeFile('widgets/b.txt', 'b\n'), finish('Asked twice and done.')]);
    t.startDaemon();
    const taskId = await startLocalTask(t.owner, t.target('ask'));
    const runId = await t.runIdOf(taskId);
    const names = (exchange: Exchange) => (JSON.parse(exchange.body) as { runs: Array<{ runId: string }> }).runs.some((run) => run.runId === runId);
    const signals = () => t.proxy.find({ method: 'POST', path: '/signals' });
    const nextPermission = (answered: Set<string>) =>
      waitFor('a permission', async () => (await pendingRequests(t.owner, taskId)).find((request) => !answered.has(request.requestId)));
    const waitingPoll = () => t.proxy.waitFor('a long poll that names the run', () => signals().find((exchange) => !exchange.settled && exchange.forwardedAt !== null && names(exchange)));
    const firstSignalsAfter = (forwarded: number) =>
      t.proxy.waitFor('a signals answer after reconnecting', () => {
        const first = signals()
          .filter((exchange) => exchange.forwardedAt !== null && exchange.forwardedAt > forwarded)
          .sort((a, b) => a.forwardedAt! - b.forwardedAt!)[0];
        return first?.settled && first;
      });
    const answered = new Set<string>();
    const allow = async (requestId: string) => {
      answered.add(requestId);
      const response = await t.owner.request('POST', `/api/v1/tasks/${taskId}/permissions/${requestId}`, { decision: 'allow' });
      expect(response.statusCode, response.body).toBe(200);
    };
    const control = (sequence: number, requestId: string) => ({ runId, sequence, message: { type: 'permission', requestId, decision: 'allow' } });

    // 1. The long poll that carries the answer loses it on the way back: the server sent it, the runner
    // never got it, and its next poll carries it again.
    const first = await nextPermission(answered);
    const carrying = await waitingPoll();
    t.proxy.loseAnswer(carrying);
    await allow(first.requestId);
    await t.proxy.waitFor('the lost answer', () => carrying.settled);
    expect([carrying.status, carrying.delivered]).toEqual([200, false]);
    expect(JSON.parse(carrying.answer!)).toMatchObject({ controls: [control(1, first.requestId)] });
    const retried = await firstSignalsAfter(carrying.forwardedAt!);
    expect(names(retried)).toBe(true);
    expect(JSON.parse(retried.answer!)).toMatchObject({ controls: [control(1, first.requestId)] });

    // 2. The network goes while the run waits again: the waiting poll is cut, and the owner answers meanwhile.
    const second = await nextPermission(answered);
    const cut = await waitingPoll();
    t.proxy.down();
    await allow(second.requestId);
    const back = t.proxy.forwardedCount;
    t.proxy.up();
    const afterBack = await firstSignalsAfter(back);
    expect([cut.fault, cut.delivered]).toEqual(['down', false]);
    expect(names(afterBack)).toBe(true);
    expect(JSON.parse(afterBack.answer!)).toMatchObject({ controls: [control(2, second.requestId)] });

    const view = await finishAllowing(t.owner, taskId);
    expect([view.latestJob.status, view.latestJob.finalAnswer], t.logs.join('\n')).toEqual(['COMPLETED', 'Asked twice and done.']);
    expect(t.model.requests).toHaveLength(3);
  });
});
