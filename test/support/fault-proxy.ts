/**
 * A real HTTP proxy on 127.0.0.1:0 between a runner and the svc server, injecting faults per request
 * (STYLE.md 6). The runner's base URL points at the proxy; each request is matched against the test's
 * rules (method, path, optionally its body and the n-th match) and suffers at most one fault. Every
 * request and answer is recorded (`exchanges`) so that a test asserts on what crossed and waits on what
 * happened (`waitFor`), never on time. Nothing here is random or timed.
 *
 * Bodies are read whole before anything is forwarded: runner requests are at most a few MiB.
 */
import { Agent, createServer, request as forwardRequest, type ClientRequest, type IncomingHttpHeaders, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { assertNever } from '../../src/domain/errors.js';

/** Which requests a rule (or a release condition) applies to. */
export interface RequestMatch {
  method?: string;
  /** A string matches the end of the URL's path (`/events`, `/claim`); a RegExp is tested on the path. */
  path: string | RegExp;
  /** Only requests whose body passes (one part number, one run). */
  body?: (body: string) => boolean;
  /** Only the n-th request that matches the rest (counted from 1); absent: every one. */
  nth?: number;
}

export type Fault =
  /** The server does the work; the client's connection is then destroyed without an answer. */
  | { kind: 'dropAnswer' }
  /** The connection is destroyed before anything is forwarded: the server never sees the request. */
  | { kind: 'refuse' }
  /** Like `refuse`, and the proxy stays down (everything refused) until `up()`. */
  | { kind: 'down' }
  /** The same bytes reach the server twice; the client gets the second answer. */
  | { kind: 'duplicate' }
  /** The client waits; the request is forwarded (and answered) only once `until` has been answered. */
  | { kind: 'hold'; until: RequestMatch }
  /**
   * Reordered in the network: the client's connection is reset at once (it sends again), and these bytes
   * reach the server only after `until` has been answered, a stale copy arriving late. Its answer goes nowhere.
   */
  | { kind: 'late'; until: RequestMatch }
  /** Only the first `bytes` of the body reach the server (default half), then both connections end. */
  | { kind: 'cutOff'; bytes?: number }
  /** The server gets `change(body)` instead of the client's bytes. */
  | { kind: 'mutate'; change: (body: string) => string };

export type FaultRule = RequestMatch & { fault: Fault };

export type FaultKind = Fault['kind'] | 'pass';

export interface Exchange {
  /** Arrival order, from 1. */
  id: number;
  method: string;
  /** The URL path without the query. */
  path: string;
  /** The bytes the client sent. */
  body: string;
  fault: FaultKind;
  /** What reached the server when it differs from `body` (mutated, cut off). */
  forwardedBody: string | null;
  /** The order in which the server got the request among all forwarded ones (null: it never did). */
  forwardedAt: number | null;
  /** The server's answer (the last one for `duplicate`); null when it gave none. */
  status: number | null;
  answer: string | null;
  /** Every answer of the server to this exchange (two for `duplicate`). */
  answers: Array<{ status: number; body: string }>;
  /** Whether the client got the answer. */
  delivered: boolean;
  /** Nothing more will happen to it. */
  settled: boolean;
}

interface Flight {
  exchange: Exchange;
  /** The URL as the client asked for it, query included. */
  url: string;
  client: IncomingMessage;
  upstream: ClientRequest | null;
  /** Its answer is to be lost (`loseAnswer`). */
  loseAnswer: boolean;
}

interface Answer {
  status: number;
  headers: IncomingHttpHeaders;
  body: Buffer;
}

interface Pending {
  exchange: Exchange;
  until: RequestMatch;
  /** Matching answers seen since the request was held. */
  seen: number;
  release: () => void;
}

const HOP_BY_HOP = new Set(['connection', 'keep-alive', 'transfer-encoding', 'content-length', 'host', 'upgrade', 'proxy-connection']);

function pathOf(url: string | undefined): string {
  return (url ?? '/').split('?', 1)[0]!;
}

function matches(match: RequestMatch, method: string, path: string, body: string): boolean {
  if (match.method && match.method.toUpperCase() !== method) return false;
  if (typeof match.path === 'string' ? !path.endsWith(match.path) : !match.path.test(path)) return false;
  return match.body ? match.body(body) : true;
}

function headersOf(headers: IncomingHttpHeaders): Record<string, string | string[]> {
  const kept: Record<string, string | string[]> = {};
  for (const [name, value] of Object.entries(headers)) if (value !== undefined && !HOP_BY_HOP.has(name)) kept[name] = value;
  return kept;
}

export class FaultProxy {
  readonly exchanges: Exchange[] = [];
  private readonly rules: Array<{ rule: FaultRule; count: number }> = [];
  private readonly pending: Pending[] = [];
  private readonly inflight = new Set<Flight>();
  private readonly listeners = new Set<() => void>();
  private readonly agent = new Agent({ keepAlive: false });
  private isDown = false;
  private forwarded = 0;
  private readonly server = createServer((request, response) => void this.handle(request, response));
  private target = '';

  /** Listens on 127.0.0.1:0 in front of `target` (an origin such as http://127.0.0.1:1234). */
  static async start(target: string): Promise<FaultProxy> {
    const proxy = new FaultProxy();
    proxy.target = target;
    await new Promise<void>((resolve) => proxy.server.listen(0, '127.0.0.1', resolve));
    return proxy;
  }

  get origin(): string {
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  /** Adds a rule; the first rule that applies to a request decides its fault. */
  on(rule: FaultRule): this {
    this.rules.push({ rule, count: 0 });
    return this;
  }

  /** Drops every rule: from now on requests pass (unless the proxy is down). */
  clearRules(): this {
    this.rules.splice(0);
    return this;
  }

  /** Refuses every request from now on, and cuts those in flight (their answers are lost). */
  down(): void {
    this.isDown = true;
    for (const flight of [...this.inflight]) {
      flight.exchange.fault = 'down';
      flight.upstream?.destroy();
      flight.client.socket.destroy();
      // A held request goes with its connection.
      const held = this.pending.findIndex((pending) => pending.exchange === flight.exchange);
      if (held !== -1) this.pending.splice(held, 1)[0]!.release();
    }
  }

  /**
   * The answer of a request already on its way (a long poll waiting at the server) is lost: the server does
   * the work, the client's connection is destroyed instead of answered.
   */
  loseAnswer(exchange: Exchange): void {
    const flight = [...this.inflight].find((candidate) => candidate.exchange === exchange);
    if (!flight || exchange.fault !== 'pass') throw new Error(`exchange #${exchange.id} is not passing through now`);
    flight.loseAnswer = true;
    exchange.fault = 'dropAnswer';
  }

  up(): void {
    this.isDown = false;
    this.changed();
  }

  /** How many requests the server has got so far: later ones have a larger `forwardedAt`. */
  get forwardedCount(): number {
    return this.forwarded;
  }

  /** Exchanges of `match` (its `nth` ignored), in arrival order. */
  find(match: Omit<RequestMatch, 'nth'>): Exchange[] {
    return this.exchanges.filter((exchange) => matches(match, exchange.method, exchange.path, exchange.body));
  }

  /** Resolves with `check`'s first truthy answer, re-checked whenever an exchange changes; bounded. */
  waitFor<T>(what: string, check: () => T | null | undefined | false, timeoutMs = 30_000): Promise<T> {
    return new Promise((resolve, reject) => {
      const settle = (done: () => void) => {
        this.listeners.delete(listener);
        clearTimeout(timer);
        done();
      };
      const listener = () => {
        let value: T | null | undefined | false;
        try {
          value = check();
        } catch (error) {
          return settle(() => reject(error as Error));
        }
        if (value) settle(() => resolve(value));
      };
      const timer = setTimeout(() => {
        this.listeners.delete(listener);
        reject(new Error(`timed out waiting for ${what}; exchanges:\n${this.summary()}`));
      }, timeoutMs);
      this.listeners.add(listener);
      listener();
    });
  }

  /** One line per exchange: what a failed wait or assertion shows. */
  summary(): string {
    return this.exchanges
      .map((exchange) => `#${exchange.id} ${exchange.method} ${exchange.path} ${exchange.fault} → ${exchange.status ?? '-'}${exchange.delivered ? '' : ' (not delivered)'} ${(exchange.answer ?? '').slice(0, 160)}`)
      .join('\n');
  }

  async close(): Promise<void> {
    for (const held of this.pending.splice(0)) held.exchange.settled = true;
    this.down();
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
    this.agent.destroy();
  }

  private changed(): void {
    for (const listener of [...this.listeners]) listener();
  }

  private faultFor(method: string, path: string, body: string): Fault | null {
    let chosen: Fault | null = null;
    for (const entry of this.rules) {
      if (!matches({ ...entry.rule, nth: undefined }, method, path, body)) continue;
      entry.count += 1;
      if (chosen === null && (entry.rule.nth === undefined || entry.rule.nth === entry.count)) chosen = entry.rule.fault;
    }
    return chosen;
  }

  private async handle(client: IncomingMessage, response: ServerResponse): Promise<void> {
    let body: string;
    try {
      const chunks: Buffer[] = [];
      for await (const chunk of client) chunks.push(chunk as Buffer);
      body = Buffer.concat(chunks).toString('utf8');
    } catch {
      return; // the client went away while sending: nothing crossed
    }
    const method = client.method ?? 'GET';
    const exchange: Exchange = {
      id: this.exchanges.length + 1,
      method,
      path: pathOf(client.url),
      body,
      fault: 'pass',
      forwardedBody: null,
      forwardedAt: null,
      status: null,
      answer: null,
      answers: [],
      delivered: false,
      settled: false,
    };
    this.exchanges.push(exchange);
    const fault = this.isDown ? ({ kind: 'down' } as const) : this.faultFor(method, exchange.path, body);
    exchange.fault = fault?.kind ?? 'pass';
    this.changed();
    const flight: Flight = { exchange, url: client.url ?? '/', client, upstream: null, loseAnswer: false };
    this.inflight.add(flight);
    // A client that goes away (a timeout, a killed runner) ends its upstream request too, as a reverse
    // proxy does: a long poll must not outlive its reader.
    response.once('close', () => {
      if (!response.writableFinished) flight.upstream?.destroy();
    });
    try {
      await this.apply(fault, flight, response);
    } finally {
      this.inflight.delete(flight);
      // A late copy settles once it reached the server.
      if (exchange.fault !== 'late') exchange.settled = true;
      this.changed();
    }
  }

  private async apply(fault: Fault | null, flight: Flight, response: ServerResponse): Promise<void> {
    const { exchange, client } = flight;
    const forward = (body: string, cutAt?: number) => this.forward(flight, body, cutAt);
    const answer = (result: Answer | null) => {
      if (!result || response.destroyed) return;
      response.writeHead(result.status, { ...headersOf(result.headers), 'content-length': String(result.body.length) });
      response.end(result.body);
      exchange.delivered = true;
    };
    switch (fault?.kind) {
      case undefined: {
        const result = await forward(exchange.body);
        if (!flight.loseAnswer) return answer(result);
        client.socket.destroy();
        return;
      }
      case 'down':
        this.down();
        return;
      case 'refuse':
        client.socket.destroy();
        return;
      case 'dropAnswer':
        await forward(exchange.body);
        client.socket.destroy();
        return;
      case 'duplicate':
        await forward(exchange.body);
        return answer(await forward(exchange.body));
      case 'mutate':
        return answer(await forward(fault.change(exchange.body)));
      case 'cutOff':
        await forward(exchange.body, fault.bytes ?? Math.floor(Buffer.byteLength(exchange.body) / 2));
        client.socket.destroy();
        return;
      case 'hold':
        await this.until(exchange, fault.until);
        return answer(await forward(exchange.body));
      case 'late':
        client.socket.destroy();
        void this.until(exchange, fault.until).then(async () => {
          await forward(exchange.body);
          exchange.settled = true;
          this.changed();
        });
        return;
      default:
        return assertNever(fault);
    }
  }

  /** Resolves once a request of `match` (its nth one, counted from now) has been answered by the server. */
  private until(exchange: Exchange, match: RequestMatch): Promise<void> {
    return new Promise((release) => this.pending.push({ exchange, until: match, seen: 0, release }));
  }

  private releaseAfter(answered: Exchange): void {
    for (const held of [...this.pending]) {
      if (held.exchange === answered || !matches({ ...held.until, nth: undefined }, answered.method, answered.path, answered.body)) continue;
      held.seen += 1;
      if (held.seen < (held.until.nth ?? 1)) continue;
      this.pending.splice(this.pending.indexOf(held), 1);
      held.release();
    }
  }

  /**
   * Sends `body` to the server and reads its whole answer; null when the server gave none (the proxy went
   * down, the client went away, or the body was cut off at `cutAt` bytes on purpose).
   */
  private forward(flight: Flight, body: string, cutAt: number | undefined): Promise<Answer | null> {
    const { exchange } = flight;
    if (this.isDown) return Promise.resolve(null);
    const bytes = Buffer.from(body, 'utf8');
    exchange.forwardedAt = ++this.forwarded;
    if (body !== exchange.body) exchange.forwardedBody = body;
    if (cutAt !== undefined) exchange.forwardedBody = bytes.subarray(0, cutAt).toString('utf8');
    this.changed();
    return new Promise((resolve) => {
      let answered = false;
      const upstream = forwardRequest(
        `${this.target}${flight.url}`,
        { method: exchange.method, headers: { ...headersOf(flight.client.headers), 'content-length': String(bytes.length) }, agent: this.agent },
        (answer) => {
          answered = true;
          const chunks: Buffer[] = [];
          answer.on('data', (chunk: Buffer) => chunks.push(chunk));
          answer.on('error', () => resolve(null));
          answer.on('close', () => resolve(null));
          answer.on('end', () => {
            const text = Buffer.concat(chunks);
            exchange.status = answer.statusCode ?? 0;
            exchange.answer = text.toString('utf8');
            exchange.answers.push({ status: exchange.status, body: exchange.answer });
            this.releaseAfter(exchange);
            this.changed();
            resolve({ status: exchange.status, headers: answer.headers, body: text });
          });
        },
      );
      flight.upstream = upstream;
      upstream.on('error', () => resolve(null));
      upstream.on('close', () => {
        if (!answered) resolve(null);
      });
      if (cutAt === undefined) {
        upstream.end(bytes);
      } else {
        // The server reads a body shorter than its content-length, then the connection ends.
        upstream.write(bytes.subarray(0, cutAt), () => setImmediate(() => upstream.destroy()));
      }
    });
  }
}

// ---- Body changes for `mutate` ----

/** An event-part body whose base64 `data` has one character changed (still base64): one byte differs. */
export function flipPartByte(body: string): string {
  const part = JSON.parse(body) as { data: string };
  const at = Math.floor(part.data.length / 2);
  const flipped = part.data[at] === 'A' ? 'B' : 'A';
  return JSON.stringify({ ...part, data: `${part.data.slice(0, at)}${flipped}${part.data.slice(at + 1)}` });
}

/** An events body whose first event carries other text: a retry that is not its original. */
export function changeFirstEventText(body: string): string {
  const parsed = JSON.parse(body) as { batches: Array<{ events: Array<{ data?: Record<string, unknown> }> }> };
  const event = parsed.batches[0]!.events[0]!;
  event.data = { ...(event.data ?? {}), text: 'changed on the way' };
  return JSON.stringify(parsed);
}
