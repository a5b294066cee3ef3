/**
 * A credential-injecting reverse proxy on the host, so that an agent CLI in a sandbox can call its model
 * provider without the sandbox ever holding the platform's key, and without any other way out.
 *
 * The proxy listens on a unix socket only (in a directory private to the service's user, under the
 * service's data dir: `runDir`), never on a TCP port: the CLI runs in a private network namespace, the socket's directory is bound into its sandbox, and
 * a small forwarder there (cli-harness.ts) listens on the sandbox's own 127.0.0.1 and relays each
 * connection to the socket. The CLI's base URL is that forwarder followed by `/<lease token>`, and its key
 * is the token again, a placeholder worth nothing elsewhere. The proxy swaps whatever credentials a request
 * carries for the lease's real ones and streams the request and the answer (SSE included) through.
 *
 * A lease allows only the provider API calls its CLI needs (`paths`, method and exact path): anything
 * else answers 403 and never reaches the provider, so a leaked token is good for model calls and nothing
 * more. A lease lives for one run: `release()` revokes its token, after which its requests answer 403
 * (requests already in flight finish).
 *
 * Usage is not metered here: credits come from the usage the CLI reports in its stream, so model calls a
 * sandboxed process makes with the token on its own go unmetered (docs/execution.md says so).
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import http, { type IncomingHttpHeaders, type IncomingMessage, type OutgoingHttpHeaders, type ServerResponse } from 'node:http';
import https from 'node:https';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

/** What the proxy logs: a subset of pino's Logger, so the executor's logger fits as it is. */
export interface CredentialProxyLogger {
  warn(details: Record<string, unknown>, message: string): void;
}

export interface CredentialProxyOptions {
  /**
   * Where the proxy makes its socket's directory: the service's `<data dir>/run`, made private to the
   * service's user. Not the system's temporary directory, where systemd-tmpfiles deletes what has not
   * changed for days, the socket of a long-lived service included (every CLI run would fail until a
   * restart). A path too long for a unix socket falls back to the temporary directory, with a warning;
   * without `runDir` (tests), the temporary directory is used.
   */
  runDir?: string;
  logger?: CredentialProxyLogger;
}

export interface LeaseRequest {
  /** The provider's API root as the CLI expects it; request paths are appended to it verbatim. */
  upstreamBaseUrl: string;
  /** The real credentials, set on every forwarded request: `{ 'x-api-key': key }`, `{ authorization: 'Bearer ' + key }`. */
  headers: Record<string, string>;
  /**
   * The calls the lease allows, as `METHOD /path` relative to the lease (`POST /v1/messages`): the path
   * must be exactly one of these (any query string goes along); anything else answers 403.
   */
  paths: readonly string[];
}

export interface CredentialLease {
  /** The proxy's unix socket on the host: what a sandbox's forwarder relays to. */
  socketPath: string;
  /** `/<token>`: the path that names the lease; the CLI's base URL is a forwarder's origin followed by it. */
  basePath: string;
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
  paths: ReadonlySet<string>;
}

/** 32 random bytes: unguessable, and url-safe in base64url, so the token can sit in a path. */
const TOKEN_BYTES = 32;

