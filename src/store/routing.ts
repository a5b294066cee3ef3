import { and, asc, eq, inArray } from 'drizzle-orm';
import { DEFAULT_ROUTING_NAME } from '../domain/routing.js';
import type { Db } from './db.js';
import { routingConfigs } from './schema.js';

export type RoutingConfigRow = typeof routingConfigs.$inferSelect;

export async function listRoutingConfigs(db: Db, workspaceId: string): Promise<RoutingConfigRow[]> {
  return db.select().from(routingConfigs).where(eq(routingConfigs.workspaceId, workspaceId)).orderBy(asc(routingConfigs.name));
}

/** The config a trigger selects, and `default`: both in one query. */
export async function findRoutingConfigs(
  db: Db,
  workspaceId: string,
  trigger: string | null,
): Promise<{ matched: RoutingConfigRow | null; fallback: RoutingConfigRow | null }> {
  const names = trigger && trigger !== DEFAULT_ROUTING_NAME ? [DEFAULT_ROUTING_NAME, trigger] : [DEFAULT_ROUTING_NAME];
  const rows = await db
    .select()
    .from(routingConfigs)
    .where(and(eq(routingConfigs.workspaceId, workspaceId), inArray(routingConfigs.name, names)));
  return {
    matched: rows.find((row) => row.name === trigger && row.name !== DEFAULT_ROUTING_NAME) ?? null,
    fallback: rows.find((row) => row.name === DEFAULT_ROUTING_NAME) ?? null,
  };
}

export async function upsertRoutingConfig(
  db: Db,
  workspaceId: string,
  name: string,
  values: { mode: string; agent: string; effort: string; instructions: string | null },
): Promise<RoutingConfigRow> {
  const [row] = await db
    .insert(routingConfigs)
    .values({ workspaceId, name, ...values })
    .onConflictDoUpdate({
      target: [routingConfigs.workspaceId, routingConfigs.name],
      set: { ...values, updatedAt: new Date() },
    })
    .returning();
  if (!row) throw new Error('upsert returned no row');
  return row;
}

export async function deleteRoutingConfig(db: Db, workspaceId: string, name: string): Promise<boolean> {
  const rows = await db
    .delete(routingConfigs)
    .where(and(eq(routingConfigs.workspaceId, workspaceId), eq(routingConfigs.name, name)))
    .returning({ id: routingConfigs.id });
  return rows.length > 0;
}
