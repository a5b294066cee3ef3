/**
 * Desktop runner connections (docs/runner-protocol.md "Pairing and enrollment", "Capabilities",
 * "Projects", "The user's side"): pairing codes issued to a signed-in user, enrollment with the code and
 * the verifier, reconnecting a revoked connection, heartbeats, the user's list of connections and their
 * revocation, and the check of a local task's target.
 *
 * Lock order (store/runs.ts): tasks, then their jobs, then the runner row. A reconnect reads the runner
 * first without a lock, locks the tasks and runs it ends (lockHeldRuns), and takes the runner's row last,
 * with a conditional UPDATE that re-checks everything it read; its shell grants after it, as a revocation
 * takes them.
 */
import { AppError, ConflictError, NotFoundError, ValidationError } from '../../domain/errors.js';
import {
  generatePairingCode,
  hashPairingCode,
  hashRunnerCredential,
  normalizePairingCode,
  verifierMatches,
} from '../../domain/runners.js';
import type { ValidationIssue } from '../../protocol/errors.js';
import {
  Capabilities,
  EnrollmentReceipt,
  RUNNER_LIMITS,
  type EnrollBody,
  type HeartbeatBody,
  type HeartbeatResponse,
  type ProjectRegistration,
  type RunnerSummary,
} from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { revokeRunnerSshGrants } from '../../store/delegations.js';
import {
  bumpWorkVersion,
  consumePairing,
  countWrongVerifier,
  findEnrollmentReceipt,
  findPairingByCode,
  findRedeemablePairing,
  findRunner,
  findRunnerByCredential,
  findRunnerProject,
  findUserRunner,
  insertEnrollment,
  insertPairing,
  insertRunner,
  listRunnerProjects,
  listUserRunners,
  lockRunner,
  projectRepositories,
  recordHeartbeat,
  replaceRunnerProjects,
  revokeUserRunner,
  rotateRevokedRunner,
  type RunnerProjectRow,
  type RunnerRow,
  type RunnerWithPresence,
} from '../../store/runners.js';
import { clearPendingPermissions, dropEventPartsOfJob, lockHeldRuns, releaseHeldRun } from '../../store/runs.js';
import { findMembership, findPersonalWorkspace } from '../../store/users.js';
import { finishLockedJob } from '../jobs.js';

/** How often a runner heartbeats; it counts as online for two of these. */
export const HEARTBEAT_INTERVAL_MS = 30_000;
export const ONLINE_WITHIN_MS = 2 * HEARTBEAT_INTERVAL_MS;

export const INVALID_PAIRING = 'Invalid pairing code or verifier';
export const RECONNECT_STOPPED_RUN =
  'The runner reconnected after its connection was revoked; this run was stopped. Send a follow-up message to run it again.';

// ---- Pairing ----

/**
 * A pairing code for the user's personal workspace (local runners live there), bound to the runner's
 * challenge. The code itself is answered once and only its hash is kept.
 */
export async function createPairing(
  db: Db,
  input: { userId: string; challenge: string; name?: string | undefined },
): Promise<{ pairingCode: string; expiresAt: Date }> {
  const workspace = await findPersonalWorkspace(db, input.userId);
  if (!workspace) {
    throw new AppError('forbidden', 'Local runners belong to your personal workspace, and you have none; ask an operator to create your account again');
  }
  // Codes are drawn from 25^8 values: a collision with a stored code is rare, and another draw settles it.
  for (let attempt = 0; attempt < 5; attempt++) {
    const pairingCode = generatePairingCode();
    const normalized = normalizePairingCode(pairingCode);
    if (normalized === null) throw new Error(`generated pairing code ${pairingCode} does not normalize`);
    const row = await insertPairing(db, {
      codeHash: hashPairingCode(normalized),
      challenge: input.challenge,
      userId: input.userId,
      workspaceId: workspace.id,
      name: input.name?.trim() || null,
      ttlMs: RUNNER_LIMITS.pairingCodeTtlMs,
    });
    if (row) return { pairingCode, expiresAt: row.expiresAt };
  }
  throw new Error('could not draw an unused pairing code in 5 attempts');
}

