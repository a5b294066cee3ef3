import { and, desc, eq, like, sql } from 'drizzle-orm';
import { displayPrefix, generateApiKey, hashApiKey } from '../domain/api-keys.js';
import type { Db } from './db.js';
import { apiKeys } from './schema.js';

export type ApiKeyRecord = Omit<typeof apiKeys.$inferSelect, 'keyHash'>;

const publicColumns = {
  id: apiKeys.id,
  workspaceId: apiKeys.workspaceId,
  name: apiKeys.name,
  prefix: apiKeys.prefix,
  createdByUserId: apiKeys.createdByUserId,
  createdAt: apiKeys.createdAt,
  expiresAt: apiKeys.expiresAt,
  revokedAt: apiKeys.revokedAt,
  lastUsedAt: apiKeys.lastUsedAt,
};

/** Creates a key and returns it in clear text once; only its hash is stored. */
export async function createApiKey(
  db: Db,
  input: { workspaceId: string; name: string; expiresAt?: Date | null; createdByUserId?: string | null },
): Promise<{ key: string; record: ApiKeyRecord }> {
  const key = generateApiKey();
  const [record] = await db
    .insert(apiKeys)
    .values({
      workspaceId: input.workspaceId,
      name: input.name,
      prefix: displayPrefix(key),
      keyHash: hashApiKey(key),
      expiresAt: input.expiresAt ?? null,
      createdByUserId: input.createdByUserId ?? null,
    })
    .returning(publicColumns);
  if (!record) throw new Error('insert returned no row');
  return { key, record };
}

export async function listApiKeys(db: Db, workspaceId: string): Promise<ApiKeyRecord[]> {
  return db.select(publicColumns).from(apiKeys).where(eq(apiKeys.workspaceId, workspaceId)).orderBy(desc(apiKeys.createdAt));
}

/**
 * Revokes the workspace's key named by its id or its display prefix. Returns the revoked keys (an already
 * revoked key is returned unchanged, so revoking twice is harmless); an ambiguous prefix revokes nothing.
 */
export async function revokeApiKey(
  db: Db,
  workspaceId: string,
  idOrPrefix: string,
): Promise<{ revoked: ApiKeyRecord | null; matches: number }> {
  const isId = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(idOrPrefix);
  // A prefix must be at least the part listings show, so that a slip cannot revoke keys at random.
  if (!isId && idOrPrefix.length < displayPrefix('x'.repeat(64)).length) return { revoked: null, matches: 0 };
  const match = isId ? eq(apiKeys.id, idOrPrefix) : like(apiKeys.prefix, `${idOrPrefix.replace(/[%_\\]/g, '\\$&')}%`);
  const candidates = await db.select(publicColumns).from(apiKeys).where(and(eq(apiKeys.workspaceId, workspaceId), match));
  if (candidates.length !== 1) return { revoked: null, matches: candidates.length };
  const [revoked] = await db
    .update(apiKeys)
    .set({ revokedAt: sql`coalesce(${apiKeys.revokedAt}, now())` })
    .where(eq(apiKeys.id, candidates[0]!.id))
    .returning(publicColumns);
  return { revoked: revoked ?? null, matches: 1 };
}
