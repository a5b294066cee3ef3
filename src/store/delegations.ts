/**
 * Cloud delegations of local runs and the temporary workspace shell grants issued to them. The rules
 * about them live in engine/runners (delegation.ts, workspace-shell.ts).
 */
import { and, asc, eq, getTableColumns, inArray, isNull, sql, type SQL } from 'drizzle-orm';
import type { Db } from './db.js';
import { delegations, jobs, messages, repositories, runners, tasks, workspaceSshGrants } from './schema.js';
import type { JobRow, TaskRow } from './tasks.js';

export type DelegationRow = typeof delegations.$inferSelect;
export type SshGrantRow = typeof workspaceSshGrants.$inferSelect;
type MessageRow = typeof messages.$inferSelect;

export async function findDelegation(db: Db, localTaskId: string, invocationId: string, forUpdate = false): Promise<DelegationRow | null> {
  const query = db
    .select()
    .from(delegations)
    .where(and(eq(delegations.localTaskId, localTaskId), eq(delegations.invocationId, invocationId)));
  const [row] = forUpdate ? await query.for('update') : await query;
  return row ?? null;
}

/** Records a delegation; null when the same local task and invocation id have one already. */
export async function insertDelegation(
  tx: Db,
  values: { localTaskId: string; invocationId: string; inputDigest: string; cloudTaskId: string },
): Promise<DelegationRow | null> {
  const [row] = await tx.insert(delegations).values(values).onConflictDoNothing().returning();
  return row ?? null;
}

export async function markDelegationDispatched(tx: Db, id: string, jobId: string): Promise<void> {
  await tx.update(delegations).set({ dispatchedJobId: jobId }).where(eq(delegations.id, id));
}

export async function findTask(db: Db, id: string, forUpdate = false): Promise<TaskRow | null> {
  const query = db.select().from(tasks).where(eq(tasks.id, id));
  const [row] = forUpdate ? await query.for('update') : await query;
  return row ?? null;
}

export async function linkTask(tx: Db, localTaskId: string, cloudTaskId: string): Promise<void> {
  await tx.update(tasks).set({ linkedTaskId: cloudTaskId, updatedAt: sql`now()` }).where(eq(tasks.id, localTaskId));
}

/** The cloud task's message that carries the handoff of one invocation of one local task, if stored. */
export async function findHandoffMessage(db: Db, cloudTaskId: string, sourceTaskId: string, invocationId: string): Promise<MessageRow | null> {
  const [row] = await db
    .select()
    .from(messages)
    .where(
      and(
        eq(messages.taskId, cloudTaskId),
        sql`${messages.metadata}->'handoff'->>'sourceTaskId' = ${sourceTaskId}`,
        sql`${messages.metadata}->'handoff'->>'invocationId' = ${invocationId}`,
      ),
    )
    .orderBy(asc(messages.seq))
    .limit(1);
  return row ?? null;
}

export async function findJobOfMessage(db: Db, messageId: string): Promise<JobRow | null> {
  const [row] = await db.select().from(jobs).where(eq(jobs.messageId, messageId)).orderBy(asc(jobs.seq)).limit(1);
  return row ?? null;
}

/** Per workspace, which of `fullNames` are connected to it. */
export async function connectedRepositories(db: Db, workspaceIds: readonly string[], fullNames: readonly string[]): Promise<Map<string, Set<string>>> {
  const connected = new Map<string, Set<string>>(workspaceIds.map((id) => [id, new Set<string>()]));
  if (workspaceIds.length === 0 || fullNames.length === 0) return connected;
  const rows = await db
    .select({ workspaceId: repositories.workspaceId, fullName: repositories.fullName })
    .from(repositories)
    .where(and(inArray(repositories.workspaceId, [...workspaceIds]), inArray(repositories.fullName, [...fullNames])));
  for (const row of rows) connected.get(row.workspaceId)?.add(row.fullName);
  return connected;
}

