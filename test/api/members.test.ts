/**
 * Workspace members on both databases: adding people by email (creating the account, with a one-time
 * link only for an account the request created), listing them, and who may add whom.
 */
import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import { describe, expect, it } from 'vitest';
import { findOrCreateAccount, issueSignInLink } from '../../src/engine/users.js';
import { queryRows } from '../../src/store/db.js';
import { findRoutingConfigs, upsertRoutingConfig } from '../../src/store/routing.js';
import { addMembership, findPersonalWorkspace, findUserByEmail, type Role } from '../../src/store/users.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const LINK = new RegExp(`^${TEST_PUBLIC_URL}/auth/sign-in/[A-Za-z0-9_-]{43}$`);
const email = (label: string) => `${label}-${randomBytes(4).toString('hex')}@example.com`;

describe.each(testDrivers)('workspace members on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const db = () => api.db.database.db;

  /** Signs a user in through a one-time link; requests carry the cookie, the CSRF token and a workspace. */
  async function sessionOf(userId: string, workspaceId?: string) {
    const { url } = await issueSignInLink(db(), userId, TEST_PUBLIC_URL);
    const signedIn = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: url.slice(url.lastIndexOf('/') + 1) } });
    expect(signedIn.statusCode, signedIn.body).toBe(200);
    const cookie = String(signedIn.headers['set-cookie']).split(';')[0]!;
    const csrf: string = signedIn.json().csrfToken;
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

  it('creates an account with a one-time link; an existing account only gets the membership', async () => {
    const tenant = await api.newTenant();
    // The new account's personal workspace starts with the agent of the workspace that added it.
    await upsertRoutingConfig(db(), tenant.workspace.id, 'default', { mode: 'agent', agent: 'openai/gpt-5', effort: 'medium', instructions: null });
    const address = email('new');
    const created = await tenant.request('POST', '/api/v1/members', { email: address, name: 'Lin', role: 'admin' });
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

    // The link signs the new member in, and the session sees both workspaces.
    const opened = await api.app.inject({ method: 'GET', url: String(body.signInLink).slice(TEST_PUBLIC_URL.length) });
    expect(opened.statusCode).toBe(303);
    const cookie = String(opened.headers['set-cookie']).split(';')[0]!;
    const session = await api.app.inject({ method: 'GET', url: '/api/v1/auth/session', headers: { cookie } });
    expect(session.json().workspaces.map((workspace: { id: string; role: string }) => [workspace.id, workspace.role])).toEqual([
      [personal!.id, 'owner'],
      [tenant.workspace.id, 'admin'],
    ]);

    // An account that exists (in any case of its address) gets the membership and no link.
    const other = await api.newTenant();
    const existing = await other.request('POST', '/api/v1/members', { email: address.toUpperCase(), name: 'Ignored' });
    expect(existing.statusCode, existing.body).toBe(201);
    expect(existing.json()).toMatchObject({ member: { userId: body.member.userId, email: address, name: 'Lin', role: 'member' }, accountCreated: false, signInLink: null, signInLinkExpiresAt: null });
    // No link was made for it behind the scenes either, and the account is as it was.
    const links = await queryRows<{ n: number }>(db(), sql`select count(*)::int as n from sign_in_links where user_id = ${body.member.userId}`);
    expect(links).toEqual([{ n: 1 }]);
    expect(await findUserByEmail(db(), address)).toMatchObject({ name: 'Lin', passwordHash: null });

    const twice = await other.request('POST', '/api/v1/members', { email: address });
    expect(twice.statusCode).toBe(409);
    expect(twice.json().error).toMatchObject({ code: 'conflict', message: `${address} is already a member of this workspace` });

    const listed = await other.request('GET', '/api/v1/members');
    expect(listed.statusCode).toBe(200);
    expect(listed.json()).toEqual({ members: [{ userId: body.member.userId, email: address, name: 'Lin', role: 'member', createdAt: expect.any(String) }] });
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
