import { readdirSync, readFileSync } from 'node:fs';
import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { openDatabase, queryRows, type Database } from '../src/store/db.js';
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

  it.skipIf(!process.env.DATABASE_URL)('are safe when several processes start at once on PostgreSQL', async () => {
    const schema = await createTestSchema();
    const open = () => openDatabase({ driver: 'postgres', url: postgresUrl(), schema, poolSize: 2 }, { migrate: false });
    const databases = await Promise.all([open(), open(), open()]);
    try {
      const applied = await Promise.all(databases.map((database) => migrate(database.db)));
      const all = loadMigrations();
      const names = all.map((migration) => migration.name);
      // Each migration applied by exactly one of them, and recorded once.
      expect(applied.flat().sort()).toEqual([...names].sort());
      const [a] = databases as [Database, ...Database[]];
      const rows = await queryRows<{ name: string; hash: string }>(a.db, sql`select name, hash from svc_migrations order by name`);
      expect(rows).toEqual(all.map((migration) => ({ name: migration.name, hash: migration.hash })));
      // The tables are in the schema the connections were given, not in public.
      const [where] = await queryRows<{ schema: string }>(a.db, sql`select table_schema as schema from information_schema.tables where table_name = 'tasks' and table_schema = ${schema}`);
      expect(where).toEqual({ schema });

      expect(await migrate(a.db)).toEqual([]);
      const changed = all.map((migration, index) => (index === all.length - 1 ? { ...migration, hash: 'different' } : migration));
      await expect(migrate(a.db, changed)).rejects.toBeInstanceOf(MigrationMismatchError);
      // A refused run changes nothing.
      expect(await queryRows(a.db, sql`select name, hash from svc_migrations order by name`)).toEqual(rows);
    } finally {
      await Promise.all(databases.map((database) => database.close()));
      await dropTestSchema(schema);
    }
  });
});