/** The socket's name in the proxy's directory. */
const SOCKET_NAME = 'proxy.sock';
/** The proxy's own directory in `runDir`: short, since a socket's whole path has little room. */
const SOCKET_DIR_PREFIX = 'proxy-';
/** `sun_path` holds 108 bytes on Linux, its terminating NUL included. */
const MAX_SOCKET_PATH_BYTES = 107;

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
  private listening: Promise<string> | null = null;
  private socketDir: string | null = null;
  private closed = false;
  // Own agents, so that `close()` can let go of their kept-alive upstream connections.
  private readonly agents = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };

  constructor(private readonly options: CredentialProxyOptions = {}) {}

  /** A lease for one run; starts the proxy on first use. Throws for an upstream that is not an http(s) URL. */
  async lease(request: LeaseRequest): Promise<CredentialLease> {
    if (this.closed) throw new Error('the credential proxy is closed');
    const upstream = new URL(request.upstreamBaseUrl);
    if (upstream.protocol !== 'http:' && upstream.protocol !== 'https:') {
      throw new Error(`the upstream of a credential lease must be an http(s) URL, not ${upstream.protocol}`);
    }
    const socketPath = await this.start();
    const token = randomBytes(TOKEN_BYTES).toString('base64url');
    this.leases.set(token, { upstream, basePath: upstream.pathname.replace(/\/+$/, ''), headers: { ...request.headers }, paths: new Set(request.paths) });
    return {
      socketPath,
      basePath: `/${token}`,
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
    if (this.socketDir) rmSync(this.socketDir, { recursive: true, force: true });
    this.socketDir = null;
    this.agents.http.destroy();
    this.agents.https.destroy();
  }

  private start(): Promise<string> {
    this.listening ??= new Promise<string>((resolve, reject) => {
      let dir: string;
      try {
        dir = this.makeSocketDir();
      } catch (error) {
        this.listening = null;
        reject(error as Error);
        return;
      }
      const socketPath = join(dir, SOCKET_NAME);
      const server = http.createServer((req, res) => this.forward(req, res));
      // Kept for the server's whole life: an 'error' without a listener would crash the service. Before
      // it listens, an error means it could not start.
      server.on('error', (error) => {
        if (this.server === server) {
          this.options.logger?.warn({ err: error.message }, 'credential proxy: server error');
          return;
        }
        this.listening = null;
        rmSync(dir, { recursive: true, force: true });
        reject(error);
      });
      // A broken client connection is that client's problem: drop it, never the process.
      server.on('clientError', (_error, socket) => socket.destroy());
      server.listen(socketPath, () => {
        if (this.closed) {
          server.close();
          rmSync(dir, { recursive: true, force: true });
          reject(new Error('the credential proxy is closed'));
          return;
        }
        this.server = server;
        this.socketDir = dir;
        // A forgotten close() must not keep the process alive; open connections still do while they last.
        server.unref();
        resolve(socketPath);
      });
    });
    return this.listening;
  }

  /**
   * A new directory for the socket, private to the service's user (the sandboxes see it bound in, as that
   * user): in `runDir` when its socket path fits in `sun_path`, else in the temporary directory.
   */
  private makeSocketDir(): string {
    const { logger } = this.options;
    // Absolute: the sandbox binds the directory in from wherever its command runs.
    const runDir = this.options.runDir === undefined ? undefined : resolve(this.options.runDir);
    if (runDir) {
      // mkdtemp's six random characters.
      const socketPath = join(runDir, `${SOCKET_DIR_PREFIX}XXXXXX`, SOCKET_NAME);
      if (Buffer.byteLength(socketPath) <= MAX_SOCKET_PATH_BYTES) {
        mkdirSync(runDir, { recursive: true, mode: 0o700 });
        // It may exist already, made with other permissions.
        chmodSync(runDir, 0o700);
        return mkdtempSync(join(runDir, SOCKET_DIR_PREFIX));
      }
      logger?.warn(
        { runDir, bytes: Buffer.byteLength(socketPath), limit: MAX_SOCKET_PATH_BYTES },
        `credential proxy: the path of a socket in ${runDir} is too long for a unix socket; its socket goes in ${tmpdir()} instead, where a cleaner of old temporary files (systemd-tmpfiles) may delete it and break agent CLI runs until a restart: give the service a shorter data dir`,
      );
    }
    return mkdtempSync(join(tmpdir(), 'svc-credential-proxy-'));
  }

  private forward(req: IncomingMessage, res: ServerResponse): void {
    const target = this.route(req.method ?? '', req.url ?? '');
    if ('refused' in target) {
      // Drain what the client sends, so that it reads the answer rather than a reset.
      req.resume();
      req.on('error', () => undefined);
      if (target.refused === 'lease') answer(res, 403, 'lease_unknown', 'unknown or released credential lease');
      else answer(res, 403, 'path_not_allowed', `the credential lease does not allow ${target.refused}`);
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
    res.on('error', () => upstreamRequest.destroy());
    req.on('error', () => upstreamRequest.destroy());
    req.pipe(upstreamRequest);
  }

  /**
   * The lease named by the first path segment (a whole-token map lookup) and the upstream path to request,
   * or why the request is refused: no such lease, or a call the lease does not allow.
   */
  private route(method: string, url: string): { lease: Lease; path: string } | { refused: string } {
    if (!url.startsWith('/')) return { refused: 'lease' };
    const queryAt = url.indexOf('?');
    const pathname = queryAt === -1 ? url : url.slice(0, queryAt);
    const query = queryAt === -1 ? '' : url.slice(queryAt);
    const tokenEnd = pathname.indexOf('/', 1);
    const token = tokenEnd === -1 ? pathname.slice(1) : pathname.slice(1, tokenEnd);
    const lease = this.leases.get(token);
    if (!lease) return { refused: 'lease' };
    const rest = tokenEnd === -1 ? '' : pathname.slice(tokenEnd);
    const call = `${method} ${rest}`;
    // An exact match: no prefix, no dot segments, no escapes can stretch an allowed path.
    if (!lease.paths.has(call)) return { refused: call.slice(0, 200) };
    // Appended as text, never resolved as a URL.
    return { lease, path: `${lease.basePath}${rest}${query}` };
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
