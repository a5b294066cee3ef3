/**
 * A credential-injecting reverse proxy on the host, so that an agent CLI in a sandbox can call its model
 * provider without the sandbox ever holding the platform's key: the CLI gets a base URL on 127.0.0.1 whose
 * path starts with a lease token, and a placeholder key (the token again) that is worth nothing elsewhere.
 * The proxy swaps whatever credentials a request carries for the lease's real ones and streams the
 * request and the answer (SSE included) through as they come.
 *
 * A lease lives for one run: `release()` revokes its token, after which its requests answer 403 and never
 * reach the provider (requests already in flight finish). The sandbox shares the host's network namespace
 * when it has network access, which is how it reaches 127.0.0.1.
 */
import { randomBytes } from 'node:crypto';
import http, { type IncomingHttpHeaders, type IncomingMessage, type OutgoingHttpHeaders, type ServerResponse } from 'node:http';
import https from 'node:https';
import type { AddressInfo } from 'node:net';

/** What the proxy logs: a subset of pino's Logger, so the executor's logger fits as it is. */
export interface CredentialProxyLogger {
  warn(details: Record<string, unknown>, message: string): void;
}

export interface LeaseRequest {
  /** The provider's API root as the CLI expects it; request paths are appended to it verbatim. */
  upstreamBaseUrl: string;
  /** The real credentials, set on every forwarded request: `{ 'x-api-key': key }`, `{ authorization: 'Bearer ' + key }`. */
  headers: Record<string, string>;
}

export interface CredentialLease {
  /** `http://127.0.0.1:<port>/<token>`: the base URL to give the CLI. */
  baseUrl: string;
  /** The placeholder key for the CLI: it opens this lease and nothing else. */
  token: string;
  /** Revokes the token; idempotent. */
  release(): void;
}

interface Lease {
  upstream: URL;
  /** The upstream's path without a trailing slash; request paths (which start with "/") follow it. */
  basePath: string;
  headers: Record<string, string>;
}

/** 32 random bytes: unguessable, and url-safe in base64url, so the token can sit in a path. */
const TOKEN_BYTES = 32;

/** Whatever credentials a client sends are dropped; only the lease's reach the provider. */
const CREDENTIAL_HEADERS = ['authorization', 'x-api-key', 'api-key'];

/**
 * Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, not to the message. `expect` goes too:
 * this server already answered 100-continue to the client.
 */