// ---- Enrollment ----

const invalidPairing = () => new AppError('unauthorized', INVALID_PAIRING);

function duplicateProjectIssues(projects: readonly ProjectRegistration[] | undefined, field: string): ValidationIssue[] {
  const seen = new Set<string>();
  const issues: ValidationIssue[] = [];
  (projects ?? []).forEach((project, index) => {
    if (seen.has(project.id)) issues.push({ field: `${field}.${index}.id`, message: 'is listed twice' });
    seen.add(project.id);
  });
  return issues;
}

/** What the runner registered, as stored; a row written by an older server reads as no registration. */
export function storedCapabilities(value: unknown): Capabilities {
  const parsed = Capabilities.safeParse(value);
  return parsed.success ? parsed.data : {};
}

/**
 * A registration's capabilities over the stored ones: each of `models`, `modelSource` and
 * `nativeControls` the registration carries replaces the stored one (an explicit empty list included);
 * one it leaves out stays, so an older runner's heartbeat does not erase the catalog.
 */
export function mergeCapabilities(stored: Capabilities, incoming: Capabilities): Capabilities {
  const merged: Capabilities = { ...stored };
  if (incoming.models !== undefined) merged.models = incoming.models;
  if (incoming.modelSource !== undefined) merged.modelSource = incoming.modelSource;
  if (incoming.nativeControls !== undefined) merged.nativeControls = incoming.nativeControls;
  return merged;
}

/**
 * Redeems a pairing code with its verifier and registers the runner's credential, capabilities and
 * projects, or re-establishes a revoked connection (`reconnect`). A retry with a credential that already
 * enrolled gets that enrollment's receipt back and changes nothing.
 */
export async function enroll(db: Db, body: EnrollBody): Promise<EnrollmentReceipt> {
  const credentialHash = hashRunnerCredential(body.credential);
  const earlier = await findEnrollmentReceipt(db, credentialHash);
  if (earlier !== null) return EnrollmentReceipt.parse(earlier);

  const issues = duplicateProjectIssues(body.projects, 'projects');
  if (body.reconnect && body.reconnect.credential === body.credential) {
    issues.push({ field: 'credential', message: 'must be a new credential, not the one being replaced' });
  }
  if (issues.length > 0) throw new ValidationError(issues);

  const normalized = normalizePairingCode(body.pairingCode);
  if (normalized === null) throw invalidPairing();
  const codeHash = hashPairingCode(normalized);
  const pairing = await findRedeemablePairing(db, codeHash, RUNNER_LIMITS.pairingAttempts);
  if (!pairing) return receiptOfTwin(db, body, credentialHash, codeHash);
  if (!verifierMatches(body.verifier, pairing.challenge)) {
    // Counted outside any transaction, so that the refusal cannot roll the count back.
    await countWrongVerifier(db, pairing.id);
    throw invalidPairing();
  }

  const enrolled = await db.transaction(async (tx) => {
    const redeemed = await consumePairing(tx, pairing.id, RUNNER_LIMITS.pairingAttempts);
    if (!redeemed) return null;
    return body.reconnect
      ? reconnect(tx, body, { ...body.reconnect, credentialHash, userId: redeemed.userId })
      : enrollNew(tx, body, { credentialHash, userId: redeemed.userId, workspaceId: redeemed.workspaceId });
  });
  return enrolled ?? receiptOfTwin(db, body, credentialHash, codeHash);
}

/**
 * The code was spent (or burnt, or expired) before this request could redeem it. When an identical
 * request redeemed it meanwhile (a retry racing the original: same credential, and a verifier that
 * matches the code's challenge), this one answers the receipt that one stored; otherwise the code is
 * invalid.
 */
