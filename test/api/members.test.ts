/**
 * Workspace members on both databases: adding people by email (creating the account, with a one-time
 * link only for an account the request created and only to a signed-in person, never to an API key),
 * accounts another workspace made (409 until an operator confirms them, which takes them back from whoever
 * held them), listing, and who may add whom.
 */
import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import { hashPassword } from '../../src/domain/passwords.js';
import { createUser } from '../../src/engine/admin.js';
import { findOrCreateAccount, issueSignInLink, openPasswordSession, SESSION_TTL_MS, verifySignInPassword } from '../../src/engine/users.js';
import { queryRows } from '../../src/store/db.js';
import { findRoutingConfigs, upsertRoutingConfig } from '../../src/store/routing.js';
import { addMembership, findPersonalWorkspace, findUserByEmail, setPasswordHash, type Role } from '../../src/store/users.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { postgresUrl, testDrivers } from '../support/db.js';

const LINK = new RegExp(`^${TEST_PUBLIC_URL}/auth/sign-in/[A-Za-z0-9_-]{43}$`);
const email = (label: string) => `${label}-${randomBytes(4).toString('hex')}@example.com`;

describe.each(testDrivers)('workspace members on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const db = () => api.db.database.db;

  /** Redeems a sign-in link through the API: the session's cookie and CSRF token. */
  async function redeem(link: string): Promise<{ cookie: string; csrf: string }> {
    const signedIn = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: link.slice(link.lastIndexOf('/') + 1) } });
    expect(signedIn.statusCode, signedIn.body).toBe(200);
    return { cookie: String(signedIn.headers['set-cookie']).split(';')[0]!, csrf: signedIn.json().csrfToken };
  }

  /** Signs a user in through a one-time link; requests carry the cookie, the CSRF token and a workspace. */
  async function sessionOf(userId: string, workspaceId?: string) {
    const { cookie, csrf } = await redeem((await issueSignInLink(db(), userId, TEST_PUBLIC_URL)).url);
    return (method: InjectOptions['method'], url: string, body?: unknown): Promise<LightMyRequestResponse> =>
      api.app.inject({
        method,
        url,
        headers: { cookie, 'x-csrf-token': csrf, ...(workspaceId ? { 'x-svc-workspace': workspaceId } : {}) },
        ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }),
      });
  }

  async function memberOf(tenant: Tenant, role: Role) {
    const { user } = await db().transaction((tx) => findOrCreateAccount(tx, { email: email(role), defaultAgent: DEFAULT_AGENT }));
    await addMembership(db(), { workspaceId: tenant.workspace.id, userId: user.id, role });
    return { user, request: await sessionOf(user.id, tenant.workspace.id) };
  }

  it('creates an account with a one-time link for a signed-in admin; an API key gets the account and no link', async () => {
    const tenant = await api.newTenant();
    const admin = await memberOf(tenant, 'admin');
    // The new account's personal workspace starts with the agent of the workspace that added it.
    await upsertRoutingConfig(db(), tenant.workspace.id, 'default', { mode: 'agent', agent: 'openai/gpt-5', effort: 'medium', instructions: null });
    const address = email('new');
    const created = await admin.request('POST', '/api/v1/members', { email: address, name: 'Lin', role: 'admin' });
    expect(created.statusCode, created.body).toBe(201);
    const body = created.json();
    expect(body).toEqual({
      member: { userId: expect.any(String), email: address, name: 'Lin', role: 'admin', createdAt: expect.any(String) },
      accountCreated: true,
      signInLink: expect.stringMatching(LINK),
      signInLinkExpiresAt: expect.any(String),
    });
    const personal = await findPersonalWorkspace(db(), body.member.userId);
    expect(personal).toMatchObject({ plan: 'free' });
    expect((await findRoutingConfigs(db(), personal!.id, null)).fallback?.agent).toBe('openai/gpt-5');
    expect(await findUserByEmail(db(), address)).toMatchObject({ createdByWorkspaceId: tenant.workspace.id, confirmedAt: null });

    // The link's button signs the new member in, and the session sees both workspaces.
    const opened = await api.app.inject({ method: 'POST', url: String(body.signInLink).slice(TEST_PUBLIC_URL.length) });
    expect(opened.statusCode).toBe(303);
    const cookie = String(opened.headers['set-cookie']).split(';')[0]!;
    const session = await api.app.inject({ method: 'GET', url: '/api/v1/auth/session', headers: { cookie } });
    expect(session.json().workspaces.map((workspace: { id: string; role: string }) => [workspace.id, workspace.role])).toEqual([
      [personal!.id, 'owner'],
      [tenant.workspace.id, 'admin'],
    ]);

    // With the workspace's API key: the account and the membership, but never a link, made or answered.
    const byKey = email('by-key');
    const keyed = await tenant.request('POST', '/api/v1/members', { email: byKey });
    expect(keyed.statusCode, keyed.body).toBe(201);
    expect(keyed.json()).toMatchObject({ member: { email: byKey, role: 'member' }, accountCreated: true, signInLink: null, signInLinkExpiresAt: null });
    const links = await queryRows<{ n: number }>(db(), sql`select count(*)::int as n from sign_in_links where user_id = ${keyed.json().member.userId}`);
    expect(links).toEqual([{ n: 0 }]);

    const twice = await tenant.request('POST', '/api/v1/members', { email: address });
    expect(twice.statusCode).toBe(409);
    expect(twice.json().error).toMatchObject({ code: 'conflict', message: `${address} is already a member of this workspace` });
    const listed = await tenant.request('GET', '/api/v1/members');
    expect(listed.statusCode).toBe(200);
    expect(listed.json().members.map((member: { email: string }) => member.email)).toEqual(expect.arrayContaining([address, byKey]));
  });

  const sessionStatus = async (cookie: string) => (await api.app.inject({ method: 'GET', url: '/api/v1/auth/session', headers: { cookie } })).statusCode;
  const passwordSignIn = (address: string, password: string) =>
    api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email: address, password } });

  it('refuses an account another workspace made with 409 until an operator confirms it; then adds it without a link', async () => {
    const maker = await api.newTenant();
    const makerAdmin = await memberOf(maker, 'admin');
    const address = email('made');
    const made = await makerAdmin.request('POST', '/api/v1/members', { email: address, name: 'Lin' });
    expect(made.statusCode, made.body).toBe(201);
    const userId: string = made.json().member.userId;

    // The maker's admin can hold the account: open its link, keep the session, set a password.
    const held = await redeem(made.json().signInLink);
    const password = 'the maker admin chose this';
    const set = await api.app.inject({
      method: 'POST',
      url: '/api/v1/auth/password',
      headers: { cookie: held.cookie, 'x-csrf-token': held.csrf },
      payload: { newPassword: password },
    });
    expect(set.statusCode, set.body).toBe(204);
    expect((await passwordSignIn(address, password)).statusCode).toBe(200);

    // Whoever holds that account (the maker's admin could) must not get into another workspace under this address.
    const other = await api.newTenant();
    const otherOwner = await memberOf(other, 'owner');
    for (const request of [other.request, otherOwner.request]) {
      const refused = await request('POST', '/api/v1/members', { email: address.toUpperCase() });
      expect(refused.statusCode, refused.body).toBe(409);
      expect(refused.json().error).toEqual({
        code: 'conflict',
        message: `${address} has an account that another workspace created; an operator must confirm it (svc admin user create --confirm) before this workspace can add it`,
      });
    }
    expect((await other.request('GET', '/api/v1/members')).json().members.map((member: { userId: string }) => member.userId)).not.toContain(userId);

    // The operator too is refused without saying so, and confirms with the flag.
    const options = { publicUrl: TEST_PUBLIC_URL, defaultAgent: DEFAULT_AGENT };
    const third = await api.newTenant();
    await expect(createUser(db(), { email: address, workspace: third.workspace.name }, options)).rejects.toThrow(/no operator has confirmed it; .* add --confirm$/);
    // Its own workspace still may, without confirming (the account left it first, so it is added again).
    await db().execute(sql`delete from memberships where workspace_id = ${maker.workspace.id} and user_id = ${userId}`);
    const own = await createUser(db(), { email: address, workspace: maker.workspace.name }, options);
    expect(own).toMatchObject({ created: false, membershipAdded: true, role: 'member' });
    expect(await findUserByEmail(db(), address)).toMatchObject({ confirmedAt: null });
    expect(await sessionStatus(held.cookie)).toBe(200);

    // Confirming takes the account back from whoever held it: the operator's link is the only way in.
    const unused = await issueSignInLink(db(), userId, TEST_PUBLIC_URL);
    const confirmed = await createUser(db(), { email: address, workspace: third.workspace.name, confirm: true }, options);
    expect(confirmed).toMatchObject({ created: false, membershipAdded: true, role: 'member' });
    expect(confirmed.user.confirmedAt).toBeInstanceOf(Date);
    expect(await sessionStatus(held.cookie)).toBe(401);
    expect((await passwordSignIn(address, password)).statusCode).toBe(401);
    expect(await findUserByEmail(db(), address)).toMatchObject({ passwordHash: null });
    const stale = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: unused.url.slice(unused.url.lastIndexOf('/') + 1) } });
    expect(stale.statusCode).toBe(401);
    expect(await sessionStatus((await redeem(confirmed.signInLink.url)).cookie)).toBe(200);

    // Confirmed, the account joins any workspace; an existing account never comes with a link.
    const added = await other.request('POST', '/api/v1/members', { email: address, name: 'Ignored' });
    expect(added.statusCode, added.body).toBe(201);
    expect(added.json()).toMatchObject({ member: { userId, email: address, name: 'Lin', role: 'member' }, accountCreated: false, signInLink: null });

    // Accounts the operator makes are confirmed from the start; accounts of unknown origin are nobody's.
    const byOperator = await createUser(db(), { email: email('operator'), workspace: third.workspace.name }, options);
    expect((await other.request('POST', '/api/v1/members', { email: byOperator.user.email })).statusCode).toBe(201);
    const { user: unknown } = await db().transaction((tx) => findOrCreateAccount(tx, { email: email('legacy'), defaultAgent: DEFAULT_AGENT }));
    expect((await other.request('POST', '/api/v1/members', { email: unknown.email })).statusCode).toBe(409);
  });

  /**
   * An account another workspace made and whoever held it gave a password, hashed with weaker parameters
   * than today's (so that a sign-in would write a fresh hash back), and a live link.
   */
  async function heldAccount() {
    const maker = await api.newTenant();
    const address = email('held');
    const made = await maker.request('POST', '/api/v1/members', { email: address });
    expect(made.statusCode, made.body).toBe(201);
    const userId: string = made.json().member.userId;
    const password = 'the holder chose this one';
    await setPasswordHash(db(), userId, await hashPassword(password, { logN: 10, r: 8, p: 1 }));
    const link = await issueSignInLink(db(), userId, TEST_PUBLIC_URL);
    return { address, userId, password, linkToken: link.url.slice(link.url.lastIndexOf('/') + 1) };
  }

  const liveSessions = async (userId: string) =>
    (await queryRows<{ n: number }>(db(), sql`select count(*)::int as n from sessions where user_id = ${userId} and revoked_at is null`))[0]!.n;
  const confirmInto = async (address: string) =>
    createUser(db(), { email: address, workspace: (await api.newTenant()).workspace.name, confirm: true }, { publicUrl: TEST_PUBLIC_URL, defaultAgent: DEFAULT_AGENT });

  it('opens no session and writes no hash back for a password verified just before an operator confirms the account', async () => {
    const { address, userId, password } = await heldAccount();
    // The password is checked (outside any transaction), the operator confirms, then the sign-in goes on.
    const verified = await verifySignInPassword(db(), { email: address, password }, { ip: '192.0.2.7' });
    expect(verified.rehash).not.toBeNull();
    await confirmInto(address);
    const options = { ip: '192.0.2.7', ttlMs: SESSION_TTL_MS, userAgent: null, replacedToken: null };
    await expect(openPasswordSession(db(), verified, options)).rejects.toMatchObject({ code: 'unauthorized', message: 'Invalid email or password' });
    expect(await liveSessions(userId)).toBe(0);
    expect(await findUserByEmail(db(), address)).toMatchObject({ passwordHash: null });
  });

  it.runIf(driver === 'postgres')('makes a password sign-in and a link redemption wait for an operator taking the account back, then refuses both', async () => {
    const { address, userId, password, linkToken } = await heldAccount();
    const other = new pg.Client({ connectionString: postgresUrl(), options: `-c search_path=${api.db.schema}` });
    const observer = new pg.Client({ connectionString: postgresUrl() });
    await other.connect();
    await observer.connect();
    try {
      const [{ pid }] = (await other.query<{ pid: number }>('select pg_backend_pid() as pid')).rows as [{ pid: number }];
      // The operator's transaction has locked the account's row, as takeBackAccount does first.
      await other.query('begin');
      await other.query('select id from users where id = $1 for no key update', [userId]);
      const byPassword = passwordSignIn(address, password);
      const byLink = api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: linkToken } });
      let waiting = 0;
      for (let i = 0; i < 400 && waiting < 2; i++) {
        await new Promise((resolve) => setTimeout(resolve, 25));
        // The second to come queues behind the first (the row's lock queue): it waits for the operator too.
        const { rows } = await observer.query<{ n: number }>(
          `select count(*)::int as n from pg_stat_activity a where $1 = any(pg_blocking_pids(a.pid))
             or exists (select 1 from pg_stat_activity b where b.pid = any(pg_blocking_pids(a.pid)) and $1 = any(pg_blocking_pids(b.pid)))`,
          [pid],
        );
        waiting = rows[0]!.n;
      }
      expect(waiting, 'both sign-ins wait for the operator').toBe(2);
      // The rest of the take-back: the password goes, the links end, the sessions are revoked.
      await other.query('update users set confirmed_at = coalesce(confirmed_at, now()), password_hash = null where id = $1', [userId]);
      await other.query('update sign_in_links set expires_at = least(expires_at, now()) where user_id = $1 and used_at is null', [userId]);
      await other.query('update sessions set revoked_at = now() where user_id = $1 and revoked_at is null', [userId]);
      await other.query('commit');
      expect((await byPassword).statusCode).toBe(401);
      expect((await byLink).statusCode).toBe(401);
    } finally {
      await other.end();
      await observer.end();
    }
    expect(await liveSessions(userId)).toBe(0);
    expect(await findUserByEmail(db(), address)).toMatchObject({ passwordHash: null });
  });

  it('refuses bad input with 400 naming the field', async () => {
    const tenant = await api.newTenant();
    for (const [payload, field] of [
      [{ email: 'not-an-email' }, 'email'],
      [{ email: email('x'), role: 'king' }, 'role'],
      [{ email: email('x'), name: '' }, 'name'],
      [{}, 'email'],
    ] as const) {
      const response = await tenant.request('POST', '/api/v1/members', payload);
      expect(response.statusCode, JSON.stringify(payload)).toBe(400);
      expect(response.json().error.details.issues.map((issue: { field: string }) => issue.field)).toContain(field);
    }
  });

  it('lets owners and admins add members, only owners add owners, and members only list', async () => {
    const tenant = await api.newTenant();
    const owner = await memberOf(tenant, 'owner');
    const admin = await memberOf(tenant, 'admin');
    const member = await memberOf(tenant, 'member');

    const byOwner = await owner.request('POST', '/api/v1/members', { email: email('by-owner'), role: 'owner' });
    expect(byOwner.statusCode, byOwner.body).toBe(201);
    expect(byOwner.json()).toMatchObject({ accountCreated: true, signInLink: expect.stringMatching(LINK), member: { role: 'owner' } });
    const byAdmin = await admin.request('POST', '/api/v1/members', { email: email('by-admin') });
    expect(byAdmin.statusCode, byAdmin.body).toBe(201);
    const refusedOwner = email('owner-by-admin');
    const adminMakesOwner = await admin.request('POST', '/api/v1/members', { email: refusedOwner, role: 'owner' });
    expect(adminMakesOwner.statusCode).toBe(403);
    expect(adminMakesOwner.json().error.message).toBe('Only owners can add owners');

    const refusedMember = email('by-member');
    const byMember = await member.request('POST', '/api/v1/members', { email: refusedMember });
    expect(byMember.statusCode).toBe(403);
    expect(byMember.json().error).toEqual({ code: 'forbidden', message: 'Only workspace owners and admins can add members' });
    const listed = await member.request('GET', '/api/v1/members');
    expect(listed.statusCode).toBe(200);
    expect(listed.json().members).toHaveLength(5);
    // None of the refused addresses got an account.
    expect(await findUserByEmail(db(), refusedOwner)).toBeNull();
    expect(await findUserByEmail(db(), refusedMember)).toBeNull();
  });

  it('keeps a personal workspace personal', async () => {
    const tenant = await api.newTenant();
    const { user } = await memberOf(tenant, 'member');
    const inPersonal = await sessionOf(user.id);
    const refused = await inPersonal('POST', '/api/v1/members', { email: email('guest') });
    expect(refused.statusCode).toBe(403);
    expect(refused.json().error.message).toBe('A personal workspace has no other members');
    const listed = await inPersonal('GET', '/api/v1/members');
    expect(listed.json().members).toEqual([expect.objectContaining({ userId: user.id, role: 'owner' })]);
  });
});
