/**
 * The runner's durable outbox and its upload, against a small real HTTP peer written here that keeps a
 * journal per run the way docs/runner-protocol.md describes POST /events and event parts (sequences,
 * retries with identical content, `expectedSequence`, parts joined and checked by digest).
 */
import { createHash, randomUUID } from 'node:crypto';
import { appendFileSync, mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import type { FileHandle } from 'node:fs/promises';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { RUNNER_LIMITS, type EventPartBody, type RunnerEvent } from '../src/protocol/runner.js';
import { RunnerClient } from '../src/runner/client.js';
import { silentLog } from '../src/runner/log.js';
import { OutboxCorruptError, RunOutbox } from '../src/runner/outbox.js';
import { entryLine, sendableEntry } from '../src/runner/parts.js';
import { Uploader, type UploaderOptions } from '../src/runner/upload.js';

const KiB = 1024;
const CREDENTIAL = `service_runner_${'b'.repeat(43)}`;

const dirs: string[] = [];
function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), 'svc-outbox-'));
  dirs.push(dir);
  return dir;
}

const opened: RunOutbox[] = [];
/** Opens an outbox that the test's end closes (closing twice is harmless). */
async function openOutbox(dir: string, eventsStored: number): Promise<RunOutbox> {
  const outbox = await RunOutbox.open(dir, eventsStored);
  opened.push(outbox);
  return outbox;
}

const event = (n: number): RunnerEvent => ({ kind: 'message', data: { text: `step ${n}` } });

/** A `tool_result` event whose journal entry at `sequence` is exactly `bytes` long. */
function eventOfEntrySize(sequence: number, bytes: number): RunnerEvent {
  const overhead = Buffer.byteLength(entryLine(sequence, { kind: 'tool_result', data: { output: '' } }));
  return { kind: 'tool_result', data: { output: 'x'.repeat(bytes - overhead) } };
}

interface BatchError {
  status: number;
  message: string;
  details?: unknown;
}

/** The peer: a journal per run, raw request bodies, part requests, and per-run scripted refusals. */
class JournalPeer {
  readonly journals = new Map<string, string[]>();
  readonly bodies: string[] = [];
  readonly parts: EventPartBody[] = [];
  readonly refusals = new Map<string, BatchError[]>();
  /** Drops the connection of these /events requests (by number, from 1) without answering. */
  readonly dropRequests = new Set<number>();
  /** Refuses a whole /events request holding a batch of one of these runs, as a 400 naming no run. */
  readonly poisoned = new Set<string>();
  private readonly staged = new Map<string, Buffer[]>();
  private server: Server | null = null;
  baseUrl = '';

  journal(runId: string): string[] {
    if (!this.journals.has(runId)) this.journals.set(runId, []);
    return this.journals.get(runId)!;
  }

