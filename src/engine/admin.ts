/** Operator actions behind `svc admin`: workspaces, API keys and users. */
import { displayPrefix, parseDuration } from '../domain/api-keys.js';
import { ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import type { Db } from '../store/db.js';
import type { Environments, SetupResult } from './environments.js';
import { parseCredits } from '../domain/pricing.js';
import { parseAgentId } from '../domain/agents.js';
import { addCredits, creditBalance } from '../store/credits.js';
import { createApiKey, listApiKeys, revokeApiKey, type ApiKeyRecord } from '../store/api-keys.js';
import { createWorkspace, findWorkspaceByName, listWorkspaces, type Workspace, type WorkspacePlan } from '../store/workspaces.js';
import { findMembership, findUserByEmail, listUsers, listUserWorkspaces, ROLES, type Role, type UserRow } from '../store/users.js';
import { issueSignInLink, joinWorkspace, type JoinedWorkspace } from './users.js';

export const WORKSPACE_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/;
export const PLANS: readonly WorkspacePlan[] = ['free', 'pro', 'max'];

export async function addWorkspace(db: Db, name: string, plan: string, defaultAgent: string): Promise<Workspace> {
  if (!WORKSPACE_NAME.test(name)) {
    throw ValidationError.field('name', 'must be 1-63 letters, digits, ".", "_" or "-", starting with a letter or digit');
  }
  if (!(PLANS as readonly string[]).includes(plan)) throw ValidationError.field('plan', `must be one of ${PLANS.join(', ')}`);
  const agent = parseAgentId(defaultAgent);
  if ('error' in agent) throw ValidationError.field('default-agent', agent.error);
  const workspace = await createWorkspace(db, { name, plan: plan as WorkspacePlan, defaultAgent });
  if (!workspace) throw new ConflictError(`workspace "${name}" already exists`);
  return workspace;
}

async function requireWorkspace(db: Db, name: string): Promise<Workspace> {
  const workspace = await findWorkspaceByName(db, name);
  if (!workspace) throw new NotFoundError(`workspace "${name}" does not exist`);
  return workspace;
}

export async function addApiKey(
  db: Db,
  input: { workspace: string; name?: string; expiresIn?: string },
): Promise<{ key: string; record: ApiKeyRecord }> {
  let expiresAt: Date | null = null;
  if (input.expiresIn !== undefined) {
    const ms = parseDuration(input.expiresIn);
    if (ms === null) throw ValidationError.field('expires-in', 'must be a number and a unit: 30m, 12h, 7d, 4w or 1y');
    expiresAt = new Date(Date.now() + ms);
  }
  const workspace = await requireWorkspace(db, input.workspace);
  return createApiKey(db, { workspaceId: workspace.id, name: input.name ?? 'api key', expiresAt });
}

export async function workspaceApiKeys(db: Db, workspaceName: string): Promise<ApiKeyRecord[]> {
  const workspace = await requireWorkspace(db, workspaceName);
  return listApiKeys(db, workspace.id);
}

export async function removeApiKey(db: Db, workspaceName: string, idOrPrefix: string): Promise<ApiKeyRecord> {
  const isId = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(idOrPrefix);
  if (!isId && idOrPrefix.length < displayPrefix('x'.repeat(64)).length) {
    throw ValidationError.field('key', 'must be the key\'s id or its whole listed prefix (service_ and 6 characters)');
  }
  const workspace = await requireWorkspace(db, workspaceName);
  const { revoked, matches } = await revokeApiKey(db, workspace.id, idOrPrefix);
  if (matches > 1) throw new ConflictError(`"${idOrPrefix}" matches ${matches} keys; give more of the prefix or the id`);
  if (!revoked) throw new NotFoundError(`no API key "${idOrPrefix}" in workspace "${workspaceName}"`);
  return revoked;
}

export { listWorkspaces };
export { addRepository, setupEnvironment, workspaceRepositories, type SetupResult } from './repositories.js';

/** `svc admin environment config`: the config of the workspace environment's current version. */
export async function environmentConfig(db: Db, environments: Environments, workspaceName: string): Promise<{ version: number; text: string }> {
  const version = await environments.ensure(await requireWorkspace(db, workspaceName));
  return { version: version.version, text: version.record.config ?? '' };
}

/** `svc admin environment config --file F`: replaces the config (committed to svc/environment), then runs the setups it makes due. */
export async function setEnvironmentConfig(db: Db, environments: Environments, workspaceName: string, text: string): Promise<{ version: number; setup: SetupResult[] }> {
  const { version, setup } = await environments.setConfig(await requireWorkspace(db, workspaceName), text);
  return { version: version.version, setup };
}

export async function grantCredits(db: Db, workspaceName: string, amount: string): Promise<{ grantedMicro: number; balanceMicro: number }> {
  const micro = parseCredits(amount);
  if (micro === null) throw ValidationError.field('amount', 'must be a positive number of credits with at most six decimals, e.g. 25 or 2.5');
  const workspace = await requireWorkspace(db, workspaceName);
  await addCredits(db, { workspaceId: workspace.id, amountMicro: micro, kind: 'grant', description: 'granted by an operator' });
  return { grantedMicro: micro, balanceMicro: await creditBalance(db, workspace.id) };
}

export async function workspaceCredits(db: Db, workspaceName: string): Promise<number> {
  return creditBalance(db, (await requireWorkspace(db, workspaceName)).id);
}

/**
 * On a database with no workspace at all, creates `default` and its first API key. Two processes
 * starting on one fresh database agree on one winner through the unique workspace name.
 */
export async function bootstrap(db: Db, defaultAgent: string): Promise<{ workspace: Workspace; key: string } | null> {
  if ((await listWorkspaces(db)).length > 0) return null;
  const workspace = await createWorkspace(db, { name: 'default', plan: 'free', defaultAgent });
  if (!workspace) return null;
  const { key } = await createApiKey(db, { workspaceId: workspace.id, name: 'bootstrap' });
  return { workspace, key };
}

export interface CreatedUser extends JoinedWorkspace {
  /** The user's role in the workspace: the one given if the membership is new, else the one it had. */
  role: Role;
  signInLink: { url: string; expiresAt: Date };
}

/**
 * `svc admin user create`: the account (new ones with their personal workspace, confirmed by the
 * operator), its membership of the workspace and a one-time sign-in link, together. The operator may
 * hand out a link for any account; adding an account another workspace made needs `confirm`.
 */
export async function createUser(
  db: Db,
  input: { email: string; workspace: string; name?: string; role?: string; confirm?: boolean },
  options: { publicUrl: string; defaultAgent: string },
): Promise<CreatedUser> {
  const role = (input.role ?? 'member') as Role;
  if (!ROLES.includes(role)) throw ValidationError.field('role', `must be one of ${ROLES.join(', ')}`);
  const workspace = await requireWorkspace(db, input.workspace);
  return db.transaction(async (tx) => {
    const personalOf = workspace.personalUserId;
    if (personalOf !== null && (await findUserByEmail(tx, input.email.trim()))?.id !== personalOf) {
      throw new ConflictError(`workspace "${workspace.name}" is the personal workspace of another user`);
    }
    const joined = await joinWorkspace(tx, workspace, { ...input, role, defaultAgent: options.defaultAgent }, { madeBy: 'operator', confirm: input.confirm === true });
    const membership = await findMembership(tx, workspace.id, joined.user.id);
    const signInLink = await issueSignInLink(tx, joined.user.id, options.publicUrl);
    return { ...joined, role: membership?.role ?? role, signInLink };
  });
}

/** `svc admin user sign-in-link`: a fresh one-time link for an existing account; older ones stop working. */
export async function userSignInLink(db: Db, email: string, publicUrl: string): Promise<{ user: UserRow; signInLink: { url: string; expiresAt: Date } }> {
  const user = await findUserByEmail(db, email.trim());
  if (!user) throw new NotFoundError(`no user with email "${email}"`);
  return { user, signInLink: await issueSignInLink(db, user.id, publicUrl) };
}

export interface UserListing {
  id: string;
  email: string;
  name: string | null;
  hasPassword: boolean;
  createdAt: Date;
  workspaces: Array<{ id: string; name: string; role: Role; personal: boolean }>;
}

/** `svc admin user list`: every account with its workspaces; never a password hash. */
export async function userAccounts(db: Db): Promise<UserListing[]> {
  const rows = await listUsers(db);
  return Promise.all(
    rows.map(async (user) => ({
      id: user.id,
      email: user.email,
      name: user.name,
      hasPassword: user.passwordHash !== null,
      createdAt: user.createdAt,
      workspaces: (await listUserWorkspaces(db, user.id)).map(({ id, name, role, personal }) => ({ id, name, role, personal })),
    })),
  );
}