async function receiptOfTwin(db: Db, body: EnrollBody, credentialHash: string, codeHash: string): Promise<EnrollmentReceipt> {
  const stored = await findEnrollmentReceipt(db, credentialHash);
  const pairing = stored === null ? null : await findPairingByCode(db, codeHash);
  if (stored === null || !pairing || !verifierMatches(body.verifier, pairing.challenge)) throw invalidPairing();
  const receipt = EnrollmentReceipt.parse(stored);
  if (receipt.userId !== pairing.userId) throw invalidPairing();
  return receipt;
}

const CREDENTIAL_TAKEN = 'This credential is already registered to another runner connection; generate a new one';

async function storeReceipt(tx: Db, runnerId: string, credentialHash: string, receipt: EnrollmentReceipt): Promise<void> {
  if (!(await insertEnrollment(tx, { runnerId, credentialHash, receipt }))) throw new ConflictError(CREDENTIAL_TAKEN);
}

async function enrollNew(
  tx: Db,
  body: EnrollBody,
  context: { credentialHash: string; userId: string; workspaceId: string },
): Promise<EnrollmentReceipt> {
  const runner = await insertRunner(tx, {
    userId: context.userId,
    workspaceId: context.workspaceId,
    name: body.name.trim(),
    platform: body.platform ?? null,
    runnerVersion: body.runnerVersion ?? null,
    credentialHash: context.credentialHash,
    capabilities: body.capabilities ?? {},
  });
  if (!runner) throw new ConflictError(CREDENTIAL_TAKEN);
  await replaceRunnerProjects(tx, runner.id, body.projects ?? []);
  const receipt = receiptOf(runner, { reconnected: false, finalizedRuns: [] });
  await storeReceipt(tx, runner.id, context.credentialHash, receipt);
  return receipt;
}

function receiptOf(runner: RunnerRow, outcome: { reconnected: boolean; finalizedRuns: string[] }): EnrollmentReceipt {
  return {
    runnerId: runner.id,
    userId: runner.userId,
    workspaceId: runner.workspaceId,
    name: runner.name,
    enrolledAt: runner.enrolledAt.toISOString(),
    reconnected: outcome.reconnected,
    finalizedRuns: outcome.finalizedRuns,
    heartbeatIntervalMs: HEARTBEAT_INTERVAL_MS,
  };
}

/**
 * Re-establishes a revoked connection: its claimed runs end FAILED (their process groups are stopped, the
 * runner confirmed it), the credential rotates, the revocation clears, and the runner id and project
 * identities stay. Everything happens in the caller's transaction, so a refusal leaves the code unused.
 */
async function reconnect(
  tx: Db,
  body: EnrollBody,
  context: { runnerId: string; credential: string; credentialHash: string; userId: string },
): Promise<EnrollmentReceipt> {
  const oldHash = hashRunnerCredential(context.credential);
  const current = await findRunner(tx, context.runnerId);
  // An unknown runner and a credential that is not its current one get the same answer.
  if (!current || current.credentialHash !== oldHash) {
    throw new AppError('unauthorized', 'reconnect.credential is not the current credential of that runner connection');
  }
  if (current.userId !== context.userId) {
    throw new AppError('forbidden', 'This pairing code was issued to another user than the one who owns that runner connection');
  }
  if (current.revokedAt === null) {
    throw new ConflictError('That runner connection is not revoked; revoke it first (POST /api/v1/runners/{id}/revoke), then reconnect');
  }
  if ((await findRunnerByCredential(tx, context.credentialHash)) !== null) throw new ConflictError(CREDENTIAL_TAKEN);

  const finalizedRuns = await finalizeHeldRuns(tx, current.id);
  const set: Parameters<typeof rotateRevokedRunner>[1]['set'] = { name: body.name.trim() };
  if (body.platform !== undefined) set.platform = body.platform;
  if (body.runnerVersion !== undefined) set.runnerVersion = body.runnerVersion;
  if (body.capabilities !== undefined) set.capabilities = mergeCapabilities(storedCapabilities(current.capabilities), body.capabilities);
  const runner = await rotateRevokedRunner(tx, { id: current.id, oldHash, newHash: context.credentialHash, set });
  // Someone else reconnected it (or it changed) since it was read: this attempt loses, and rolls back.
  if (!runner) throw new ConflictError('That runner connection changed while reconnecting; check it and try again');
  // The revocation ended them already; grants a server before that rule issued end here.
  await revokeRunnerSshGrants(tx, runner.id);
  if (body.projects !== undefined) await replaceRunnerProjects(tx, runner.id, body.projects);
  const receipt = receiptOf(runner, { reconnected: true, finalizedRuns });
  await storeReceipt(tx, runner.id, context.credentialHash, receipt);
  // Its long polls (none should be left) end, and the reconnected runner lists its runs afresh.
  await bumpWorkVersion(tx, runner.id);
  return receipt;
}

