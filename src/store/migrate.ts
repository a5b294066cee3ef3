/**
 * Applies the committed SQL migrations in drizzle/ in order, each recorded in `svc_migrations`.
 * The whole run is one transaction under a transaction-scoped advisory lock, so two processes that
 * start at once serialise: the second waits, then finds nothing left to apply.
 */
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import { queryRows, type Db } from './db.js';

/** drizzle/ sits at the package root, two levels above both src/store and dist/store. */
export const MIGRATIONS_DIR = fileURLToPath(new URL('../../drizzle/', import.meta.url));

/** An arbitrary constant that names svc's migration lock among the database's advisory locks. */
const MIGRATION_LOCK_KEY = 0x5_7c_0001;

export interface Migration {
  name: string;
  statements: string[];
  hash: string;
}

export function loadMigrations(dir: string = MIGRATIONS_DIR): Migration[] {
  return readdirSync(dir)
    .filter((file) => /^\d{4}_.*\.sql$/.test(file))
    .sort()
    .map((file) => {
      const text = readFileSync(`${dir}/${file}`, 'utf8');
      return {
        name: file.replace(/\.sql$/, ''),
        statements: text
          .split('--> statement-breakpoint')
          .map((statement) => statement.trim())
          .filter(Boolean),
        hash: createHash('sha256').update(text).digest('hex'),
      };
    });
}

export class MigrationMismatchError extends Error {
  constructor(name: string) {
    super(`migration ${name} was applied with different contents; a committed migration must never change`);
    this.name = 'MigrationMismatchError';
  }
}

/** Returns the names of the migrations it applied. */
export async function migrate(db: Db, migrations: Migration[] = loadMigrations()): Promise<string[]> {
  return db.transaction(async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(${MIGRATION_LOCK_KEY})`);
    await tx.execute(sql`
      create table if not exists svc_migrations (
        name text primary key,
        hash text not null,
        applied_at timestamptz not null default now()
      )`);
    const applied = await queryRows<{ name: string; hash: string }>(tx, sql`select name, hash from svc_migrations`);
    const known = new Map(applied.map((row) => [row.name, row.hash]));
    const done: string[] = [];
    for (const migration of migrations) {
      const hash = known.get(migration.name);
      if (hash !== undefined) {
        if (hash !== migration.hash) throw new MigrationMismatchError(migration.name);
        continue;
      }
      for (const statement of migration.statements) await tx.execute(sql.raw(statement));
      await tx.execute(sql`insert into svc_migrations (name, hash) values (${migration.name}, ${migration.hash})`);
      done.push(migration.name);
    }
    return done;
  });
}
