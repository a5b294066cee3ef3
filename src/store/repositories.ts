/** Connected repositories of a workspace. */
import { and, asc, eq, sql } from 'drizzle-orm';
import type { Db } from './db.js';
import { repositories } from './schema.js';

export type RepositoryRow = typeof repositories.$inferSelect;

export async function insertRepository(
  db: Db,
  values: { workspaceId: string; fullName: string; dir: string; defaultBranch: string; source: string },
): Promise<RepositoryRow | null> {
  const [row] = await db.insert(repositories).values(values).onConflictDoNothing().returning();
  return row ?? null;
}

export async function listRepositories(db: Db, workspaceId: string): Promise<RepositoryRow[]> {
  return db.select().from(repositories).where(eq(repositories.workspaceId, workspaceId)).orderBy(asc(repositories.createdAt), asc(repositories.fullName));
}

export async function findRepository(db: Db, workspaceId: string, fullName: string): Promise<RepositoryRow | null> {
  const [row] = await db
    .select()
    .from(repositories)
    .where(and(eq(repositories.workspaceId, workspaceId), eq(repositories.fullName, fullName)));
  return row ?? null;
}

/** Hands out the repository's next pull request number (atomic across processes). */
export async function nextPullRequestNumber(tx: Db, repositoryId: string): Promise<number> {
  const [row] = await tx
    .update(repositories)
    .set({ lastPrNumber: sql`${repositories.lastPrNumber} + 1` })
    .where(eq(repositories.id, repositoryId))
    .returning({ number: repositories.lastPrNumber });
  if (!row) throw new Error(`repository ${repositoryId} does not exist`);
  return row.number;
}
