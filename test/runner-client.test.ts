/**
 * The runner's HTTP client against a tiny real HTTP server on 127.0.0.1:0, scripted per request (not the
 * svc server): Retry-After, backoff on 5xx and refused connections, 401 → identity, answer validation.
 * Waits go through the client's `sleep` seam, which records them and returns at once.
 */
import { randomUUID } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { BACKOFF_BASE_MS, BACKOFF_CAP_MS, backoffDelay, retryAfterMs } from '../src/runner/backoff.js';
import {
  RunnerClient,
  RunnerHttpError,
  RunnerProtocolError,
  RunnerRevokedError,
  RunnerUnauthorizedError,
  RunnerUnreachableError,
  type RunnerClientOptions,
} from '../src/runner/client.js';
import { freePort } from './support/processes.js';

const CREDENTIAL = `service_runner_${'a'.repeat(43)}`;
const IDENTITY = { runnerId: randomUUID(), workspaceId: randomUUID(), userId: randomUUID() };
const HEARTBEAT = { runnerId: IDENTITY.runnerId, workspaceId: IDENTITY.workspaceId, version: '7', heartbeatIntervalMs: 30_000, serverTime: new Date().toISOString() };

interface Seen {
  method: string;
  url: string;
  authorization: string | undefined;
  body: string;
}

type Handler = (request: IncomingMessage, response: ServerResponse, body: string) => void;

let servers: Server[] = [];
afterEach(async () => {
  await Promise.all(servers.map((server) => new Promise((resolve) => server.close(resolve))));
  servers = [];
});

async function body(request: IncomingMessage): Promise<string> {
  let text = '';
  for await (const chunk of request) text += chunk;
  return text;
}

/** A server answering each request with the next handler of `script` for its path (the last one repeats). */
async function startServer(script: Record<string, Handler[]>, port = 0): Promise<{ baseUrl: string; seen: Seen[] }> {
  const seen: Seen[] = [];
  const used = new Map<string, number>();
  const server = createServer(async (request, response) => {
    const text = await body(request);
    seen.push({ method: request.method ?? '', url: request.url ?? '', authorization: request.headers.authorization, body: text });
    const path = (request.url ?? '').replace(/^\/api\/v1\/runners/, '');
    const handlers = script[path] ?? [];
    const index = used.get(path) ?? 0;
    used.set(path, index + 1);
    const handler = handlers[Math.min(index, handlers.length - 1)];
    if (!handler) return void response.writeHead(404, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { code: 'not_found', message: 'no such route' } }));
    handler(request, response, text);
  });
  await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  servers.push(server);
  return { baseUrl: `http://127.0.0.1:${(server.address() as AddressInfo).port}/api/v1`, seen };
}

const json = (status: number, payload: unknown, headers: Record<string, string> = {}): Handler => (_request, response) =>
  void response.writeHead(status, { 'content-type': 'application/json', ...headers }).end(JSON.stringify(payload));
const failure = (status: number, code: string, message: string, details?: unknown, headers: Record<string, string> = {}) =>
  json(status, { error: { code, message, ...(details === undefined ? {} : { details }) } }, headers);

function client(baseUrl: string, overrides: Partial<RunnerClientOptions> = {}) {
  const waits: number[] = [];
  const made = new RunnerClient({
    baseUrl,
    credential: CREDENTIAL,
    maxAttempts: 5,
    random: () => 0.5,
    sleep: async (ms) => {
      waits.push(ms);
    },
    ...overrides,
  });
  return { client: made, waits };
}

