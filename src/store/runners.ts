/**
 * Desktop runners, their pairings, enrollment receipts and projects. Each runner's `work_version` moves
 * whenever its runs change (`bumpWorkVersion`), and a NOTIFY on RUNNER_CHANNEL (payload: the runner id)
 * wakes the signals long polls waiting for it in every process.
 */
import { and, asc, eq, inArray, isNotNull, isNull, lt, notInArray, sql } from 'drizzle-orm';
import { ProjectRepository } from '../protocol/runner.js';
import { notify, type Db } from './db.js';
import { runnerEnrollments, runnerPairings, runnerProjects, runners } from './schema.js';

export type RunnerRow = typeof runners.$inferSelect;

/** NOTIFY channel for a runner's changes: its runs, controls or review requests. Payload: the runner id. */
export const RUNNER_CHANNEL = 'svc_runner';

/** The runner whose current credential hashes to `credentialHash` (revoked ones too), or null. */
export async function findRunnerByCredential(db: Db, credentialHash: string): Promise<RunnerRow | null> {
  const [row] = await db.select().from(runners).where(eq(runners.credentialHash, credentialHash));
  return row ?? null;
}

export async function findRunner(db: Db, id: string): Promise<RunnerRow | null> {
  const [row] = await db.select().from(runners).where(eq(runners.id, id));
  return row ?? null;
}

/** Presence: kept to the second, which spares the row a write on most of a busy runner's requests. */
export async function touchRunner(db: Db, id: string): Promise<void> {
  await db
    .update(runners)
    .set({ lastSeenAt: sql`now()` })
    .where(sql`${runners.id} = ${id} and (${runners.lastSeenAt} is null or ${runners.lastSeenAt} < now() - interval '1 second')`);
}

/** Moves the runner's work version on and wakes its long polls (when the transaction commits). */
export async function bumpWorkVersion(tx: Db, runnerId: string): Promise<void> {
  await tx.update(runners).set({ workVersion: sql`${runners.workVersion} + 1` }).where(eq(runners.id, runnerId));
  await notify(tx, RUNNER_CHANNEL, runnerId);
}

/** Wakes the runner's long polls without changing its work version (a control, a review request). */
export async function wakeRunner(tx: Db, runnerId: string): Promise<void> {
  await notify(tx, RUNNER_CHANNEL, runnerId);
}

// ---- Pairing and enrollment (engine/runners/enrollment.ts) ----

export type PairingRow = typeof runnerPairings.$inferSelect;
export type RunnerProjectRow = typeof runnerProjects.$inferSelect;

/** How long spent and expired pairing codes stay (for the record) before the user's next code clears them. */
const SPENT_PAIRINGS_KEPT = sql`interval '1 day'`;

/**
 * Stores a new pairing code (by its hash). Null when the hash is taken (a code drawn twice): the caller
 * draws another. The user's codes spent or expired over a day ago go at the same time.
 */
export async function insertPairing(
  db: Db,
  input: { codeHash: string; challenge: string; userId: string; workspaceId: string; name: string | null; ttlMs: number },
): Promise<PairingRow | null> {
  await db
    .delete(runnerPairings)
    .where(and(eq(runnerPairings.userId, input.userId), sql`coalesce(${runnerPairings.usedAt}, ${runnerPairings.expiresAt}) < now() - ${SPENT_PAIRINGS_KEPT}`));
  const [row] = await db
    .insert(runnerPairings)
    .values({
      codeHash: input.codeHash,
      challenge: input.challenge,
      userId: input.userId,
      workspaceId: input.workspaceId,
      name: input.name,
      expiresAt: sql`now() + ${input.ttlMs}::float8 * interval '1 millisecond'`,
    })
    .onConflictDoNothing()
    .returning();
  return row ?? null;
}

/** A pairing code that may still be redeemed: unused, unexpired and not burnt by wrong verifiers. */
export async function findRedeemablePairing(db: Db, codeHash: string, maxAttempts: number): Promise<PairingRow | null> {
  const [row] = await db
    .select()
    .from(runnerPairings)
    .where(
      and(
        eq(runnerPairings.codeHash, codeHash),
        isNull(runnerPairings.usedAt),
        sql`${runnerPairings.expiresAt} > now()`,
        lt(runnerPairings.failedAttempts, maxAttempts),
      ),
    );
  return row ?? null;
}

