import { existsSync, mkdirSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { createServer, request as httpRequest, type IncomingHttpHeaders, type Server } from 'node:http';
import { connect, createServer as createNetServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { CredentialProxy, type CredentialLease } from '../src/agents/credential-proxy.js';

interface Seen {
  method: string;
  url: string;
  headers: IncomingHttpHeaders;
  body: string;
}

// A stand-in for a model provider: it records each request and answers /stream with SSE in several
// chunks. The chunk after the first waits for the test to say its client has read the first one, so a
// proxy that buffered the answer would never deliver it.
const seen: Seen[] = [];
let firstChunkRead: () => void = () => undefined;
let sentLast = false;
const upstream: Server = createServer((req, res) => {
  let body = '';
  req.setEncoding('utf8');
  req.on('data', (chunk: string) => (body += chunk));
  req.on('end', async () => {
    seen.push({ method: req.method ?? '', url: req.url ?? '', headers: req.headers, body });
    if (!req.url?.includes('/stream')) {
      res.writeHead(201, { 'content-type': 'application/json', 'x-request-id': 'req_1', 'keep-alive': 'timeout=77' });
      res.end(JSON.stringify({ ok: true }));
      return;
    }
    const read = new Promise<void>((resolve) => (firstChunkRead = resolve));
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
    res.write('event: message_start\ndata: {"n":1}\n\n');
    await read;
    for (const n of [2, 3]) {
      await new Promise((resolve) => setTimeout(resolve, 30));
      res.write(`event: delta\ndata: {"n":${n}}\n\n`);
    }
    await new Promise((resolve) => setTimeout(resolve, 30));
    sentLast = true;
    res.end('event: message_stop\ndata: {"n":4}\n\n');
  });
});

const logged: string[] = [];
const proxy = new CredentialProxy({ logger: { warn: (details, message) => logged.push(JSON.stringify({ details, message })) } });
let upstreamUrl = '';

// The proxy listens on a unix socket only; a sandbox reaches it through a forwarder on its own loopback
// (cli-harness.ts). The tests do the same on the host's loopback: one forwarder per socket.
const forwarders = new Map<string, Promise<string>>();
const relays: Array<ReturnType<typeof createNetServer>> = [];
function originOf(socketPath: string): Promise<string> {
  let origin = forwarders.get(socketPath);
  if (!origin) {
    const relay = createNetServer((client) => {
      const upstreamSocket = connect(socketPath);
      const drop = () => {
        client.destroy();
        upstreamSocket.destroy();
      };
      client.on('error', drop);
      upstreamSocket.on('error', drop);
      client.pipe(upstreamSocket).pipe(client);
    });
    relays.push(relay);
    origin = new Promise((resolve) => relay.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${(relay.address() as AddressInfo).port}`)));
    forwarders.set(socketPath, origin);
  }
  return origin;
}
/** The base URL a CLI would be given for the lease. */
const baseUrlOf = async (lease: CredentialLease) => `${await originOf(lease.socketPath)}${lease.basePath}`;

beforeAll(async () => {
  await new Promise<void>((resolve) => upstream.listen(0, '127.0.0.1', resolve));
  upstreamUrl = `http://127.0.0.1:${(upstream.address() as AddressInfo).port}`;
});

afterAll(async () => {
  for (const relay of relays) relay.close();
  await proxy.close();
  await new Promise((resolve) => upstream.close(resolve));
});

beforeEach(() => {
  seen.length = 0;
  sentLast = false;
});

describe('the credential proxy', () => {
  it('forwards method, path under the upstream base, query and body, with the lease credentials instead of the client ones', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: `${upstreamUrl}/base/v1/`, headers: { 'x-api-key': 'sk-real' }, paths: ['POST /messages'] });
    expect(lease.token.length).toBeGreaterThanOrEqual(43);
    expect(lease.basePath).toBe(`/${lease.token}`);
    // A unix socket in a directory only the service's user may enter: no TCP port on the host.
    expect(statSync(lease.socketPath).isSocket()).toBe(true);
    expect(statSync(dirname(lease.socketPath)).mode & 0o077).toBe(0);

    const response = await fetch(`${await baseUrlOf(lease)}/messages?beta=true&x=1`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-api-key': lease.token, authorization: 'Bearer sk-client', 'api-key': 'sk-azure', 'anthropic-version': '2023-06-01' },
      body: JSON.stringify({ model: 'claude', max_tokens: 10 }),
    });
    expect(response.status).toBe(201);
    expect(response.headers.get('x-request-id')).toBe('req_1');
    // Hop-by-hop headers belong to the upstream connection only.
    expect(response.headers.get('keep-alive')).not.toBe('timeout=77');
    expect(await response.json()).toEqual({ ok: true });

    expect(seen).toHaveLength(1);
    const [request] = seen;
    expect(request).toMatchObject({ method: 'POST', url: '/base/v1/messages?beta=true&x=1', body: '{"model":"claude","max_tokens":10}' });
    expect(request!.headers).toMatchObject({ 'x-api-key': 'sk-real', 'anthropic-version': '2023-06-01', 'content-type': 'application/json', host: upstreamUrl.slice('http://'.length) });
    expect(request!.headers.authorization).toBeUndefined();
    expect(request!.headers['api-key']).toBeUndefined();
    expect(JSON.stringify(request)).not.toContain(lease.token);
    lease.release();
  });

  it('sets a bearer credential for OpenAI-style upstreams, and forwards a GET with no body', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: `${upstreamUrl}/v1`, headers: { authorization: 'Bearer sk-openai-real' }, paths: ['GET /models'] });
    const response = await fetch(`${await baseUrlOf(lease)}/models?limit=2`, { headers: { authorization: `Bearer ${lease.token}`, 'x-api-key': 'stray' } });
    expect(response.status).toBe(201);
    expect(seen).toEqual([expect.objectContaining({ method: 'GET', url: '/v1/models?limit=2', body: '' })]);
    expect(seen[0]!.headers.authorization).toBe('Bearer sk-openai-real');
    expect(seen[0]!.headers['x-api-key']).toBeUndefined();
    lease.release();
  });

  it('forwards only the calls the lease allows, to the upstream host whatever the path says', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: upstreamUrl, headers: { 'x-api-key': 'sk-real' }, paths: ['GET /v1/messages', 'POST /v1/messages/count_tokens'] });
    const baseUrl = await baseUrlOf(lease);
    // Another host, another API of the provider's, a dot segment, an escape, a longer or shorter path,
    // another method: refused before anything reaches the upstream.
    for (const [method, path] of [
      ['GET', '//evil.example/v1/messages'],
      ['GET', '/v1/files'],
      ['GET', '/v1/messages/../files'],
      ['GET', '/v1/%6Dessages'],
      ['GET', '/v1/messages/'],
      ['GET', '/v1/messages/count_tokens'],
      ['GET', '/v1'],
      ['GET', ''],
      ['DELETE', '/v1/messages'],
    ] as const) {
      const refused = await rawRequest(method, `${baseUrl}${path}`);
      expect(refused.status, `${method} ${path}`).toBe(403);
      expect(JSON.parse(refused.body).error.code).toBe('path_not_allowed');
    }
    expect(seen).toEqual([]);
    expect((await rawRequest('GET', `${baseUrl}/v1/messages?x=1`)).status).toBe(201);
    expect((await rawRequest('POST', `${baseUrl}/v1/messages/count_tokens`)).status).toBe(201);
    expect(seen.map((request) => [request.method, request.url, request.headers.host])).toEqual([
      ['GET', '/v1/messages?x=1', upstreamUrl.slice('http://'.length)],
      ['POST', '/v1/messages/count_tokens', upstreamUrl.slice('http://'.length)],
    ]);
    lease.release();
  });

  it('streams an answer through chunk by chunk', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: upstreamUrl, headers: { 'x-api-key': 'sk-real' }, paths: ['POST /v1/stream'] });
    const response = await fetch(`${await baseUrlOf(lease)}/v1/stream`, { method: 'POST', body: '{"stream":true}' });
    expect(response.status).toBe(200);
    expect(response.headers.get('content-type')).toBe('text/event-stream');
    const reader = response.body!.pipeThrough(new TextDecoderStream()).getReader();
    const first = await reader.read();
    expect(first.value).toBe('event: message_start\ndata: {"n":1}\n\n');
    // The upstream waits for this before it sends the rest: the first chunk came through on its own.
    expect(sentLast).toBe(false);
    firstChunkRead();
    let rest = '';
    for (let chunk = await reader.read(); !chunk.done; chunk = await reader.read()) rest += chunk.value;
    expect(rest).toBe('event: delta\ndata: {"n":2}\n\nevent: delta\ndata: {"n":3}\n\nevent: message_stop\ndata: {"n":4}\n\n');
    expect(sentLast).toBe(true);
    lease.release();
  });

  it('answers 403 for an unknown token, a prefix of a token and a released one, without reaching the upstream', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: upstreamUrl, headers: { 'x-api-key': 'sk-real' }, paths: ['GET /v1/messages', 'POST /v1/messages'] });
    const baseUrl = await baseUrlOf(lease);
    const origin = new URL(baseUrl).origin;
    for (const path of ['/not-a-lease/v1/messages', `/${lease.token.slice(0, 20)}/v1/messages`, `/${lease.token}x/v1/messages`, '/', '']) {
      const response = await fetch(`${origin}${path}`, { method: 'POST', body: '{}', headers: { 'x-api-key': lease.token } });
      expect(response.status).toBe(403);
      expect(await response.json()).toEqual({ error: { code: 'lease_unknown', message: 'unknown or released credential lease' } });
    }
    expect((await fetch(`${baseUrl}/v1/messages`)).status).toBe(201);
    expect(seen).toHaveLength(1);

    lease.release();
    lease.release();
    const released = await fetch(`${baseUrl}/v1/messages`, { method: 'POST', body: '{}' });
    expect(released.status).toBe(403);
    expect(seen).toHaveLength(1);
  });

  it('answers 502 when the upstream is down, and logs no token', async () => {
    const closed = createServer();
    await new Promise<void>((resolve) => closed.listen(0, '127.0.0.1', resolve));
    const port = (closed.address() as AddressInfo).port;
    await new Promise((resolve) => closed.close(resolve));

    const lease = await proxy.lease({ upstreamBaseUrl: `http://127.0.0.1:${port}/v1`, headers: { 'x-api-key': 'sk-real' }, paths: ['POST /messages'] });
    const response = await fetch(`${await baseUrlOf(lease)}/messages`, { method: 'POST', body: '{}' });
    expect(response.status).toBe(502);
    expect(await response.json()).toEqual({ error: { code: 'upstream_unreachable', message: expect.stringContaining('ECONNREFUSED') } });
    expect(logged.length).toBeGreaterThan(0);
    expect(logged.join('\n')).not.toContain(lease.token);
    expect(logged.join('\n')).not.toContain('sk-real');
    lease.release();
  });

  it('refuses upstreams that are not http(s), and leases after close', async () => {
    await expect(proxy.lease({ upstreamBaseUrl: 'file:///etc/passwd', headers: {}, paths: [] })).rejects.toThrow(/http\(s\) URL/);
    const other = new CredentialProxy();
    const lease = await other.lease({ upstreamBaseUrl: upstreamUrl, headers: {}, paths: ['GET /v1/messages'] });
    const baseUrl = await baseUrlOf(lease);
    await other.close();
    await expect(other.lease({ upstreamBaseUrl: upstreamUrl, headers: {}, paths: [] })).rejects.toThrow(/closed/);
    await expect(fetch(`${baseUrl}/v1/messages`)).rejects.toThrow();
    // Its socket and directory went with it.
    expect(existsSync(dirname(lease.socketPath))).toBe(false);
  });

  it('keeps its socket in a directory of its own under the run dir, both private to the service user', async () => {
    const base = mkdtempSync(join(tmpdir(), 'svc-run-'));
    const runDir = join(base, 'run');
    // Made by someone else already, open to others: the proxy closes it.
    mkdirSync(runDir, { mode: 0o755 });
    const own = new CredentialProxy({ runDir });
    try {
      const lease = await own.lease({ upstreamBaseUrl: upstreamUrl, headers: {}, paths: ['GET /v1/messages'] });
      expect(dirname(dirname(lease.socketPath))).toBe(runDir);
      expect(statSync(runDir).mode & 0o777).toBe(0o700);
      expect(statSync(dirname(lease.socketPath)).mode & 0o777).toBe(0o700);
      expect(statSync(lease.socketPath).isSocket()).toBe(true);
      expect((await fetch(`${await baseUrlOf(lease)}/v1/messages`)).status).toBe(201);
      await own.close();
      // Its own directory goes with it; the run dir stays for the next one.
      expect(existsSync(dirname(lease.socketPath))).toBe(false);
      expect(existsSync(runDir)).toBe(true);
    } finally {
      await own.close();
      rmSync(base, { recursive: true, force: true });
    }
  });

  it('falls back to the temporary directory, saying why, when the run dir is too long for a socket path', async () => {
    const base = mkdtempSync(join(tmpdir(), 'svc-run-'));
    const runDir = join(base, 'd'.repeat(90), 'run');
    const warnings: string[] = [];
    const own = new CredentialProxy({ runDir, logger: { warn: (details, message) => warnings.push(`${message} ${JSON.stringify(details)}`) } });
    try {
      const lease = await own.lease({ upstreamBaseUrl: upstreamUrl, headers: {}, paths: ['GET /v1/messages'] });
      expect(dirname(dirname(lease.socketPath))).toBe(tmpdir());
      expect(statSync(dirname(lease.socketPath)).mode & 0o777).toBe(0o700);
      expect(existsSync(runDir)).toBe(false);
      expect(warnings).toEqual([expect.stringContaining(`the path of a socket in ${runDir} is too long for a unix socket; its socket goes in ${tmpdir()} instead`)]);
      expect((await fetch(`${await baseUrlOf(lease)}/v1/messages`)).status).toBe(201);
    } finally {
      await own.close();
      rmSync(base, { recursive: true, force: true });
    }
  });

  it('survives errors after it started: on its server, and drops a client that sends garbage', async () => {
    const lease = await proxy.lease({ upstreamBaseUrl: upstreamUrl, headers: { 'x-api-key': 'sk-real' }, paths: ['GET /v1/messages'] });
    // An error on the listening server (EMFILE on accept, say) is logged, not thrown at the process.
    const server = proxy['server']!;
    for (const code of ['EMFILE', 'ENFILE']) {
      expect(() => server.emit('error', Object.assign(new Error(`accept ${code}`), { code }))).not.toThrow();
      expect(logged.join('\n')).toContain(`accept ${code}`);
    }
    // The same server goes on serving the same socket.
    expect(proxy['server']).toBe(server);
    expect((await proxy.lease({ upstreamBaseUrl: upstreamUrl, headers: {}, paths: [] })).socketPath).toBe(lease.socketPath);
    // A client that sends garbage is dropped without an answer (Node's own handling would answer 400),
    // and only its connection goes.
    const socket = connect(lease.socketPath);
    let answered = '';
    socket.setEncoding('utf8');
    socket.on('data', (chunk: string) => (answered += chunk));
    const gone = new Promise<void>((resolve) => socket.on('close', () => resolve()));
    socket.on('error', () => undefined);
    socket.write('\u0000\u0001 not http\r\n\r\n');
    await gone;
    expect(answered).toBe('');
    expect((await fetch(`${await baseUrlOf(lease)}/v1/messages`)).status).toBe(201);
    lease.release();
  });
});

/** The status and body of a request sent with this exact path: fetch would normalize "//" and ".." away. */
function rawRequest(method: string, url: string): Promise<{ status: number; body: string }> {
  const { port } = new URL(url);
  const path = url.slice(url.indexOf('/', 'http://'.length));
  return new Promise((resolve, reject) => {
    httpRequest({ host: '127.0.0.1', port, path, method }, (response) => {
      let body = '';
      response.setEncoding('utf8');
      response.on('data', (chunk: string) => (body += chunk));
      response.on('end', () => resolve({ status: response.statusCode ?? 0, body }));
    })
      .on('error', reject)
      .end();
  });
}