describe('the runner client', () => {
  it('sends the credential and validates the answer with the protocol schema', async () => {
    const server = await startServer({ '/heartbeat': [json(200, HEARTBEAT)], '/runs': [json(200, { runs: [{ runId: 'not-a-uuid' }], version: '1' })] });
    const { client: runner } = client(server.baseUrl);
    const answer = await runner.heartbeat({ workspaceId: IDENTITY.workspaceId });
    expect(answer).toEqual(HEARTBEAT);
    expect(server.seen[0]).toMatchObject({ method: 'POST', url: '/api/v1/runners/heartbeat', authorization: `Bearer ${CREDENTIAL}` });
    expect(JSON.parse(server.seen[0]!.body)).toEqual({ workspaceId: IDENTITY.workspaceId });
    await expect(runner.listRuns()).rejects.toThrow(RunnerProtocolError);
  });

  it('waits as Retry-After says on 429 and 503, in seconds or as a date', async () => {
    const server = await startServer({
      '/heartbeat': [
        failure(429, 'rate_limited', 'Rate limit exceeded', undefined, { 'retry-after': '3' }),
        failure(503, 'service_unavailable', 'Busy', undefined, { 'retry-after': '1' }),
        json(200, HEARTBEAT),
      ],
    });
    const { client: runner, waits } = client(server.baseUrl);
    await expect(runner.heartbeat({ workspaceId: IDENTITY.workspaceId })).resolves.toEqual(HEARTBEAT);
    expect(waits).toEqual([3_000, 1_000]);
    expect(server.seen).toHaveLength(3);
    const now = Date.parse('2030-01-01T00:00:00Z');
    expect(retryAfterMs('Tue, 01 Jan 2030 00:00:05 GMT', now)).toBe(5_000);
    expect(retryAfterMs('soon', now)).toBeNull();
  });

  it('backs off exponentially with full jitter on 5xx without Retry-After, capped at 30 s', async () => {
    const server = await startServer({
      '/runs': [failure(503, 'service_unavailable', 'Busy'), failure(500, 'internal_error', 'Server error'), failure(502, 'bad_gateway', 'Bad gateway'), json(200, { runs: [], version: '4' })],
    });
    const { client: runner, waits } = client(server.baseUrl, { random: () => 0.999 });
    await expect(runner.listRuns()).resolves.toEqual({ runs: [], version: '4' });
    expect(waits).toEqual([Math.floor(0.999 * 250), Math.floor(0.999 * 500), Math.floor(0.999 * 1000)]);
    for (let attempt = 0; attempt < 40; attempt++) {
      expect(backoffDelay(attempt, () => 0.999999)).toBeLessThanOrEqual(Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** attempt));
      expect(backoffDelay(attempt, () => 0)).toBe(0);
    }
    expect(backoffDelay(30, () => 0.999999)).toBe(BACKOFF_CAP_MS - 1);
  });

  it('backs off while the connection is refused, and goes on once the server is there', async () => {
    const port = await freePort();
    const baseUrl = `http://127.0.0.1:${port}/api/v1`;
    const refused = client(baseUrl, { maxAttempts: 3 });
    const error = await refused.client.listRuns().catch((caught: unknown) => caught);
    expect(error).toBeInstanceOf(RunnerUnreachableError);
    expect((error as Error).message).toMatch(/ECONNREFUSED/);
    expect(refused.waits).toHaveLength(2);

    // The server comes up during the second wait.
    let started: Promise<unknown> | null = null;
    const waits: number[] = [];
    const recovering = new RunnerClient({
      baseUrl,
      credential: CREDENTIAL,
      random: () => 0.5,
      sleep: async (ms) => {
        waits.push(ms);
        if (waits.length === 2) await (started = startServer({ '/runs': [json(200, { runs: [], version: '1' })] }, port));
      },
    });
    await expect(recovering.listRuns()).resolves.toEqual({ runs: [], version: '1' });
    expect(started).not.toBeNull();
    expect(waits).toEqual([125, 250]);
  });

  it('does not retry a refusal, and keeps its code, message and details', async () => {
    const server = await startServer({ '/runs/r/claim': [failure(409, 'conflict', 'run is completed', { generation: 3 })] });
    const { client: runner, waits } = client(server.baseUrl);
    const error = (await runner.claim('r').catch((caught: unknown) => caught)) as RunnerHttpError;
    expect(error).toBeInstanceOf(RunnerHttpError);
    expect([error.status, error.code, error.message, error.details]).toEqual([409, 'conflict', 'run is completed', { generation: 3 }]);
    expect(waits).toEqual([]);
    expect(server.seen).toHaveLength(1);
  });

  it('asks /identity after a 401: revoked, unknown, or a plain refusal', async () => {
    const unauthorized = failure(401, 'unauthorized', 'This runner connection was revoked; pair again');
    const revoked = await startServer({ '/runs': [unauthorized], '/identity': [json(200, { ...IDENTITY, revoked: true })] });
    const revokedError = await client(revoked.baseUrl).client.listRuns().catch((caught: unknown) => caught);
    expect(revokedError).toBeInstanceOf(RunnerRevokedError);
    expect((revokedError as RunnerRevokedError).runnerId).toBe(IDENTITY.runnerId);
    expect(revoked.seen.map((request) => request.url)).toEqual(['/api/v1/runners/runs', '/api/v1/runners/identity']);
    // The identity check carries the same credential.
    expect(revoked.seen[1]!.authorization).toBe(`Bearer ${CREDENTIAL}`);

    const unknown = await startServer({ '/runs': [unauthorized], '/identity': [failure(401, 'unauthorized', 'Invalid or missing runner credential')] });
    await expect(client(unknown.baseUrl).client.listRuns()).rejects.toThrow(RunnerUnauthorizedError);

    const notRevoked = await startServer({ '/runs': [unauthorized], '/identity': [json(200, { ...IDENTITY, revoked: false })] });
    await expect(client(notRevoked.baseUrl).client.listRuns()).rejects.toMatchObject({ name: 'RunnerHttpError', status: 401 });

    // Enrollment has no credential: its 401 is the answer itself.
    const enroll = await startServer({ '/enroll': [failure(401, 'unauthorized', 'Invalid pairing code or verifier')] });
    const enrollBody = { pairingCode: 'ACDE-FGHK', verifier: 'v'.repeat(43), credential: CREDENTIAL, name: 'laptop' };
    await expect(new RunnerClient({ baseUrl: enroll.baseUrl, maxAttempts: 1 }).enroll(enrollBody)).rejects.toMatchObject({ status: 401, message: 'Invalid pairing code or verifier' });
    expect(enroll.seen[0]!.authorization).toBeUndefined();
  });

  it('stops waiting and retrying when its signal is aborted', async () => {
    const server = await startServer({ '/runs': [failure(503, 'service_unavailable', 'Busy')] });
    const controller = new AbortController();
    const runner = new RunnerClient({
      baseUrl: server.baseUrl,
      credential: CREDENTIAL,
      signal: controller.signal,
      sleep: async () => controller.abort(new Error('stopping')),
    });
    await expect(runner.listRuns()).rejects.toThrow('stopping');
    expect(server.seen).toHaveLength(1);
  });
});
