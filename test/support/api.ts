/** An in-process API server on a real database, with helpers to make tenants (workspace + key). */
import { randomBytes } from 'node:crypto';
import { mkdtempSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FastifyInstance, InjectOptions, LightMyRequestResponse } from 'fastify';
import { afterAll, beforeAll } from 'vitest';
import type { Socket } from 'node:net';
import pino from 'pino';
import { Environments } from '../../src/engine/environments.js';
import { buildServer, type ServerOptions } from '../../src/server/app.js';
import { createApiKey } from '../../src/store/api-keys.js';
import { createWorkspace, type Workspace } from '../../src/store/workspaces.js';
import type { RateLimits } from '../../src/store/rate-limit.js';
import { openTestDatabase, type TestDatabase, type TestDriver } from './db.js';

export const TEST_PUBLIC_URL = 'http://svc.test';
export const DEFAULT_AGENT = 'anthropic/claude-sonnet-4-5';

export interface Tenant {
  workspace: Workspace;
  key: string;
  headers: { authorization: string };
  /** Injects a request authenticated as this tenant; `body` is sent as JSON. */
  request(method: InjectOptions['method'], url: string, body?: unknown): Promise<LightMyRequestResponse>;
}

export interface TestApi {
  app: FastifyInstance;
  db: TestDatabase;
  /** The server's data dir: code host repositories and workspace environments. */
  dataDir: string;
  /** The workspace environments of `dataDir`, shared with the server (merges) and test engines. */
  environments: Environments;
  newTenant(options?: { plan?: 'free' | 'pro' | 'max' }): Promise<Tenant>;
  close(): Promise<void>;
}

export interface TestApiOptions {
  rateLimits?: RateLimits;
  repoPaths?: string[];
  trustProxy?: ServerOptions['trustProxy'];
}

export async function startTestApi(driver: TestDriver, options: TestApiOptions = {}): Promise<TestApi> {
  const db = await openTestDatabase(driver);
  const dataDir = mkdtempSync(join(tmpdir(), 'svc-test-data-'));
  const environments = new Environments({ db: db.database.db, dataDir, policy: { hiddenPaths: [dataDir], allowUnsandboxed: false }, logger: pino({ level: process.env.SVC_TEST_LOG ?? 'silent' }) });
  const app = await buildServer({
    database: db.database,
    publicUrl: TEST_PUBLIC_URL,
    dataDir,
    environments,
    ...(options.repoPaths ? { repoPaths: options.repoPaths } : {}),
    ...(options.trustProxy !== undefined ? { trustProxy: options.trustProxy } : {}),
    // Generous by default so that suites are not throttled; rate-limit tests set their own.
    rateLimits: options.rateLimits ?? { perMinute: 100_000, perHour: 1_000_000 },
  });
  await app.ready();
  const sockets = new Set<Socket>();
  app.server.on('connection', (socket: Socket) => {
    sockets.add(socket);
    socket.once('close', () => sockets.delete(socket));
  });
  return {
    app,
    db,
    dataDir,
    environments,
    async newTenant(tenantOptions = {}) {
      const name = `ws-${randomBytes(5).toString('hex')}`;
      const workspace = await createWorkspace(db.database.db, { name, plan: tenantOptions.plan ?? 'free', defaultAgent: DEFAULT_AGENT });
      if (!workspace) throw new Error('workspace name collision');
      const { key } = await createApiKey(db.database.db, { workspaceId: workspace.id, name: 'test' });
      const headers = { authorization: `Bearer ${key}` };
      return {
        workspace,
        key,
        headers,
        request: (method, url, body) =>
          app.inject({ method, url, headers, ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }) }),
      };
    },
    async close() {
      // Clients of a test that listened on a real port (a runner daemon's keep-alive connections) would
      // hold the close until their idle timeout.
      // Tests that listen on a real port (runner daemons, fetch) leave connections that would hold the
      // close until their timeouts, some opened while the close hooks run: idle ones go at once, and what
      // is left after a grace for answers in flight (a log stream ending) is cut.
      const closing = app.close();
      const started = Date.now();
      const ending = setInterval(() => {
        app.server.closeIdleConnections();
        if (Date.now() - started > 2_000) for (const socket of sockets) socket.destroy();
      }, 50);
      app.server.closeIdleConnections();
      try {
        await closing;
      } finally {
        clearInterval(ending);
      }
      await environments.close();
      await db.close();
      await rm(dataDir, { recursive: true, force: true });
    },
  };
}

/**
 * Starts a test API with a first tenant before the enclosing describe block's tests and closes it after;
 * `ready` hands both to the block: `useTestApi(driver, (ready) => ({ api, tenant } = ready))`.
 */
export function useTestApi(
  driver: TestDriver,
  ready: (context: { api: TestApi; tenant: Tenant }) => void,
  options: TestApiOptions = {},
): void {
  let api: TestApi | undefined;
  beforeAll(async () => {
    api = await startTestApi(driver, options);
    ready({ api, tenant: await api.newTenant() });
  });
  afterAll(async () => {
    await api?.close();
  });
}
