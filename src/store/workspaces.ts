import { asc, eq } from 'drizzle-orm';
import { DEFAULT_ROUTING, DEFAULT_ROUTING_NAME } from '../domain/routing.js';
import type { Db } from './db.js';
import { creditEntries, routingConfigs, workspaces } from './schema.js';
import { MICRO, PLAN_ALLOWANCE } from '../domain/pricing.js';

export type WorkspacePlan = 'free' | 'pro' | 'max';
export type Workspace = typeof workspaces.$inferSelect;

/**
 * Creates a workspace with its undeletable `default` routing config and its plan's first allowance. Returns null when the name is taken
 * (or, for a personal workspace, when the user has one), which is also how two processes bootstrapping one fresh database agree on a
 * single winner.
 */
export async function createWorkspace(
  db: Db,
  input: { name: string; plan?: WorkspacePlan; defaultAgent: string; personalUserId?: string },
): Promise<Workspace | null> {
  return db.transaction(async (tx) => {
    const [workspace] = await tx
      .insert(workspaces)
      .values({ name: input.name, plan: input.plan ?? 'free', personalUserId: input.personalUserId ?? null })
      .onConflictDoNothing()
      .returning();
    if (!workspace) return null;
    await tx.insert(routingConfigs).values({
      workspaceId: workspace.id,
      name: DEFAULT_ROUTING_NAME,
      mode: DEFAULT_ROUTING.mode,
      effort: DEFAULT_ROUTING.effort,
      agent: input.defaultAgent,
    });
    await tx.insert(creditEntries).values({
      workspaceId: workspace.id,
      kind: 'allowance',
      amountMicro: PLAN_ALLOWANCE[workspace.plan] * MICRO,
      description: `${workspace.plan} plan allowance`,
    });
    return workspace;
  });
}

export async function findWorkspaceByName(db: Db, name: string): Promise<Workspace | null> {
  const [workspace] = await db.select().from(workspaces).where(eq(workspaces.name, name));
  return workspace ?? null;
}

export async function listWorkspaces(db: Db): Promise<Workspace[]> {
  return db.select().from(workspaces).orderBy(asc(workspaces.createdAt), asc(workspaces.name));
}

export async function findWorkspace(db: Db, id: string): Promise<Workspace | null> {
  const [row] = await db.select().from(workspaces).where(eq(workspaces.id, id));
  return row ?? null;
}