  async start(): Promise<void> {
    this.server = createServer(async (request, response) => {
      let text = '';
      for await (const chunk of request) text += chunk;
      const answer = (status: number, payload: unknown) => response.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(payload));
      const part = /^\/api\/v1\/runners\/runs\/([^/]+)\/event-parts$/.exec(request.url ?? '');
      if (part) {
        const body = JSON.parse(text) as EventPartBody;
        this.parts.push(body);
        const key = `${part[1]}:${body.sequence}`;
        const staged = this.staged.get(key) ?? [];
        staged[body.part] = Buffer.from(body.data, 'base64');
        this.staged.set(key, staged);
        return answer(200, { runId: part[1], sequence: body.sequence, part: body.part, receivedBytes: staged.reduce((sum, data) => sum + data.length, 0) });
      }
      if (request.url !== '/api/v1/runners/events') return answer(404, { error: { code: 'not_found', message: 'no such route' } });
      this.bodies.push(text);
      if (this.dropRequests.has(this.bodies.length)) return void request.socket.destroy();
      const { batches } = JSON.parse(text) as { batches: Array<{ runId: string; firstSequence: number; events: unknown[] }> };
      if (batches.some((batch) => this.poisoned.has(batch.runId))) return answer(400, { error: { code: 'validation_failed', message: 'the request holds an event the server cannot read' } });
      answer(200, { results: batches.map((batch) => this.accept(batch)) });
    });
    await new Promise<void>((resolve) => this.server!.listen(0, '127.0.0.1', resolve));
    this.baseUrl = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}/api/v1`;
  }

  private accept(batch: { runId: string; firstSequence: number; events: unknown[] }) {
    const refusal = this.refusals.get(batch.runId)?.shift();
    if (refusal) return { runId: batch.runId, error: refusal };
    const journal = this.journal(batch.runId);
    let events = batch.events;
    const first = events[0] as { type?: string; digest?: string; sizeBytes?: number };
    if (first?.type === 'event_ref') {
      const entry = Buffer.concat(this.staged.get(`${batch.runId}:${batch.firstSequence}`) ?? []);
      const digest = createHash('sha256').update(entry).digest('hex');
      if (events.length !== 1 || entry.length !== first.sizeBytes || digest !== first.digest) {
        return { runId: batch.runId, error: { status: 400, message: 'the parts do not match the reference' } };
      }
      const parsed = JSON.parse(entry.toString('utf8')) as { sequence: number; event: unknown };
      if (parsed.sequence !== batch.firstSequence) return { runId: batch.runId, error: { status: 400, message: 'wrong sequence' } };
      events = [parsed.event];
    }
    const expected = { status: 409, message: 'sequence conflict', details: { expectedSequence: journal.length + 1 } };
    if (batch.firstSequence > journal.length + 1) return { runId: batch.runId, error: expected };
    for (const [index, item] of events.entries()) {
      const sequence = batch.firstSequence + index;
      const content = JSON.stringify(item);
      if (sequence <= journal.length) {
        if (journal[sequence - 1] !== content) return { runId: batch.runId, error: expected };
      } else {
        journal.push(content);
      }
    }
    return { runId: batch.runId, acknowledgedSequence: batch.firstSequence + events.length - 1 };
  }

  close(): Promise<void> {
    return new Promise((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }
}

let peers: JournalPeer[] = [];
const uploaders: Uploader[] = [];
afterEach(async () => {
  for (const uploader of uploaders.splice(0)) uploader.stop();
  for (const outbox of opened.splice(0)) await outbox.close().catch(() => undefined);
  await Promise.all(peers.map((peer) => peer.close()));
  peers = [];
});

async function startPeer(): Promise<JournalPeer> {
  const peer = new JournalPeer();
  await peer.start();
  peers.push(peer);
  return peer;
}

function uploaderFor(peer: JournalPeer, options: Partial<UploaderOptions> & { signal?: AbortSignal; sleep?: (ms: number) => Promise<void> } = {}) {
  const fatal: unknown[] = [];
  const { signal, sleep, ...rest } = options;
  const client = new RunnerClient({ baseUrl: peer.baseUrl, credential: CREDENTIAL, random: () => 0, sleep: sleep ?? (async () => undefined), ...(signal ? { signal } : {}) });
  const uploader = new Uploader({ client, log: silentLog, onFatal: (error) => fatal.push(error), random: () => 0, ...rest });
  uploaders.push(uploader);
  return { uploader, fatal };
}

describe('the outbox on disk', () => {
  it('numbers entries after eventsStored, drops them only when acknowledged, and survives a reopen', async () => {
    const dir = tempDir();
    const outbox = await openOutbox(dir, 3);
    expect(await outbox.append(event(1))).toBe(4);
    expect(await outbox.append(event(2))).toBe(5);
    expect(await outbox.append(event(3))).toBe(6);
    const lines = outbox.pending().map((entry) => entry.line);
    expect(lines[0]).toBe('{"sequence":4,"event":{"kind":"message","data":{"text":"step 1"}}}');
    await outbox.close();

    const reopened = await openOutbox(dir, 0);
    expect(reopened.pending().map((entry) => entry.line)).toEqual(lines);
    expect([reopened.acknowledgedSequence, reopened.lastSequence]).toEqual([3, 6]);
    await reopened.acknowledge(5);
    expect(reopened.pending().map((entry) => entry.sequence)).toEqual([6]);
    await reopened.close();

    const again = await openOutbox(dir, 0);
    expect(again.pending().map((entry) => entry.line)).toEqual([lines[2]]);
    expect(RunOutbox.inspect(dir)).toEqual({ acknowledgedSequence: 5, lastSequence: 6, entries: 1, bytes: Buffer.byteLength(lines[2]!) });
    await again.acknowledge(6);
    expect(readFileSync(join(dir, 'events.jsonl'), 'utf8')).toBe('');
    expect(await again.append(event(4))).toBe(7);
    await again.close();
    expect((await openOutbox(dir, 0)).pending().map((entry) => entry.sequence)).toEqual([7]);
  });

  it('cuts off a line torn by a crash while it was written, and goes on after the last whole one', async () => {
    const dir = tempDir();
    const outbox = await openOutbox(dir, 0);
    await outbox.append(event(1));
    await outbox.close();
    appendFileSync(join(dir, 'events.jsonl'), '{"sequence":2,"event":{"kind":"mess');
    const reopened = await openOutbox(dir, 0);
    expect(reopened.pending().map((entry) => entry.sequence)).toEqual([1]);
    expect(await reopened.append(event(2))).toBe(2);
    await reopened.close();
    expect(readFileSync(join(dir, 'events.jsonl'), 'utf8').split('\n')).toEqual([entryLine(1, event(1)), entryLine(2, event(2)), '']);
  });

  it('checks each line whole on reopening: a last line that is not JSON is cut off, a torn write in front of an entry is dropped, damage before entries is refused', async () => {
    const dir = tempDir();
    const path = join(dir, 'events.jsonl');
    const outbox = await openOutbox(dir, 0);
    await outbox.append(event(1));
    await outbox.close();
    // The right shape at both ends, but not JSON: never a whole entry, so never sent.
    appendFileSync(path, '{"sequence":2,"event":{"kind":"message","data":{"text":"ste}\n');
    const reopened = await openOutbox(dir, 0);
    expect(reopened.pending().map((entry) => entry.line)).toEqual([entryLine(1, event(1))]);
    expect(await reopened.append(event(2))).toBe(2);
    await reopened.close();
    expect(readFileSync(path, 'utf8')).toBe(`${entryLine(1, event(1))}\n${entryLine(2, event(2))}\n`);

    // An older runner appended the retry of a torn write right behind its bytes.
    appendFileSync(path, `{"sequence":3,"event":{"kind":"mes${entryLine(3, event(3))}\n`);
    const repaired = await openOutbox(dir, 0);
    expect(repaired.pending().map((entry) => entry.sequence)).toEqual([1, 2, 3]);
    await repaired.close();
    expect(readFileSync(path, 'utf8')).toBe([1, 2, 3].map((n) => `${entryLine(n, event(n))}\n`).join(''));

    appendFileSync(path, `{"sequence":4,"event":{"kind":"mes}\n${entryLine(5, event(5))}\n`);
    await expect(RunOutbox.open(dir, 0)).rejects.toMatchObject({ name: 'OutboxCorruptError' });
    expect(() => RunOutbox.inspect(dir)).toThrow(/line 4 is not a whole/);
  });

  it('tells damage from a read that fails: only a marker or line that is not what it must be is OutboxCorruptError', async () => {
    const unreadable = tempDir();
    // acked.json cannot be read (EISDIR here; EMFILE or EIO alike): no damage, the error as it is.
    mkdirSync(join(unreadable, 'acked.json'));
    const failed = await RunOutbox.open(unreadable, 0).catch((error: unknown) => error);
    expect(failed).toMatchObject({ code: 'EISDIR' });
    expect(failed).not.toBeInstanceOf(OutboxCorruptError);

    for (const marker of ['{"acknowledged":', 'null', '{"acknowledged":-1}']) {
      const damaged = tempDir();
      writeFileSync(join(damaged, 'acked.json'), marker);
      await expect(RunOutbox.open(damaged, 0)).rejects.toBeInstanceOf(OutboxCorruptError);
    }
  });

  it('cuts a write that fails part-way back to the last whole line, and refuses appends once that cannot be done', async () => {
    const dir = tempDir();
    const path = join(dir, 'events.jsonl');
    const outbox = await openOutbox(dir, 0);
    await outbox.append(event(1));
    // The disk fills up in the middle of the next line: half of it reaches the file.
    const handle = (outbox as unknown as { handle: FileHandle }).handle;
    const appendFile = handle.appendFile.bind(handle);
    const full = Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });
    const tornWrite = async (data: string | Uint8Array) => {
      await appendFile(String(data).slice(0, 20));
      throw full;
    };
    handle.appendFile = tornWrite;
    await expect(outbox.append(event(2))).rejects.toBe(full);
    expect(readFileSync(path, 'utf8')).toBe(`${entryLine(1, event(1))}\n`);
    expect(outbox.lastSequence).toBe(1);
    handle.appendFile = appendFile;
    expect(await outbox.append(event(2))).toBe(2);
    expect(readFileSync(path, 'utf8')).toBe(`${entryLine(1, event(1))}\n${entryLine(2, event(2))}\n`);

    // Cutting back fails too: nothing more is written behind the torn bytes until a reopen repairs them.
    const truncate = handle.truncate.bind(handle);
    handle.appendFile = tornWrite;
    handle.truncate = async () => {
      throw full;
    };
    await expect(outbox.append(event(3))).rejects.toBe(full);
    handle.appendFile = appendFile;
    handle.truncate = truncate;
    await expect(outbox.append(event(3))).rejects.toMatchObject({ name: 'OutboxBrokenError' });
    await outbox.close();
    const reopened = await openOutbox(dir, 0);
    expect(reopened.pending().map((entry) => entry.sequence)).toEqual([1, 2]);
    expect(await reopened.append(event(3))).toBe(3);
    expect(readFileSync(path, 'utf8')).toBe([1, 2, 3].map((n) => `${entryLine(n, event(n))}\n`).join(''));
  });

  it('replaces an event over 32 MiB before writing it, keeping its kind and shape', async () => {
    const dir = tempDir();
    const outbox = await openOutbox(dir, 0);
    const huge = { kind: 'tool_result', data: { id: 'call_1', name: 'run_command', output: 'y'.repeat(33 * 1024 * 1024), isError: false } };
    await outbox.append(huge);
    const [entry] = outbox.pending();
    expect(entry!.bytes).toBeLessThanOrEqual(RUNNER_LIMITS.logicalEventBytes);
    const stored = JSON.parse(entry!.line) as { sequence: number; event: { kind: string; data: { output: string; truncated: boolean; name: string } } };
    expect(stored.sequence).toBe(1);
    expect(stored.event.kind).toBe('tool_result');
    expect(stored.event.data).toMatchObject({ name: 'run_command', truncated: true });
    expect(stored.event.data.output).toMatch(/^y+\n… \(\d+ more characters cut: the event was over the 32 MiB limit of one event\)$/);
    await outbox.close();

    // Exactly 32 MiB is sendable as it is; what stays too large once its strings are cut becomes a note.
    const limit = eventOfEntrySize(1, RUNNER_LIMITS.logicalEventBytes);
    expect(sendableEntry(1, limit).event).toBe(limit);
    const many = { kind: 'commands', data: { entries: Array.from({ length: 3_500_000 }, () => 'abcdefghij') } };
    const note = sendableEntry(1, many);
    expect(note.event).toEqual({ kind: 'commands', data: { truncated: true, sizeBytes: Buffer.byteLength(entryLine(1, many)), message: 'this commands event was over the 32 MiB limit of one event and was left out' } });
  });
});