const HOP_BY_HOP = ['connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'expect'];

export class CredentialProxy {
  private readonly leases = new Map<string, Lease>();
  private server: http.Server | null = null;
  private listening: Promise<number> | null = null;
  private closed = false;
  // Own agents, so that `close()` can let go of their kept-alive upstream connections.
  private readonly agents = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };

  constructor(private readonly options: { logger?: CredentialProxyLogger } = {}) {}

  /** A lease for one run; starts the proxy on first use. Throws for an upstream that is not an http(s) URL. */
  async lease(request: LeaseRequest): Promise<CredentialLease> {
    if (this.closed) throw new Error('the credential proxy is closed');
    const upstream = new URL(request.upstreamBaseUrl);
    if (upstream.protocol !== 'http:' && upstream.protocol !== 'https:') {
      throw new Error(`the upstream of a credential lease must be an http(s) URL, not ${upstream.protocol}`);
    }
    const port = await this.start();
    const token = randomBytes(TOKEN_BYTES).toString('base64url');
    this.leases.set(token, { upstream, basePath: upstream.pathname.replace(/\/+$/, ''), headers: { ...request.headers } });
    return {
      baseUrl: `http://127.0.0.1:${port}/${token}`,
      token,
      release: () => {
        this.leases.delete(token);
      },
    };
  }

  /** Revokes every lease and stops the server, cutting connections still open. */
  async close(): Promise<void> {
    this.closed = true;
    this.leases.clear();
    const server = this.server;
    this.server = null;
    this.listening = null;
    if (server) {
      const stopped = new Promise<void>((resolve) => server.close(() => resolve()));
      server.closeAllConnections();
      await stopped;
    }
    this.agents.http.destroy();
    this.agents.https.destroy();
  }

  private start(): Promise<number> {
    this.listening ??= new Promise<number>((resolve, reject) => {
      const server = http.createServer((req, res) => this.forward(req, res));
      server.once('error', (error) => {
        this.listening = null;
        reject(error);
      });
      server.listen(0, '127.0.0.1', () => {
        if (this.closed) {
          server.close();
          reject(new Error('the credential proxy is closed'));
          return;
        }
        this.server = server;
        // A forgotten close() must not keep the process alive; open connections still do while they last.
        server.unref();
        resolve((server.address() as AddressInfo).port);
      });
    });
    return this.listening;
  }

  private forward(req: IncomingMessage, res: ServerResponse): void {
    const target = this.route(req.url ?? '');
    if (!target) {
      // Drain what the client sends, so that it reads the answer rather than a reset.
      req.resume();
      answer(res, 403, 'lease_unknown', 'unknown or released credential lease');
      return;
    }
    const { lease, path } = target;
    const client = lease.upstream.protocol === 'https:' ? https : http;
    let upstreamRequest: http.ClientRequest;
    try {
      upstreamRequest = client.request({
        protocol: lease.upstream.protocol,
        // URL keeps an IPv6 literal in brackets; the socket wants it bare.
        hostname: lease.upstream.hostname.replace(/^\[(.*)\]$/, '$1'),
        port: lease.upstream.port || undefined,
        method: req.method,
        path,
        headers: requestHeaders(req.headers, lease.headers),
        agent: lease.upstream.protocol === 'https:' ? this.agents.https : this.agents.http,
      });
    } catch (error) {
      req.resume();
      answer(res, 400, 'bad_request', `the request cannot be forwarded: ${(error as Error).message}`);
      return;
    }
    upstreamRequest.on('response', (upstreamResponse) => {
      res.writeHead(upstreamResponse.statusCode ?? 502, upstreamResponse.statusMessage, responseHeaders(upstreamResponse.headers));
      // Each chunk goes out as it arrives: SSE and chunked answers stream through.
      upstreamResponse.pipe(res);
      upstreamResponse.on('error', () => res.destroy());
    });
    let clientGone = false;
    upstreamRequest.on('error', (error) => {
      if (clientGone) return;
      if (res.headersSent) {
        res.destroy();
        return;
      }
      this.options.logger?.warn({ upstream: lease.upstream.host, err: error.message }, 'credential proxy: the provider could not be reached');
      answer(res, 502, 'upstream_unreachable', `the provider could not be reached: ${(error as NodeJS.ErrnoException).code ?? error.message}`);
    });
    // A client that goes away takes its upstream request with it (an abandoned stream would run on).
    res.on('close', () => {
      if (res.writableFinished) return;
      clientGone = true;
      upstreamRequest.destroy();
    });
    req.on('error', () => upstreamRequest.destroy());
    req.pipe(upstreamRequest);
  }

  /** The lease named by the first path segment (a whole-token map lookup) and the upstream path to request. */
  private route(url: string): { lease: Lease; path: string } | null {
    if (!url.startsWith('/')) return null;
    const queryAt = url.indexOf('?');
    const pathname = queryAt === -1 ? url : url.slice(0, queryAt);
    const query = queryAt === -1 ? '' : url.slice(queryAt);
    const tokenEnd = pathname.indexOf('/', 1);
    const token = tokenEnd === -1 ? pathname.slice(1) : pathname.slice(1, tokenEnd);
    const lease = this.leases.get(token);
    if (!lease) return null;
    // Appended as text, never resolved as a URL: a path such as "//elsewhere/" must not change the host.
    const rest = tokenEnd === -1 ? '' : pathname.slice(tokenEnd);
    const path = `${lease.basePath}${rest}` || '/';
    return { lease, path: `${path}${query}` };
  }
}

function answer(res: ServerResponse, status: number, code: string, message: string): void {
  const body = JSON.stringify({ error: { code, message } });
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
  res.end(body);
}

/** The names a `connection` header lists are hop-by-hop as well. */
function hopByHop(headers: IncomingHttpHeaders): Set<string> {
  const listed = String(headers.connection ?? '')
    .split(',')
    .map((name) => name.trim().toLowerCase())
    .filter(Boolean);
  return new Set([...HOP_BY_HOP, ...listed]);
}

function requestHeaders(incoming: IncomingHttpHeaders, credentials: Record<string, string>): OutgoingHttpHeaders {
  const dropped = hopByHop(incoming);
  // The upstream's own host is set by the request itself.
  dropped.add('host');
  for (const name of CREDENTIAL_HEADERS) dropped.add(name);
  const headers: OutgoingHttpHeaders = {};
  for (const [name, value] of Object.entries(incoming)) {
    if (value !== undefined && !dropped.has(name)) headers[name] = value;
  }
  for (const [name, value] of Object.entries(credentials)) headers[name.toLowerCase()] = value;
  return headers;
}

function responseHeaders(incoming: IncomingHttpHeaders): OutgoingHttpHeaders {
  const dropped = hopByHop(incoming);
  const headers: OutgoingHttpHeaders = {};
  for (const [name, value] of Object.entries(incoming)) {
    if (value !== undefined && !dropped.has(name)) headers[name] = value;
  }
  return headers;
}
