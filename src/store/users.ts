/** Users, their memberships in workspaces and their personal workspaces. */
import { and, asc, eq, sql } from 'drizzle-orm';
import type { Db } from './db.js';
import { memberships, users, workspaces } from './schema.js';
import { createWorkspace, type Workspace } from './workspaces.js';

export type UserRow = typeof users.$inferSelect;
export type Role = (typeof memberships.$inferSelect)['role'];
export const ROLES: readonly Role[] = ['owner', 'admin', 'member'];

export interface MemberRow {
  userId: string;
  email: string;
  name: string | null;
  role: Role;
  createdAt: Date;
}

export interface UserWorkspace {
  id: string;
  name: string;
  plan: Workspace['plan'];
  role: Role;
  personal: boolean;
}

export async function findUserByEmail(db: Db, email: string): Promise<UserRow | null> {
  const [row] = await db.select().from(users).where(sql`lower(${users.email}) = lower(${email})`);
  return row ?? null;
}

export async function findUser(db: Db, id: string): Promise<UserRow | null> {
  const [row] = await db.select().from(users).where(eq(users.id, id));
  return row ?? null;
}

export async function listUsers(db: Db): Promise<UserRow[]> {
  return db.select().from(users).orderBy(asc(users.createdAt), asc(users.email));
}

/**
 * Inserts a user unless the email (in any case) is taken. Returns the user and whether this call made
 * it; of two concurrent calls for one email exactly one creates it.
 */
export async function insertUserIfNew(
  db: Db,
  input: { email: string; name: string | null; createdByWorkspaceId: string | null; confirmed: boolean },
): Promise<{ user: UserRow; created: boolean }> {
  const [created] = await db
    .insert(users)
    .values({ email: input.email, name: input.name, createdByWorkspaceId: input.createdByWorkspaceId, confirmedAt: input.confirmed ? sql`now()` : null })
    .onConflictDoNothing()
    .returning();
  if (created) return { user: created, created: true };
  const existing = await findUserByEmail(db, input.email);
  if (!existing) throw new Error(`user ${input.email} conflicted on insert but cannot be found`);
  return { user: existing, created: false };
}

/**
 * Records that an operator vouched for the account: any workspace may add it from now on. The password
 * goes with it: whoever held the account before (the admin of the workspace that made it could have set
 * one) must not keep a way in. The caller ends the sessions and links in the same transaction.
 */
export async function confirmUser(db: Db, userId: string): Promise<UserRow> {
  const [row] = await db
    .update(users)
    .set({ confirmedAt: sql`coalesce(${users.confirmedAt}, now())`, passwordHash: null })
    .where(eq(users.id, userId))
    .returning();
  if (!row) throw new Error(`user ${userId} cannot be found`);
  return row;
}

export async function setPasswordHash(db: Db, userId: string, passwordHash: string): Promise<void> {
  await db.update(users).set({ passwordHash }).where(eq(users.id, userId));
}

/**
 * Replaces the password hash only while it is still `verified` (the one a password was checked against):
 * a hash cleared or changed since stays as it is. Returns whether it replaced it.
 */
export async function replacePasswordHash(db: Db, userId: string, verified: string, passwordHash: string): Promise<boolean> {
  const rows = await db
    .update(users)
    .set({ passwordHash })
    .where(and(eq(users.id, userId), eq(users.passwordHash, verified)))
    .returning({ id: users.id });
  return rows.length > 0;
}

/**
 * Locks the user's row for the caller's transaction and reads it. Whatever changes who may sign in (a
 * password sign-in, a link's redemption, an operator taking the account back) takes this lock first and
 * only then touches sessions or links, so they queue on one row in one order. `no key update` is the
 * lock an UPDATE of the row takes: it does not block the key-share lock that inserting a session or a
 * link (a foreign key to the row) takes, which would otherwise deadlock with a holder of that row.
 */
export async function lockUser(tx: Db, userId: string): Promise<UserRow | null> {
  const [row] = await tx.select().from(users).where(eq(users.id, userId)).for('no key update');
  return row ?? null;
}

/** Adds the membership unless the user already has one in that workspace; returns whether it added it. */
export async function addMembership(db: Db, input: { workspaceId: string; userId: string; role: Role }): Promise<boolean> {
  const rows = await db.insert(memberships).values(input).onConflictDoNothing().returning({ userId: memberships.userId });
  return rows.length > 0;
}

export async function findMembership(db: Db, workspaceId: string, userId: string): Promise<{ role: Role } | null> {
  const [row] = await db
    .select({ role: memberships.role })
    .from(memberships)
    .where(and(eq(memberships.workspaceId, workspaceId), eq(memberships.userId, userId)));
  return row ?? null;
}

const memberColumns = { userId: users.id, email: users.email, name: users.name, role: memberships.role, createdAt: memberships.createdAt };

export async function listMembers(db: Db, workspaceId: string): Promise<MemberRow[]> {
  return db
    .select(memberColumns)
    .from(memberships)
    .innerJoin(users, eq(users.id, memberships.userId))
    .where(eq(memberships.workspaceId, workspaceId))
    .orderBy(asc(memberships.createdAt), asc(users.email));
}

export async function findMember(db: Db, workspaceId: string, userId: string): Promise<MemberRow | null> {
  const [row] = await db
    .select(memberColumns)
    .from(memberships)
    .innerJoin(users, eq(users.id, memberships.userId))
    .where(and(eq(memberships.workspaceId, workspaceId), eq(memberships.userId, userId)));
  return row ?? null;
}

/** The workspaces a user belongs to, the personal one first, then by name. */
export async function listUserWorkspaces(db: Db, userId: string): Promise<UserWorkspace[]> {
  const rows = await db
    .select({
      id: workspaces.id,
      name: workspaces.name,
      plan: workspaces.plan,
      role: memberships.role,
      personalUserId: workspaces.personalUserId,
    })
    .from(memberships)
    .innerJoin(workspaces, eq(workspaces.id, memberships.workspaceId))
    .where(eq(memberships.userId, userId))
    .orderBy(asc(workspaces.name));
  return rows
    .map(({ personalUserId, ...row }) => ({ ...row, personal: personalUserId === userId }))
    .sort((a, b) => Number(b.personal) - Number(a.personal));
}

export async function findPersonalWorkspace(db: Db, userId: string): Promise<Workspace | null> {
  const [row] = await db.select().from(workspaces).where(eq(workspaces.personalUserId, userId));
  return row ?? null;
}

/**
 * The user's personal workspace, created (with the user as its owner) when missing, under the first of
 * `names` that is free. Idempotent and safe when two callers race: the unique index on
 * `personal_user_id` lets one of them create it.
 */
export async function ensurePersonalWorkspace(
  db: Db,
  input: { userId: string; names: readonly string[]; defaultAgent: string },
): Promise<Workspace> {
  let workspace = await findPersonalWorkspace(db, input.userId);
  for (const name of input.names) {
    if (workspace) break;
    workspace =
      (await createWorkspace(db, { name, plan: 'free', defaultAgent: input.defaultAgent, personalUserId: input.userId })) ??
      (await findPersonalWorkspace(db, input.userId));
  }
  if (!workspace) throw new Error(`every name for the personal workspace of user ${input.userId} is taken`);
  await addMembership(db, { workspaceId: workspace.id, userId: input.userId, role: 'owner' });
  return workspace;
}
