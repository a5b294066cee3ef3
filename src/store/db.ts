/**
 * The database port: one Drizzle `Db` over either driver. PGlite (embedded, a data dir guarded by a lock
 * file) is the default; node-postgres is used when a DATABASE_URL is given. Repositories take a `Db` and
 * never know which driver is behind it.
 */
import { join } from 'node:path';
import { PGlite } from '@electric-sql/pglite';
import { sql, type ExtractTablesWithRelations, type SQL } from 'drizzle-orm';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { drizzle as drizzlePg } from 'drizzle-orm/node-postgres';
import type { PgDatabase, PgQueryResultHKT } from 'drizzle-orm/pg-core';
import pg from 'pg';
import * as schema from './schema.js';
import { acquireDataDirLock, type DataDirLock } from './lock.js';
import { migrate } from './migrate.js';

export type Schema = typeof schema;
export type Db = PgDatabase<PgQueryResultHKT, Schema, ExtractTablesWithRelations<Schema>>;

export type StoreLocation =
  /** `snapshot`: a data-dir tarball (PGlite `dumpDataDir`) to start an in-memory database from. */
  | { driver: 'pglite'; dataDir: string | null; snapshot?: Blob }
  | { driver: 'postgres'; url: string; schema?: string; poolSize?: number };

export interface Database {
  readonly db: Db;
  readonly driver: 'pglite' | 'postgres';
  /** Answers when the database takes a trivial query; used by /readyz. */
  ping(): Promise<void>;
  close(): Promise<void>;
  /**
   * Calls `handler` with the payload of every NOTIFY on `channel` (sent with `notify`, delivered when the
   * sending transaction commits). Resolves once listening; the returned function stops it.
   */
  listen(channel: string, handler: (payload: string) => void): Promise<() => Promise<void>>;
  /** PGlite only: the data dir as a tarball (tests start copies from it). */
  snapshot?(): Promise<Blob>;
}

export interface OpenOptions {
  /** Apply pending migrations (default true). */
  migrate?: boolean;
}

export async function openDatabase(location: StoreLocation, options: OpenOptions = {}): Promise<Database> {
  const database = location.driver === 'pglite' ? await openPglite(location.dataDir, location.snapshot) : openPostgres(location);
  try {
    if (options.migrate !== false) await migrate(database.db);
    return database;
  } catch (error) {
    await database.close();
    throw error;
  }
}

async function openPglite(dataDir: string | null, snapshot?: Blob): Promise<Database> {
  let lock: DataDirLock | null = null;
  if (dataDir !== null) lock = acquireDataDirLock(dataDir);
  let client: PGlite;
  try {
    client =
      dataDir === null
        ? new PGlite(snapshot ? { loadDataDir: snapshot } : {})
        : new PGlite(join(dataDir, 'pgdata'));
    await client.waitReady;
  } catch (error) {
    lock?.release();
    throw error;
  }
  const db = drizzlePglite({ client, schema }) as unknown as Db;
  return {
    db,
    driver: 'pglite',
    async ping() {
      await client.query('select 1');
    },
    async listen(channel, handler) {
      const stop = await client.listen(channel, handler);
      return async () => {
        if (!client.closed) await stop();
      };
    },
    /** A tarball of the whole data dir, to open copies of this database from. */
    async snapshot() {
      return client.dumpDataDir('none');
    },
    async close() {
      try {
        if (!client.closed) await client.close();
      } finally {
        lock?.release();
      }
    },
  };
}

function openPostgres(location: Extract<StoreLocation, { driver: 'postgres' }>): Database {
  const pool = new pg.Pool({
    connectionString: location.url,
    max: location.poolSize ?? 10,
    ...(location.schema ? { options: `-c search_path=${location.schema}` } : {}),
  });
  // An idle client that loses its connection must not crash the process; the next query reconnects.
  pool.on('error', () => undefined);
  const db = drizzlePg({ client: pool, schema }) as unknown as Db;
  let closed = false;
  const listeners = new Set<NotificationListener>();
  return {
    db,
    driver: 'postgres',
    async listen(channel, handler) {
      const listener = new NotificationListener(location.url, channel, handler);
      await listener.start();
      listeners.add(listener);
      return async () => {
        listeners.delete(listener);
        await listener.stop();
      };
    },
    async ping() {
      await pool.query('select 1');
    },
    async close() {
      if (closed) return;
      closed = true;
      await Promise.all([...listeners].map((listener) => listener.stop()));
      await pool.end();
    },
  };
}

/**
 * A dedicated connection that LISTENs on one channel (a pooled connection cannot: LISTEN belongs to its
 * session). A lost connection is reopened after a second; notifications sent meanwhile are lost, so
 * callers also poll now and then.
 */
class NotificationListener {
  private client: pg.Client | null = null;
  private stopped = false;
  private retry: NodeJS.Timeout | null = null;

  constructor(
    private readonly url: string,
    private readonly channel: string,
    private readonly handler: (payload: string) => void,
  ) {}

  async start(): Promise<void> {
    const client = new pg.Client({ connectionString: this.url });
    client.on('notification', (message) => {
      if (message.channel === this.channel) this.handler(message.payload ?? '');
    });
    client.on('error', () => this.lost(client));
    client.on('end', () => this.lost(client));
    try {
      await client.connect();
      await client.query(`listen "${this.channel.replace(/"/g, '""')}"`);
    } catch (error) {
      client.end().catch(() => undefined);
      throw error;
    }
    if (this.stopped) {
      await client.end().catch(() => undefined);
      return;
    }
    this.client = client;
  }

  private lost(client: pg.Client): void {
    if (this.client !== client) return;
    this.client = null;
    client.end().catch(() => undefined);
    this.scheduleRetry();
  }

  private scheduleRetry(): void {
    if (this.stopped || this.retry) return;
    this.retry = setTimeout(() => {
      this.retry = null;
      if (!this.stopped) this.start().catch(() => this.scheduleRetry());
    }, 1000);
    this.retry.unref();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    if (this.retry) clearTimeout(this.retry);
    const client = this.client;
    this.client = null;
    await client?.end().catch(() => undefined);
  }
}

/** Sends a notification; inside a transaction it is delivered when the transaction commits. */
export async function notify(db: Db, channel: string, payload = ''): Promise<void> {
  await db.execute(sql`select pg_notify(${channel}, ${payload})`);
}

/**
 * Runs a hot raw statement as a named prepared statement (node-postgres prepares it once per connection,
 * so PostgreSQL plans it once instead of on every request). `text` uses $1…$n placeholders.
 * Outside a transaction only: it goes straight to the driver's client.
 */
export async function preparedRows<T>(db: Db, name: string, text: string, values: unknown[]): Promise<T[]> {
  const client = (db as unknown as { $client: pg.Pool | PGlite }).$client;
  if (client instanceof PGlite) return (await client.query<T>(text, values)).rows;
  return (await client.query<T & pg.QueryResultRow>({ name, text, values })).rows;
}

/** Runs raw SQL and returns its rows; both drivers answer `{ rows }`. */
export async function queryRows<T>(db: Db, query: SQL): Promise<T[]> {
  const result = (await db.execute(query)) as { rows: T[] };
  return result.rows;
}