/**
 * Fails each run the runner holds IN_PROGRESS, once, as any failed job ends (its task moves on, log
 * followers are told), and lets go of the runs cancelled under the old connection, which waited for its
 * receipt. Nothing of these runs will answer a prompt or send a part any more: their pending permissions
 * and questions are cleared and their staged parts dropped. Their tasks are locked first, as for any
 * move of a run: an owner answering one of their prompts meanwhile waits, rather than deadlocks.
 */
async function finalizeHeldRuns(tx: Db, runnerId: string): Promise<string[]> {
  const finalized: string[] = [];
  for (const job of await lockHeldRuns(tx, runnerId)) {
    if (job.status === 'IN_PROGRESS') {
      await finishLockedJob(tx, job, { status: 'FAILED', error: RECONNECT_STOPPED_RUN }, { runnerState: null });
      finalized.push(job.id);
    } else {
      await releaseHeldRun(tx, job.id);
    }
    await clearPendingPermissions(tx, job.id);
    await dropEventPartsOfJob(tx, job.id);
  }
  return finalized;
}

// ---- Heartbeats ----

/** Whether the user may run local work for `workspaceId`: their personal workspace or one they belong to. */
async function mayWorkFor(db: Db, userId: string, workspaceId: string): Promise<boolean> {
  const personal = await findPersonalWorkspace(db, userId);
  if (personal?.id === workspaceId) return true;
  return (await findMembership(db, workspaceId, userId)) !== null;
}

export async function heartbeat(db: Db, runner: RunnerRow, body: HeartbeatBody): Promise<HeartbeatResponse> {
  const issues = duplicateProjectIssues(body.projects, 'projects');
  if (issues.length > 0) throw new ValidationError(issues);
  if (!(await mayWorkFor(db, runner.userId, body.workspaceId))) {
    throw new AppError('forbidden', 'workspaceId must be your personal workspace or a workspace you are a member of');
  }
  const updated = await db.transaction(async (tx) => {
    // Two heartbeats of one runner replace its registration one after the other, never interleaved.
    const locked = await lockRunner(tx, runner.id);
    if (!locked) throw new AppError('unauthorized', 'Invalid or missing runner credential');
    const set: Parameters<typeof recordHeartbeat>[2] = { workspaceId: body.workspaceId };
    if (body.runnerVersion !== undefined) set.runnerVersion = body.runnerVersion;
    if (body.capabilities !== undefined) set.capabilities = mergeCapabilities(storedCapabilities(locked.capabilities), body.capabilities);
    const row = await recordHeartbeat(tx, runner.id, set);
    if (body.projects !== undefined) await replaceRunnerProjects(tx, runner.id, body.projects);
    return row ?? locked;
  });
  return {
    runnerId: updated.id,
    workspaceId: updated.workspaceId,
    version: String(updated.workVersion),
    heartbeatIntervalMs: HEARTBEAT_INTERVAL_MS,
    serverTime: new Date().toISOString(),
  };
}

// ---- The user's side ----