/** The pairing of a code hash in any state (used, expired, burnt), or null. */
export async function findPairingByCode(db: Db, codeHash: string): Promise<PairingRow | null> {
  const [row] = await db.select().from(runnerPairings).where(eq(runnerPairings.codeHash, codeHash));
  return row ?? null;
}

export async function countWrongVerifier(db: Db, pairingId: string): Promise<void> {
  await db
    .update(runnerPairings)
    .set({ failedAttempts: sql`${runnerPairings.failedAttempts} + 1` })
    .where(and(eq(runnerPairings.id, pairingId), isNull(runnerPairings.usedAt)));
}

/**
 * Marks the code used if it still may be: of two enrollments racing with one code, exactly one gets the
 * row (the other's UPDATE waits for the first to commit, then finds `used_at` set).
 */
export async function consumePairing(tx: Db, pairingId: string, maxAttempts: number): Promise<PairingRow | null> {
  const [row] = await tx
    .update(runnerPairings)
    .set({ usedAt: sql`now()` })
    .where(
      and(
        eq(runnerPairings.id, pairingId),
        isNull(runnerPairings.usedAt),
        sql`${runnerPairings.expiresAt} > now()`,
        lt(runnerPairings.failedAttempts, maxAttempts),
      ),
    )
    .returning();
  return row ?? null;
}

/** The receipt stored for an enrollment with this credential, or null. */
export async function findEnrollmentReceipt(db: Db, credentialHash: string): Promise<unknown> {
  const [row] = await db.select({ receipt: runnerEnrollments.receipt }).from(runnerEnrollments).where(eq(runnerEnrollments.credentialHash, credentialHash));
  return row?.receipt ?? null;
}

/** Stores a receipt under its credential; false when that credential already has one. */
export async function insertEnrollment(tx: Db, input: { runnerId: string; credentialHash: string; receipt: unknown }): Promise<boolean> {
  const rows = await tx.insert(runnerEnrollments).values(input).onConflictDoNothing().returning({ id: runnerEnrollments.id });
  return rows.length > 0;
}

/** A new runner; null when its credential hash is already another runner's. */
export async function insertRunner(
  tx: Db,
  input: Pick<typeof runners.$inferInsert, 'userId' | 'workspaceId' | 'name' | 'platform' | 'runnerVersion' | 'credentialHash' | 'capabilities'>,
): Promise<RunnerRow | null> {
  const [row] = await tx.insert(runners).values(input).onConflictDoNothing().returning();
  return row ?? null;
}

/**
 * Re-establishes a revoked connection under a new credential: only while it is still revoked and still
 * holds `oldHash` (null otherwise, and nothing changes).
 */
export async function rotateRevokedRunner(
  tx: Db,
  input: { id: string; oldHash: string; newHash: string; set: Partial<Pick<RunnerRow, 'name' | 'platform' | 'runnerVersion' | 'capabilities'>> },
): Promise<RunnerRow | null> {
  const [row] = await tx
    .update(runners)
    .set({ ...input.set, credentialHash: input.newHash, revokedAt: null, enrolledAt: sql`now()` })
    .where(and(eq(runners.id, input.id), eq(runners.credentialHash, input.oldHash), isNotNull(runners.revokedAt)))
    .returning();
  return row ?? null;
}

/** Locks the runner's row for the rest of the transaction (serializes its registrations). */
export async function lockRunner(tx: Db, id: string): Promise<RunnerRow | null> {
  const [row] = await tx.select().from(runners).where(eq(runners.id, id)).for('update');
  return row ?? null;
}

/** A heartbeat: where the runner works now, what it runs, and that it is alive. */
export async function recordHeartbeat(
  tx: Db,
  id: string,
  set: Pick<RunnerRow, 'workspaceId'> & Partial<Pick<RunnerRow, 'runnerVersion' | 'capabilities'>>,
): Promise<RunnerRow | null> {
  const [row] = await tx
    .update(runners)
    .set({ ...set, lastSeenAt: sql`now()` })
    .where(eq(runners.id, id))
    .returning();
  return row ?? null;
}