// ---- Workspace shell grants ----

export async function insertSshGrant(
  db: Db,
  values: { tokenHash: string; userId: string; workspaceId: string; runnerId: string; jobId: string; ttlMs: number },
): Promise<SshGrantRow> {
  const { ttlMs, ...rest } = values;
  // The database's clock sets the expiry, as it is the one that checks it.
  const [row] = await db
    .insert(workspaceSshGrants)
    .values({ ...rest, expiresAt: sql`now() + ${ttlMs}::double precision * interval '1 millisecond'` })
    .returning();
  if (!row) throw new Error('insert returned no row');
  return row;
}

/** A grant's own condition to work: unexpired and not revoked. */
const grantWorks = () => and(isNull(workspaceSshGrants.revokedAt), sql`${workspaceSshGrants.expiresAt} > now()`);

/**
 * A grant that still works: unexpired, not revoked, and issued to a runner connection that exists and is
 * not revoked (revoking the connection revokes its grants too; this holds should one be missed).
 */
async function findLiveSshGrant(db: Db, condition: SQL): Promise<SshGrantRow | null> {
  const [row] = await db
    .select(getTableColumns(workspaceSshGrants))
    .from(workspaceSshGrants)
    .innerJoin(runners, eq(runners.id, workspaceSshGrants.runnerId))
    .where(and(condition, grantWorks(), isNull(runners.revokedAt)));
  return row ?? null;
}

/** The grant of a token hash, while it works (see findLiveSshGrant). */
export async function findActiveSshGrant(db: Db, tokenHash: string): Promise<SshGrantRow | null> {
  return findLiveSshGrant(db, eq(workspaceSshGrants.tokenHash, tokenHash));
}

/** Whether a grant still works: a command queued behind others checks again before it starts. */
export async function isSshGrantActive(db: Db, id: string): Promise<boolean> {
  return (await findLiveSshGrant(db, eq(workspaceSshGrants.id, id))) !== null;
}

/** How many of a run's grants still work (unexpired, not revoked). */
export async function countActiveSshGrants(db: Db, jobId: string): Promise<{ count: number; firstExpiry: Date | null }> {
  const [row] = await db
    .select({ count: sql<number>`count(*)::int`, firstExpiry: sql<string | Date | null>`min(${workspaceSshGrants.expiresAt})` })
    .from(workspaceSshGrants)
    .where(and(eq(workspaceSshGrants.jobId, jobId), grantWorks()));
  return { count: row?.count ?? 0, firstExpiry: row?.firstExpiry ? new Date(row.firstExpiry) : null };
}

/** Revokes every grant of a runner connection that still works (the connection was revoked or replaced). */
export async function revokeRunnerSshGrants(tx: Db, runnerId: string): Promise<void> {
  await tx
    .update(workspaceSshGrants)
    .set({ revokedAt: sql`now()` })
    .where(and(eq(workspaceSshGrants.runnerId, runnerId), grantWorks()));
}

/**
 * Of the grant ids given, those whose forks may go: grants that no longer exist, and grants that ended
 * (expired or revoked) longer than `graceMs` ago, so that a command started just before the end has finished.
 */
export async function endedSshGrants(db: Db, ids: readonly string[], graceMs: number): Promise<Set<string>> {
  if (ids.length === 0) return new Set();
  const live = await db
    .select({ id: workspaceSshGrants.id })
    .from(workspaceSshGrants)
    .where(
      and(
        inArray(workspaceSshGrants.id, [...ids]),
        sql`least(${workspaceSshGrants.expiresAt}, coalesce(${workspaceSshGrants.revokedAt}, 'infinity'::timestamptz)) > now() - ${graceMs}::double precision * interval '1 millisecond'`,
      ),
    );
  const keep = new Set(live.map((row) => row.id));
  return new Set(ids.filter((id) => !keep.has(id)));
}