function presentProject(row: RunnerProjectRow): RunnerSummary['projects'][number] {
  const list = projectRepositories(row);
  return { id: row.id, name: row.name, repositories: list, projectless: list.length === 0 };
}

function presentRunner(runner: RunnerWithPresence, projects: readonly RunnerProjectRow[]): RunnerSummary {
  return {
    id: runner.id,
    name: runner.name,
    workspaceId: runner.workspaceId,
    revoked: runner.revokedAt !== null,
    online: runner.online,
    lastSeenAt: runner.lastSeenAt?.toISOString() ?? null,
    platform: runner.platform,
    runnerVersion: runner.runnerVersion,
    capabilities: storedCapabilities(runner.capabilities),
    projects: projects.filter((project) => project.runnerId === runner.id).map(presentProject),
  };
}

/** Every connection of the user, in whichever workspace it works now. */
export async function listRunners(db: Db, userId: string): Promise<RunnerSummary[]> {
  const runners = await listUserRunners(db, userId, ONLINE_WITHIN_MS);
  const projects = await listRunnerProjects(db, runners.map((runner) => runner.id));
  return runners.map((runner) => presentRunner(runner, projects));
}

const runnerNotFound = () => new NotFoundError('Runner not found');

/**
 * Revokes one of the user's connections: its credential stops working at once (only GET /identity still
 * answers it), its long polls end, and so do its workspace shell grants (their forks are swept like
 * those of any ended grant). Its runs stay as they are until it reconnects.
 */
export async function revokeRunner(db: Db, userId: string, runnerId: string): Promise<RunnerSummary> {
  await db.transaction(async (tx) => {
    if (!(await revokeUserRunner(tx, userId, runnerId))) throw runnerNotFound();
    await revokeRunnerSshGrants(tx, runnerId);
    await bumpWorkVersion(tx, runnerId);
  });
  const runner = await findUserRunner(db, userId, runnerId, ONLINE_WITHIN_MS);
  if (!runner) throw runnerNotFound();
  return presentRunner(runner, await listRunnerProjects(db, [runner.id]));
}

// ---- Local task targets ----

export interface LocalTargetInput {
  userId: string;
  runnerId: string;
  projectId: string;
  /** The task's agent: `provider` is the runner's harness id, `model` the native model id. */
  agent: { provider: string; model: string };
}

/**
 * Checks where a local task would run: the user's own connection, not revoked; one of its registered
 * projects; a harness it registered; and a model in that harness's catalog when it registered one.
 * A runner that registered no `models` at all (an older runner) has no catalog, and nothing about the
 * agent is checked; a harness it declared in `nativeControls` but not in `models` has no catalog either.
 */
export async function resolveLocalTarget(db: Db, input: LocalTargetInput): Promise<{ runner: RunnerRow; project: RunnerProjectRow }> {
  const runner = await findRunner(db, input.runnerId);
  if (!runner || runner.userId !== input.userId) throw ValidationError.field('local.runnerId', 'is not one of your runner connections');
  if (runner.revokedAt !== null) throw ValidationError.field('local.runnerId', 'names a revoked runner connection; pair the computer again');
  const project = await findRunnerProject(db, runner.id, input.projectId);
  if (!project) throw ValidationError.field('local.projectId', 'is not a project this runner registered');

  const { models, nativeControls } = storedCapabilities(runner.capabilities);
  if (models !== undefined) {
    const { provider, model } = input.agent;
    const catalog = models[provider];
    if (catalog === undefined && nativeControls?.[provider] === undefined) {
      throw ValidationError.field('agent', `harness ${provider} is not one this runner registered`);
    }
    if (catalog !== undefined && !catalog.some((entry) => entry.id === model)) {
      throw ValidationError.field(
        'agent',
        catalog.length === 0 ? `the runner registered no models for harness ${provider}` : `model ${model} is not one the runner registered for harness ${provider}`,
      );
    }
  }
  return { runner, project };
}