/**
 * Makes the runner's project list exactly `projects`: new ones are added, known ones renamed and their
 * repositories replaced, and those left out deleted (their tasks keep the project id).
 */
export async function replaceRunnerProjects(
  tx: Db,
  runnerId: string,
  projects: ReadonlyArray<{ id: string; name: string; repositories: unknown[] }>,
): Promise<void> {
  const keep = projects.map((project) => project.id);
  await tx
    .delete(runnerProjects)
    .where(and(eq(runnerProjects.runnerId, runnerId), keep.length > 0 ? notInArray(runnerProjects.id, keep) : undefined));
  if (projects.length === 0) return;
  await tx
    .insert(runnerProjects)
    .values(projects.map((project) => ({ runnerId, id: project.id, name: project.name, repositories: project.repositories })))
    .onConflictDoUpdate({
      target: [runnerProjects.runnerId, runnerProjects.id],
      set: { name: sql`excluded.name`, repositories: sql`excluded.repositories`, updatedAt: sql`now()` },
    });
}

export async function listRunnerProjects(db: Db, runnerIds: readonly string[]): Promise<RunnerProjectRow[]> {
  if (runnerIds.length === 0) return [];
  return db
    .select()
    .from(runnerProjects)
    .where(inArray(runnerProjects.runnerId, [...runnerIds]))
    .orderBy(asc(runnerProjects.name), asc(runnerProjects.id));
}

/**
 * The repositories of a registered project, as the runner registered them (none: the projectless
 * environment): the one reading of the stored list, for the user's list, delegation and the workspace
 * shell. Each entry was checked on registration; of one that a later, stricter rule refuses, only the
 * name stays, as every repository still counts (a delegation must cover each one).
 */
export function projectRepositories(project: Pick<RunnerProjectRow, 'repositories'>): ProjectRepository[] {
  const stored: unknown[] = Array.isArray(project.repositories) ? project.repositories : [];
  return stored.flatMap((entry) => {
    const parsed = ProjectRepository.safeParse(entry);
    if (parsed.success) return [parsed.data];
    const name = ProjectRepository.shape.name.safeParse((entry as { name?: unknown } | null)?.name);
    return name.success ? [{ name: name.data }] : [];
  });
}

export async function findRunnerProject(db: Db, runnerId: string, projectId: string): Promise<RunnerProjectRow | null> {
  const [row] = await db.select().from(runnerProjects).where(and(eq(runnerProjects.runnerId, runnerId), eq(runnerProjects.id, projectId)));
  return row ?? null;
}

/** A runner with whether it was seen within `onlineWithinMs`, judged by the database's clock. */
export type RunnerWithPresence = RunnerRow & { online: boolean };

const presence = (withinMs: number) =>
  sql<boolean>`(${runners.revokedAt} is null and ${runners.lastSeenAt} > now() - ${withinMs}::float8 * interval '1 millisecond')`;

export async function listUserRunners(db: Db, userId: string, onlineWithinMs: number): Promise<RunnerWithPresence[]> {
  const rows = await db
    .select({ runner: runners, online: presence(onlineWithinMs) })
    .from(runners)
    .where(eq(runners.userId, userId))
    .orderBy(asc(runners.createdAt), asc(runners.id));
  return rows.map(({ runner, online }) => ({ ...runner, online: online === true }));
}

export async function findUserRunner(db: Db, userId: string, id: string, onlineWithinMs: number): Promise<RunnerWithPresence | null> {
  const [row] = await db
    .select({ runner: runners, online: presence(onlineWithinMs) })
    .from(runners)
    .where(and(eq(runners.id, id), eq(runners.userId, userId)));
  return row ? { ...row.runner, online: row.online === true } : null;
}

/** Revokes the user's runner (a second revoke keeps the first time); false when it is not theirs. */
export async function revokeUserRunner(tx: Db, userId: string, id: string): Promise<boolean> {
  const rows = await tx
    .update(runners)
    .set({ revokedAt: sql`coalesce(${runners.revokedAt}, now())` })
    .where(and(eq(runners.id, id), eq(runners.userId, userId)))
    .returning({ id: runners.id });
  return rows.length > 0;
}
