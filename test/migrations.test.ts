import { readdirSync, readFileSync } from 'node:fs';
import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { openDatabase, queryRows } from '../src/store/db.js';
import { loadMigrations, migrate, MigrationMismatchError, MIGRATIONS_DIR } from '../src/store/migrate.js';
import { createTestSchema, dropTestSchema, postgresUrl } from './support/db.js';

describe('migrations', () => {
  it('are schema-agnostic (no "public". qualifiers from drizzle-kit)', () => {
    const files = readdirSync(MIGRATIONS_DIR).filter((file) => file.endsWith('.sql'));
    expect(files.length).toBeGreaterThan(0);
    for (const file of files) expect(readFileSync(`${MIGRATIONS_DIR}/${file}`, 'utf8'), file).not.toContain('"public".');
  });

  it('apply once on PGlite, are a no-op the second time, and refuse a changed migration', async () => {
    const database = await openDatabase({ driver: 'pglite', dataDir: null }, { migrate: false });
    try {
      const all = loadMigrations();
      expect(await migrate(database.db, all)).toEqual(all.map((migration) => migration.name));
      expect(await migrate(database.db, all)).toEqual([]);
      const changed = all.map((migration, index) => (index === 0 ? { ...migration, hash: 'different' } : migration));
      await expect(migrate(database.db, changed)).rejects.toBeInstanceOf(MigrationMismatchError);
    } finally {
      await database.close();
    }
  });

  it.skipIf(!process.env.DATABASE_URL)('are safe when two processes start at once on PostgreSQL', async () => {
    const schema = await createTestSchema();
    const open = () => openDatabase({ driver: 'postgres', url: postgresUrl(), schema, poolSize: 2 }, { migrate: false });
    const [a, b] = await Promise.all([open(), open()]);
    try {
      const [appliedByA, appliedByB] = await Promise.all([migrate(a.db), migrate(b.db)]);
      const names = loadMigrations().map((migration) => migration.name);
      expect([...appliedByA, ...appliedByB].sort()).toEqual(names.sort());
      const rows = await queryRows<{ name: string }>(a.db, sql`select name from svc_migrations order by name`);
      expect(rows.map((row) => row.name)).toEqual(names);
    } finally {
      await a.close();
      await b.close();
      await dropTestSchema(schema);
    }
  });
});
