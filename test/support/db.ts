/**
 * Real databases for tests, never mocks. PGlite always; PostgreSQL too whenever DATABASE_URL is set,
 * each test file in a schema of its own (dropped afterwards unless the file failed, for debugging).
 */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import pg from 'pg';
import { inject } from 'vitest';
import { openDatabase, type Database } from '../../src/store/db.js';

export type TestDriver = 'pglite' | 'postgres';

export const testDrivers: TestDriver[] = process.env.DATABASE_URL ? ['pglite', 'postgres'] : ['pglite'];

export function postgresUrl(): string {
  const url = process.env.DATABASE_URL;
  if (!url) throw new Error('DATABASE_URL is not set');
  return url;
}

let snapshot: Blob | null = null;

export interface TestDatabase {
  database: Database;
  /** The PostgreSQL schema this file's tables live in (postgres only). */
  schema: string | null;
  close(options?: { keep?: boolean }): Promise<void>;
}

export async function createTestSchema(): Promise<string> {
  const schema = `svc_test_${randomBytes(6).toString('hex')}`;
  const client = new pg.Client({ connectionString: postgresUrl() });
  await client.connect();
  try {
    await client.query(`create schema ${schema}`);
  } finally {
    await client.end();
  }
  return schema;
}

export async function dropTestSchema(schema: string): Promise<void> {
  const client = new pg.Client({ connectionString: postgresUrl() });
  await client.connect();
  try {
    await client.query(`drop schema if exists ${schema} cascade`);
  } finally {
    await client.end();
  }
}

export async function openTestDatabase(driver: TestDriver): Promise<TestDatabase> {
  if (driver === 'pglite') {
    snapshot ??= new Blob([readFileSync(inject('pgliteSnapshot'))]);
    const database = await openDatabase({ driver: 'pglite', dataDir: null, snapshot });
    return { database, schema: null, close: () => database.close() };
  }
  const schema = await createTestSchema();
  const database = await openDatabase({ driver: 'postgres', url: postgresUrl(), schema, poolSize: 5 });
  return {
    database,
    schema,
    async close(options = {}) {
      await database.close();
      if (!options.keep) await dropTestSchema(schema);
    },
  };
}