describe('uploading the outbox', () => {
  it('resends the very same bytes after a lost answer, within one life and after a restart', async () => {
    const peer = await startPeer();
    const runId = randomUUID();
    const dir = tempDir();
    const outbox = await openOutbox(dir, 0);
    for (let n = 1; n <= 3; n++) await outbox.append(event(n));

    peer.dropRequests.add(1);
    const first = uploaderFor(peer);
    first.uploader.add({ runId, generation: 2, outbox });
    await first.uploader.whenDelivered(runId);
    expect(peer.bodies).toHaveLength(2);
    expect(peer.bodies[1]).toBe(peer.bodies[0]);
    expect(JSON.parse(peer.bodies[0]!)).toEqual({ batches: [{ runId, generation: 2, firstSequence: 1, events: [event(1), event(2), event(3)] }] });
    expect(outbox.pending()).toEqual([]);
    first.uploader.stop();

    // A new life: the answer to its batch is lost and the runner stops; the next one sends the same bytes.
    for (let n = 4; n <= 5; n++) await outbox.append(event(n));
    peer.dropRequests.add(3);
    const stopping = new AbortController();
    const second = uploaderFor(peer, { signal: stopping.signal, sleep: async () => stopping.abort(new Error('stopping')) });
    second.uploader.add({ runId, generation: 2, outbox });
    await expect(second.uploader.whenDelivered(runId)).rejects.toThrow();
    await outbox.close();
    const reopened = await openOutbox(dir, 0);
    const third = uploaderFor(peer);
    third.uploader.add({ runId, generation: 2, outbox: reopened });
    await third.uploader.whenDelivered(runId);
    expect(peer.bodies).toHaveLength(4);
    expect(peer.bodies[3]).toBe(peer.bodies[2]);
    expect(peer.journal(runId)).toEqual([1, 2, 3, 4, 5].map((n) => JSON.stringify(event(n))));
    expect(RunOutbox.inspect(dir).entries).toBe(0);
  });

  it('takes expectedSequence as acknowledging what the server holds, and goes on from there', async () => {
    const peer = await startPeer();
    const runId = randomUUID();
    // The server holds five events already (sent by an earlier life whose acknowledgement was lost).
    peer.journal(runId).push(...[1, 2, 3, 4, 5].map((n) => JSON.stringify({ kind: 'message', data: { text: `held ${n}` } })));
    const outbox = await openOutbox(tempDir(), 0);
    for (let n = 1; n <= 8; n++) await outbox.append(event(n));
    const { uploader, fatal } = uploaderFor(peer);
    uploader.add({ runId, generation: 1, outbox });
    await uploader.whenDelivered(runId);
    expect(peer.bodies.map((body) => (JSON.parse(body) as { batches: Array<{ firstSequence: number }> }).batches[0]!.firstSequence)).toEqual([1, 6]);
    expect(peer.journal(runId).slice(5)).toEqual([6, 7, 8].map((n) => JSON.stringify(event(n))));
    expect(outbox.acknowledgedSequence).toBe(8);
    expect(fatal).toEqual([]);
  });

  it('sends an entry of exactly 240 KiB inline and one of 240 KiB + 1 byte in parts of at most 192 KiB', async () => {
    const peer = await startPeer();
    const runId = randomUUID();
    const outbox = await openOutbox(tempDir(), 0);
    const inline = eventOfEntrySize(1, 240 * KiB);
    const large = eventOfEntrySize(2, 240 * KiB + 1);
    await outbox.append(inline);
    await outbox.append(large);
    const largeEntry = Buffer.from(outbox.pending()[1]!.line, 'utf8');
    expect(Buffer.byteLength(outbox.pending()[0]!.line)).toBe(240 * KiB);
    expect(largeEntry.length).toBe(240 * KiB + 1);

    const { uploader } = uploaderFor(peer);
    uploader.add({ runId, generation: 4, outbox });
    await uploader.whenDelivered(runId);

    const bodies = peer.bodies.map((body) => JSON.parse(body) as { batches: Array<{ firstSequence: number; events: unknown[] }> });
    expect(bodies).toHaveLength(2);
    expect(bodies[0]!.batches).toEqual([{ runId, generation: 4, firstSequence: 1, events: [inline] }]);
    const digest = createHash('sha256').update(largeEntry).digest('hex');
    expect(bodies[1]!.batches).toEqual([{ runId, generation: 4, firstSequence: 2, events: [{ type: 'event_ref', digest, sizeBytes: 240 * KiB + 1 }] }]);
    expect(peer.parts.map((part) => [part.sequence, part.part, part.generation])).toEqual([
      [2, 0, 4],
      [2, 1, 4],
    ]);
    const decoded = peer.parts.map((part) => Buffer.from(part.data, 'base64'));
    for (const data of decoded) expect(data.length).toBeLessThanOrEqual(RUNNER_LIMITS.partDataBytes);
    expect(Buffer.concat(decoded).equals(largeEntry)).toBe(true);
    for (const part of peer.parts) expect(part.ref).toEqual({ type: 'event_ref', digest, sizeBytes: largeEntry.length });
    expect(peer.journal(runId)).toEqual([JSON.stringify(inline), JSON.stringify(large)]);
  });

  it('keeps every request within 4 MiB, carries several runs per request, and delivers each in order', async () => {
    const peer = await startPeer();
    const runs = [randomUUID(), randomUUID()];
    const outboxes = await Promise.all(runs.map(() => openOutbox(tempDir(), 0)));
    const big = (run: number, n: number): RunnerEvent => ({ kind: 'tool_result', data: { run, n, output: 'z'.repeat(200 * KiB) } });
    for (const [index, outbox] of outboxes.entries()) for (let n = 1; n <= 30; n++) await outbox.append(big(index, n));
    const { uploader } = uploaderFor(peer);
    for (const [index, runId] of runs.entries()) uploader.add({ runId, generation: 1, outbox: outboxes[index]! });
    await Promise.all(runs.map((runId) => uploader.whenDelivered(runId)));
    for (const body of peer.bodies) expect(Buffer.byteLength(body)).toBeLessThanOrEqual(RUNNER_LIMITS.eventBatchBytes);
    expect(peer.bodies.some((body) => (JSON.parse(body) as { batches: unknown[] }).batches.length === 2)).toBe(true);
    for (const [index, runId] of runs.entries()) expect(peer.journal(runId)).toEqual(Array.from({ length: 30 }, (_, n) => JSON.stringify(big(index, n + 1))));
  });

  it("backs off one run's refusal while the others go on, and drops a run the server does not have", async () => {
    const peer = await startPeer();
    const [refused, fine, gone] = [randomUUID(), randomUUID(), randomUUID()];
    peer.refusals.set(refused, [{ status: 409, message: 'generation 1 is not current', details: { generation: 2 } }]);
    peer.refusals.set(gone, [{ status: 404, message: 'Run not found' }]);
    const outboxes = await Promise.all([0, 1, 2].map(() => openOutbox(tempDir(), 0)));
    for (const outbox of outboxes) await outbox.append(event(1));
    const refusedRuns: string[] = [];
    const goneRuns: string[] = [];
    const { uploader } = uploaderFor(peer, { onRefused: (runId) => refusedRuns.push(runId), onGone: (runId) => goneRuns.push(runId) });
    uploader.add({ runId: refused, generation: 1, outbox: outboxes[0]! });
    uploader.add({ runId: fine, generation: 1, outbox: outboxes[1]! });
    uploader.add({ runId: gone, generation: 1, outbox: outboxes[2]! });
    const abandoned = uploader.whenDelivered(gone).catch((error: unknown) => error);
    await uploader.whenDelivered(fine);
    await uploader.whenDelivered(refused);
    expect(refusedRuns).toEqual([refused]);
    expect(goneRuns).toEqual([gone]);
    expect(await abandoned).toMatchObject({ name: 'UploadAbandonedError' });
    expect(outboxes[2]!.pending()).toHaveLength(1);
    expect(peer.journal(refused)).toEqual([JSON.stringify(event(1))]);
  });

  it("sends each run's batch alone after a whole request is refused for what it holds: only the run that causes it waits", async () => {
    const peer = await startPeer();
    const [poisoned, fine] = [randomUUID(), randomUUID()];
    peer.poisoned.add(poisoned);
    const outboxes = await Promise.all([0, 1].map(() => openOutbox(tempDir(), 0)));
    for (const outbox of outboxes) await outbox.append(event(1));
    const { uploader, fatal } = uploaderFor(peer, { random: () => 0.5 });
    uploader.add({ runId: poisoned, generation: 1, outbox: outboxes[0]! });
    uploader.add({ runId: fine, generation: 1, outbox: outboxes[1]! });
    await uploader.whenDelivered(fine);
    const runsOf = (body: string) => (JSON.parse(body) as { batches: Array<{ runId: string }> }).batches.map((batch) => batch.runId);
    expect(runsOf(peer.bodies[0]!)).toEqual([poisoned, fine]);
    // Later events of the other run go on being delivered, while the refused one keeps its own.
    await outboxes[1]!.append(event(2));
    await uploader.whenDelivered(fine);
    expect(peer.journal(fine)).toEqual([1, 2].map((n) => JSON.stringify(event(n))));
    expect(outboxes[0]!.pending()).toHaveLength(1);
    expect(peer.journal(poisoned)).toEqual([]);
    expect(fatal).toEqual([]);
  });
});
