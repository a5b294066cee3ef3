import { describe, expect, it } from 'vitest';
import { finishJob, startJob } from '../src/engine/jobs.js';
import { appendEvents } from '../src/store/journal.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

interface SseMessage {
  id?: string;
  event?: string;
  data: string;
}

function parseSse(text: string): SseMessage[] {
  return text
    .split('\n\n')
    .filter((block) => block.trim() && !block.startsWith(':'))
    .map((block) => {
      const message: SseMessage = { data: '' };
      for (const line of block.split('\n')) {
        const [field, ...rest] = line.split(': ');
        const value = rest.join(': ');
        if (field === 'id') message.id = value;
        else if (field === 'event') message.event = value;
        else if (field === 'data') message.data += value;
      }
      return message;
    });
}

describe.each(testDrivers)('the job journal and the logs stream on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  const db = () => api.db.database.db;

  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  async function runningTask() {
    const { task, job } = (await tenant.request('POST', '/api/v1/tasks', { command: 'log me' })).json();
    const started = await startJob(db(), job.id);
    return { task, job: started! };
  }

  it('appends in order, acknowledges identical retries and refuses changed, gapped or stale batches', async () => {
    const { job } = await runningTask();
    const base = { jobId: job.id, generation: job.generation };
    const first = [{ kind: 'message', data: { text: 'hello' } }, { kind: 'tool_call', data: { name: 'shell', args: ['ls'] } }];
    expect(await appendEvents(db(), { ...base, firstSequence: 1, events: first })).toEqual({ ok: true, acknowledgedSequence: 2 });
    expect(await appendEvents(db(), { ...base, firstSequence: 1, events: first })).toEqual({ ok: true, acknowledgedSequence: 2 });
    // A retry that overlaps and extends: the stored part must match, the rest is appended.
    expect(await appendEvents(db(), { ...base, firstSequence: 2, events: [first[1]!, { kind: 'message', data: { text: 'more' } }] })).toEqual({
      ok: true,
      acknowledgedSequence: 3,
    });
    expect(await appendEvents(db(), { ...base, firstSequence: 1, events: [{ kind: 'message', data: { text: 'HELLO' } }] })).toMatchObject({
      ok: false,
      reason: 'sequence_conflict',
      expectedSequence: 4,
    });
    expect(await appendEvents(db(), { ...base, firstSequence: 6, events: first })).toMatchObject({ ok: false, reason: 'sequence_conflict', expectedSequence: 4 });
    expect(await appendEvents(db(), { ...base, generation: job.generation - 1, firstSequence: 4, events: first })).toMatchObject({
      ok: false,
      reason: 'stale_generation',
    });

    await finishJob(db(), job.id, job.generation, { status: 'COMPLETED' });
    expect(await appendEvents(db(), { ...base, firstSequence: 3, events: [{ kind: 'message', data: { text: 'more' } }] })).toEqual({
      ok: true,
      acknowledgedSequence: 3,
    });
    expect(await appendEvents(db(), { ...base, firstSequence: 4, events: first })).toMatchObject({ ok: false, reason: 'not_running' });
  });

  it('streams the journal as SSE, resumes after Last-Event-ID, and ends', async () => {
    const { task, job } = await runningTask();
    const events = Array.from({ length: 5 }, (_, index) => ({ kind: 'message', data: { index } }));
    await appendEvents(db(), { jobId: job.id, generation: job.generation, firstSequence: 1, events });

    const all = await tenant.request('GET', `/api/v1/tasks/${task.slug}/logs`);
    expect(all.statusCode).toBe(200);
    expect(all.headers['content-type']).toMatch(/^text\/event-stream/);
    const messages = parseSse(all.body);
    expect(messages.at(-1)).toEqual({ event: 'end', data: '{}' });
    const data = messages.slice(0, -1).map((message) => JSON.parse(message.data));
    expect(data.map((entry) => entry.sequence)).toEqual([1, 2, 3, 4, 5]);
    expect(data[2]).toMatchObject({ jobId: job.id, kind: 'message', data: { index: 2 }, createdAt: expect.any(String) });
    const ids = messages.slice(0, -1).map((message) => Number(message.id));
    expect([...ids].sort((a, b) => a - b)).toEqual(ids);

    const resumed = await api.app.inject({
      method: 'GET',
      url: `/api/v1/tasks/${task.id}/logs`,
      headers: { ...tenant.headers, 'last-event-id': String(ids[2]) },
    });
    expect(parseSse(resumed.body).slice(0, -1).map((message) => JSON.parse(message.data).sequence)).toEqual([4, 5]);
    const byQuery = await tenant.request('GET', `/api/v1/tasks/${task.id}/logs?lastEventId=${ids[4]}`);
    expect(parseSse(byQuery.body)).toEqual([{ event: 'end', data: '{}' }]);

    const bad = await tenant.request('GET', `/api/v1/tasks/${task.id}/logs?lastEventId=abc`);
    expect(bad.statusCode).toBe(400);
    expect(bad.json().error.details.issues[0].field).toBe('lastEventId');
    const stranger = await api.newTenant();
    expect((await stranger.request('GET', `/api/v1/tasks/${task.id}/logs`)).statusCode).toBe(404);
  });

  it('follows a running task over HTTP until it is idle', async () => {
    const { task, job } = await runningTask();
    await appendEvents(db(), { jobId: job.id, generation: job.generation, firstSequence: 1, events: [{ kind: 'message', data: { n: 1 } }] });
    await api.app.listen({ port: 0, host: '127.0.0.1' });
    const address = api.app.server.address();
    const port = typeof address === 'object' && address ? address.port : 0;
    const response = await fetch(`http://127.0.0.1:${port}/api/v1/tasks/${task.id}/logs?follow=true`, {
      headers: tenant.headers,
      signal: AbortSignal.timeout(20_000),
    });
    expect(response.status).toBe(200);
    const reader = response.body!.getReader();
    const decoder = new TextDecoder();
    let text = '';
    const readUntil = async (predicate: (soFar: string) => boolean) => {
      while (!predicate(text)) {
        const { value, done } = await reader.read();
        if (done) break;
        text += decoder.decode(value, { stream: true });
      }
    };
    await readUntil((soFar) => soFar.includes('"n":1'));
    await appendEvents(db(), { jobId: job.id, generation: job.generation, firstSequence: 2, events: [{ kind: 'message', data: { n: 2 } }] });
    await readUntil((soFar) => soFar.includes('"n":2'));
    await appendEvents(db(), { jobId: job.id, generation: job.generation, firstSequence: 3, events: [{ kind: 'final', data: { n: 3 } }] });
    await finishJob(db(), job.id, job.generation, { status: 'COMPLETED' });
    await readUntil(() => false);
    const messages = parseSse(text);
    expect(messages.slice(0, -1).map((message) => JSON.parse(message.data).data.n)).toEqual([1, 2, 3]);
    expect(messages.at(-1)).toEqual({ event: 'end', data: '{}' });
  });
});

describe('log streams and shutdown', () => {
  it('end when the server closes, so that SIGTERM is not held up', async () => {
    const { startTestApi } = await import('./support/api.js');
    const api = await startTestApi('pglite');
    const tenant = await api.newTenant();
    const { task } = (await tenant.request('POST', '/api/v1/tasks', { command: 'stays pending' })).json();
    await api.app.listen({ port: 0, host: '127.0.0.1' });
    const { port } = api.app.server.address() as { port: number };
    const response = await fetch(`http://127.0.0.1:${port}/api/v1/tasks/${task.id}/logs?follow=true`, {
      headers: tenant.headers,
      signal: AbortSignal.timeout(20_000),
    });
    const reader = response.body!.getReader();
    await reader.read();
    // The task stays PENDING (no executor), so only the server closing can end this stream.
    const closing = api.close();
    let text = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += new TextDecoder().decode(value);
    }
    await closing;
    expect(text).toContain('event: end');
  });
});
