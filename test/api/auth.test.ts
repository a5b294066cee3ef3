/**
 * Signed-in users on both databases: password sign-in (one answer for every failure, throttled per
 * email in the database), one-time sign-in links, the session cookie and its flags, the session, sign-out,
 * passwords, CSRF and origin checks, the workspace a session acts in, and the per-user rate limit.
 */
import { randomBytes } from 'node:crypto';
import { eq, sql } from 'drizzle-orm';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import { describe, expect, it } from 'vitest';
import { answerProblems, type Json } from '../../scripts/openapi.js';
import { hashPassword } from '../../src/domain/passwords.js';
import { findOrCreateAccount, issueSignInLink, SESSION_TTL_MS } from '../../src/engine/users.js';
import { buildServer } from '../../src/server/app.js';
import { queryRows } from '../../src/store/db.js';
import { pruneRateLimitBuckets, TALLY_SECOND } from '../../src/store/rate-limit.js';
import { tasks, users } from '../../src/store/schema.js';
import { addMembership, findPersonalWorkspace, setPasswordHash, type Role } from '../../src/store/users.js';
import type { Workspace } from '../../src/store/workspaces.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const PASSWORD = 'correct horse battery staple';
const INVALID_CREDENTIALS = { error: { code: 'unauthorized', message: 'Invalid email or password' } };
const SESSION_ENDED = { error: { code: 'unauthorized', message: 'Invalid or expired session; sign in again' } };
const USER_REQUIRED = { error: { code: 'forbidden', message: 'This endpoint needs a signed-in user; workspace API keys cannot use it' } };

interface Person {
  id: string;
  email: string;
  personal: Workspace;
}

/** A signed-in browser: its cookie and CSRF token, and requests that carry them. */
interface Browser {
  cookie: string;
  csrfToken: string;
  /** Sends the cookie, and on unsafe methods the CSRF token unless `headers` says otherwise. */
  request(method: InjectOptions['method'], url: string, body?: unknown, headers?: Record<string, string | undefined>): Promise<LightMyRequestResponse>;
}

/** The session cookie's value and attributes as Set-Cookie gave them (`name` is the https one's otherwise). */
function sessionCookieOf(response: LightMyRequestResponse, name = 'svc_session'): { value: string; attributes: string[] } | null {
  const header = response.headers['set-cookie'];
  const all = header === undefined ? [] : Array.isArray(header) ? header : [header];
  const cookie = all.find((line) => line.startsWith(`${name}=`));
  if (!cookie) return null;
  const [pair, ...attributes] = cookie.split(';').map((part) => part.trim());
  return { value: pair!.slice(`${name}=`.length), attributes };
}

const tokenOf = (url: string) => url.slice(url.lastIndexOf('/') + 1);

function helpers(api: () => TestApi) {
  const db = () => api().db.database.db;

  async function newPerson(options: { password?: string; name?: string } = {}): Promise<Person> {
    const email = `user-${randomBytes(5).toString('hex')}@example.com`;
    const { user } = await db().transaction((tx) => findOrCreateAccount(tx, { email, name: options.name, defaultAgent: DEFAULT_AGENT }));
    if (options.password !== undefined) await setPasswordHash(db(), user.id, await hashPassword(options.password));
    const personal = await findPersonalWorkspace(db(), user.id);
    return { id: user.id, email, personal: personal! };
  }

  function browserOf(response: LightMyRequestResponse): Browser {
    expect(response.statusCode, response.body).toBe(200);
    const cookie = sessionCookieOf(response);
    expect(cookie).not.toBeNull();
    const csrfToken: string = response.json().csrfToken;
    return {
      cookie: `svc_session=${cookie!.value}`,
      csrfToken,
      request(method, url, body, headers = {}) {
        const unsafe = !['GET', 'HEAD', 'OPTIONS'].includes(String(method).toUpperCase());
        const all: Record<string, string | undefined> = { cookie: `svc_session=${cookie!.value}`, ...(unsafe ? { 'x-csrf-token': csrfToken } : {}), ...headers };
        const defined = Object.fromEntries(Object.entries(all).filter((entry): entry is [string, string] => entry[1] !== undefined));
        return api().app.inject({ method, url, headers: defined, ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }) });
      },
    };
  }

  const signInRequest = (email: string, password: string, app = api().app) =>
    app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email, password } });

  async function signIn(person: Person, password = PASSWORD): Promise<Browser> {
    return browserOf(await signInRequest(person.email, password));
  }

  /** Signs in through a fresh one-time link, as a person without a password would. */
  async function signInByLink(person: Person): Promise<Browser> {
    const { url } = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    return browserOf(await api().app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: tokenOf(url) } }));
  }

  async function join(person: Person, workspace: Workspace, role: Role): Promise<void> {
    await addMembership(db(), { workspaceId: workspace.id, userId: person.id, role });
  }

  return { db, newPerson, signIn, signInRequest, signInByLink, browserOf, join };
}

describe.each(testDrivers)('signing in on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const { db, newPerson, signIn, signInRequest, signInByLink, browserOf } = helpers(() => api);

  it('signs in with the right password; a wrong one, an unknown email and an account without a password get one answer', async () => {
    const person = await newPerson({ password: PASSWORD, name: 'Ada' });
    const right = await signInRequest(person.email, PASSWORD);
    expect(right.statusCode, right.body).toBe(200);
    expect(right.json()).toEqual({
      user: { id: person.id, email: person.email, name: 'Ada' },
      csrfToken: expect.stringMatching(/^[A-Za-z0-9_-]{43}$/),
      expiresAt: expect.any(String),
    });
    expect(new Date(right.json().expiresAt).getTime()).toBeGreaterThan(Date.now() + SESSION_TTL_MS - 24 * 3600_000);
    expect(sessionCookieOf(right)?.value).toMatch(/^[A-Za-z0-9_-]{43}$/);
    // The address is matched without regard to case.
    expect((await signInRequest(person.email.toUpperCase(), PASSWORD)).statusCode).toBe(200);

    const withoutPassword = await newPerson();
    for (const [email, password] of [
      [person.email, 'correct horse battery stapler'],
      [`nobody-${randomBytes(4).toString('hex')}@example.com`, PASSWORD],
      [withoutPassword.email, PASSWORD],
      [withoutPassword.email, ''],
    ] as const) {
      const wrong = await signInRequest(email, password);
      expect(wrong.statusCode, email).toBe(401);
      expect(wrong.json(), email).toEqual(INVALID_CREDENTIALS);
      expect(sessionCookieOf(wrong), email).toBeNull();
    }

    // Neither the token nor the password is stored as given.
    const stored = JSON.stringify(await queryRows(db(), sql`select * from sessions where user_id = ${person.id}`));
    expect(stored).not.toContain(sessionCookieOf(right)!.value);
    const [row] = await db().select({ hash: users.passwordHash }).from(users).where(eq(users.id, person.id));
    expect(row!.hash).toMatch(/^\$scrypt\$ln=15,r=8,p=1\$/);
  });

  it('sets the session cookie HttpOnly, SameSite=Lax and Path=/ for the session lifetime; __Host- and Secure under an https public URL', async () => {
    const person = await newPerson({ password: PASSWORD });
    const plain = sessionCookieOf(await signInRequest(person.email, PASSWORD))!;
    expect(plain.attributes.sort()).toEqual(['HttpOnly', `Max-Age=${SESSION_TTL_MS / 1000}`, 'Path=/', 'SameSite=Lax'].sort());

    const https = await buildServer({
      database: api.db.database,
      publicUrl: 'https://svc.example.com',
      dataDir: api.dataDir,
      rateLimits: { perMinute: 1000, perHour: 10_000 },
    });
    try {
      const signedIn = await signInRequest(person.email, PASSWORD, https);
      expect(sessionCookieOf(signedIn)).toBeNull();
      // __Host-: the browser keeps it only Secure, for Path=/ and without Domain (no other host can set or shadow it).
      const secure = sessionCookieOf(signedIn, '__Host-svc_session')!;
      expect(secure.attributes.sort()).toEqual(['HttpOnly', `Max-Age=${SESSION_TTL_MS / 1000}`, 'Path=/', 'SameSite=Lax', 'Secure'].sort());
      const session = (cookie: string) => https.inject({ method: 'GET', url: '/api/v1/auth/session', headers: { cookie } });
      expect((await session(`__Host-svc_session=${secure.value}`)).json().user.id).toBe(person.id);
      // The unprefixed name is not read there: any host of the domain could have set it.
      expect((await session(`svc_session=${secure.value}`)).statusCode).toBe(401);
      const out = await https.inject({
        method: 'POST',
        url: '/api/v1/auth/sign-out',
        headers: { cookie: `__Host-svc_session=${secure.value}`, 'x-csrf-token': signedIn.json().csrfToken },
      });
      expect(out.statusCode).toBe(204);
      expect(sessionCookieOf(out, '__Host-svc_session')?.attributes).toEqual(expect.arrayContaining(['Max-Age=0', 'Path=/', 'Secure']));
      // Behind https, a sign-in from another origin is refused before the password is checked.
      const foreign = await https.inject({
        method: 'POST',
        url: '/api/v1/auth/sign-in',
        headers: { origin: 'https://evil.example' },
        payload: { email: person.email, password: PASSWORD },
      });
      expect(foreign.statusCode).toBe(403);
      expect(foreign.json().error.code).toBe('forbidden');
    } finally {
      await https.close();
    }
  });

  it('throttles failed sign-ins per email in the database, for every server, and a success clears them', async () => {
    const person = await newPerson({ password: PASSWORD });
    const other = await newPerson({ password: PASSWORD });
    // A second server on the same database: the count is the database's, not a process's.
    const second = await buildServer({ database: api.db.database, publicUrl: TEST_PUBLIC_URL, dataDir: api.dataDir, rateLimits: { perMinute: 1000, perHour: 10_000 } });
    try {
      for (let i = 0; i < 9; i++) expect((await signInRequest(person.email, 'not the password!', i % 2 ? second : api.app)).statusCode).toBe(401);
      // A success clears the failures: nine more are allowed after it.
      expect((await signInRequest(person.email, PASSWORD, second)).statusCode).toBe(200);
      for (let i = 0; i < 10; i++) expect((await signInRequest(person.email, 'not the password!', i % 2 ? second : api.app)).statusCode).toBe(401);
      for (const app of [api.app, second]) {
        const refused = await signInRequest(person.email, PASSWORD, app);
        expect(refused.statusCode).toBe(429);
        expect(refused.json().error).toMatchObject({ code: 'rate_limited', message: 'Too many failed sign-in attempts for this email; try again later' });
        const retryAfter = Number(refused.headers['retry-after']);
        expect(retryAfter).toBeGreaterThanOrEqual(1);
        expect(retryAfter).toBeLessThanOrEqual(15 * 60 + 1);
        expect(refused.json().error.details).toEqual({ retryAfterSeconds: retryAfter });
        expect(sessionCookieOf(refused)).toBeNull();
      }
      // Another address is not affected; the throttled one takes links still.
      expect((await signInRequest(other.email, PASSWORD)).statusCode).toBe(200);
      await signInByLink(person);
    } finally {
      await second.close();
    }
  });

  it('throttles an unknown email like a known one, exactly, under a concurrent burst', async () => {
    const email = `nobody-${randomBytes(4).toString('hex')}@example.com`;
    const burst = await Promise.all(Array.from({ length: 14 }, () => signInRequest(email, PASSWORD)));
    const codes = burst.map((response) => response.statusCode).sort();
    expect(codes).toEqual([...Array<number>(10).fill(401), ...Array<number>(4).fill(429)]);
  });

  it('signs in once with a link; a used, expired, replaced or unknown link answers a page saying so', async () => {
    const person = await newPerson();
    const { url } = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    expect(url).toMatch(new RegExp(`^${TEST_PUBLIC_URL}/auth/sign-in/[A-Za-z0-9_-]{43}$`));
    const path = url.slice(TEST_PUBLIC_URL.length);

    // Opening the link (a person, or a mail scanner fetching it first) only shows a page with a button.
    const shown = await api.app.inject({ method: 'GET', url: `${path}?next=${encodeURIComponent('/tasks/abc?view=1')}` });
    expect(shown.statusCode).toBe(200);
    expect(shown.headers['content-type']).toBe('text/html; charset=utf-8');
    expect(shown.headers['cache-control']).toBe('no-store');
    expect(shown.headers['content-security-policy']).toContain("form-action 'self'");
    expect(shown.body).toContain(`signs you in as <strong>${person.email}</strong>`);
    expect(shown.body).toContain(`<form method="post" action="${path}">`);
    expect(shown.body).toContain('<input type="hidden" name="next" value="/tasks/abc?view=1">');
    expect(sessionCookieOf(shown)).toBeNull();
    expect((await api.app.inject({ method: 'GET', url: path })).statusCode).toBe(200);
    expect(await queryRows(db(), sql`select id from sessions where user_id = ${person.id}`)).toEqual([]);

    const press = (linkPath: string, fields: Record<string, string> = {}, headers: Record<string, string> = {}) =>
      api.app.inject({
        method: 'POST',
        url: linkPath,
        headers: { 'content-type': 'application/x-www-form-urlencoded', origin: TEST_PUBLIC_URL, ...headers },
        payload: new URLSearchParams(fields).toString(),
      });
    // A page of another site cannot press the button for this browser; the link still works after.
    const foreign = await press(path, {}, { origin: 'https://evil.example' });
    expect(foreign.statusCode).toBe(403);
    expect(sessionCookieOf(foreign)).toBeNull();

    const opened = await press(path, { next: '/tasks/abc?view=1' });
    expect(opened.statusCode).toBe(303);
    expect(opened.headers.location).toBe('/tasks/abc?view=1');
    expect(opened.headers['cache-control']).toBe('no-store');
    expect(opened.headers['referrer-policy']).toBe('no-referrer');
    const cookie = sessionCookieOf(opened)!;
    const session = await api.app.inject({ method: 'GET', url: '/api/v1/auth/session', headers: { cookie: `svc_session=${cookie.value}` } });
    expect(session.statusCode).toBe(200);
    expect(session.json().user.id).toBe(person.id);
    expect((await press(path)).statusCode).toBe(410);

    const again = await api.app.inject({ method: 'GET', url: path });
    expect(again.statusCode).toBe(410);
    expect(again.headers['content-type']).toBe('text/html; charset=utf-8');
    expect(again.body).toContain('already been used');
    expect(sessionCookieOf(again)).toBeNull();

    const expired = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    await db().execute(sql`update sign_in_links set expires_at = now() - interval '1 second' where used_at is null and user_id = ${person.id}`);
    const late = await api.app.inject({ method: 'GET', url: expired.url.slice(TEST_PUBLIC_URL.length) });
    expect(late.statusCode).toBe(410);
    expect(late.body).toContain('has expired');

    const replaced = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    const newest = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    expect((await api.app.inject({ method: 'GET', url: replaced.url.slice(TEST_PUBLIC_URL.length) })).statusCode).toBe(410);

    for (const unknown of [`/auth/sign-in/${randomBytes(32).toString('base64url')}`, '/auth/sign-in/not-a-token']) {
      const page = await api.app.inject({ method: 'GET', url: unknown });
      expect(page.statusCode, unknown).toBe(400);
      expect(page.headers['content-type']).toBe('text/html; charset=utf-8');
      expect(page.body).toContain('not valid');
      expect(page.body).not.toMatch(/\bat .+:\d+:\d+/);
    }

    // Only paths of this origin are followed after signing in, and only they are put in the form.
    for (const next of ['//evil.example/x', 'https://evil.example/', '/\\evil.example', 'javascript:alert(1)']) {
      const link = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
      const linkPath = link.url.slice(TEST_PUBLIC_URL.length);
      const page = await api.app.inject({ method: 'GET', url: `${linkPath}?next=${encodeURIComponent(next)}` });
      expect(page.body, next).not.toContain('name="next"');
      const response = await press(linkPath, { next });
      expect(response.statusCode, next).toBe(303);
      expect(response.headers.location, next).toBe('/');
    }
    // A browser without Origin (an old one) is let through; the form needs no body at all.
    const bare = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    const withoutOrigin = await api.app.inject({ method: 'POST', url: bare.url.slice(TEST_PUBLIC_URL.length) });
    expect(withoutOrigin.statusCode).toBe(303);
    expect(withoutOrigin.headers.location).toBe('/');

    // The JSON route for other clients: the same link works once there too.
    const fresh = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    expect(newest.url).not.toBe(fresh.url);
    const redeemed = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: tokenOf(fresh.url) } });
    browserOf(redeemed);
    for (const token of [tokenOf(fresh.url), tokenOf(newest.url), 'nonsense']) {
      const refused = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token } });
      expect(refused.statusCode).toBe(401);
      expect(refused.json()).toEqual({ error: { code: 'unauthorized', message: 'Invalid, used or expired sign-in link' } });
    }
  });

  it('needs JSON bodies on the sign-in routes like everywhere else', async () => {
    const form = await api.app.inject({
      method: 'POST',
      url: '/api/v1/auth/sign-in',
      headers: { 'content-type': 'application/x-www-form-urlencoded' },
      payload: 'email=a%40example.com&password=x',
    });
    expect(form.statusCode).toBe(415);
    const invalid = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email: 'not an email', password: 'x' } });
    expect(invalid.statusCode).toBe(400);
    expect(invalid.json().error.details.issues).toEqual([expect.objectContaining({ field: 'email' })]);
  });

  it('describes the session: the user, every workspace with its role, the CSRF token and the expiry', async () => {
    const person = await newPerson({ password: PASSWORD, name: 'Grace' });
    await addMembership(db(), { workspaceId: tenant.workspace.id, userId: person.id, role: 'admin' });
    const browser = await signIn(person);
    const session = await browser.request('GET', '/api/v1/auth/session');
    expect(session.statusCode, session.body).toBe(200);
    expect(session.headers['cache-control']).toBe('no-store');
    expect(session.json()).toEqual({
      user: { id: person.id, email: person.email, name: 'Grace' },
      workspaces: [
        { id: person.personal.id, name: person.personal.name, plan: 'free', role: 'owner', personal: true },
        { id: tenant.workspace.id, name: tenant.workspace.name, plan: 'free', role: 'admin', personal: false },
      ],
      csrfToken: browser.csrfToken,
      expiresAt: expect.any(String),
    });
    expect(person.personal.name).toBe(`personal-${person.id.replace(/-/g, '').slice(0, 12)}`);

    // A workspace API key is not a person: the session routes refuse it; no credential at all is a 401.
    for (const [method, url, body] of [
      ['GET', '/api/v1/auth/session', undefined],
      ['POST', '/api/v1/auth/sign-out', undefined],
      ['POST', '/api/v1/auth/password', { newPassword: 'a brand new password' }],
    ] as const) {
      const byKey = await tenant.request(method, url, body);
      expect(byKey.statusCode, `${method} ${url}`).toBe(403);
      expect(byKey.json(), `${method} ${url}`).toEqual(USER_REQUIRED);
    }
    const anonymous = await api.app.inject({ method: 'GET', url: '/api/v1/auth/session' });
    expect(anonymous.statusCode).toBe(401);
    expect(anonymous.json().error.message).toBe('Invalid or missing API key');
  });

  it('signs out: the cookie stops working and is cleared; other sessions and expiry are separate', async () => {
    const person = await newPerson({ password: PASSWORD });
    const browser = await signIn(person);
    const elsewhere = await signIn(person);
    const out = await browser.request('POST', '/api/v1/auth/sign-out');
    expect(out.statusCode, out.body).toBe(204);
    expect(sessionCookieOf(out)).toMatchObject({ value: '', attributes: expect.arrayContaining(['Max-Age=0', 'Path=/']) });
    for (const [method, url] of [['GET', '/api/v1/auth/session'], ['GET', '/api/v1/tasks'], ['POST', '/api/v1/auth/sign-out']] as const) {
      const refused = await browser.request(method, url);
      expect(refused.statusCode, `${method} ${url}`).toBe(401);
      expect(refused.json()).toEqual(SESSION_ENDED);
      expect(sessionCookieOf(refused)?.attributes).toContain('Max-Age=0');
    }
    expect((await elsewhere.request('GET', '/api/v1/auth/session')).statusCode).toBe(200);

    await db().execute(sql`update sessions set expires_at = now() - interval '1 second' where user_id = ${person.id}`);
    const expired = await elsewhere.request('GET', '/api/v1/auth/session');
    expect(expired.statusCode).toBe(401);
    expect(expired.json()).toEqual(SESSION_ENDED);
    // A cookie that was never a session is refused the same way.
    const forged = await api.app.inject({ method: 'GET', url: '/api/v1/tasks', headers: { cookie: `svc_session=${randomBytes(32).toString('base64url')}` } });
    expect(forged.json()).toEqual(SESSION_ENDED);

    // Sessions that ended over a week ago go when the user next signs in; recent ones stay on record.
    await db().execute(sql`update sessions set revoked_at = now() - interval '8 days' where user_id = ${person.id} and revoked_at is not null`);
    await signIn(person);
    const left = await queryRows<{ revoked: boolean }>(db(), sql`select revoked_at is not null as revoked from sessions where user_id = ${person.id} order by created_at`);
    expect(left).toEqual([{ revoked: false }, { revoked: false }]);
  });

  it('slides the session: a use after a minute moves the expiry and renews the cookie', async () => {
    const person = await newPerson({ password: PASSWORD });
    const browser = await signIn(person);
    const fresh = await browser.request('GET', '/api/v1/auth/session');
    // Used within the minute: nothing is written, no cookie is sent.
    expect(sessionCookieOf(fresh)).toBeNull();
    await db().execute(sql`update sessions set last_seen_at = now() - interval '2 days', expires_at = now() + interval '28 days' where user_id = ${person.id}`);
    const renewed = await browser.request('GET', '/api/v1/auth/session');
    expect(renewed.statusCode).toBe(200);
    expect(sessionCookieOf(renewed)).toEqual({ value: browser.cookie.slice('svc_session='.length), attributes: expect.arrayContaining([`Max-Age=${SESSION_TTL_MS / 1000}`]) });
    const [row] = await queryRows<{ left_days: number }>(db(), sql`select extract(epoch from expires_at - now()) / 86400 as left_days from sessions where user_id = ${person.id}`);
    expect(Number(row!.left_days)).toBeGreaterThan(29);
  });

  it('sets a first password without the current one, then changes it only with the current one, ending other sessions and links', async () => {
    const person = await newPerson();
    const browser = await signInByLink(person);
    const other = await signInByLink(person);
    const outstanding = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);

    const tooShort = await browser.request('POST', '/api/v1/auth/password', { newPassword: 'short' });
    expect(tooShort.statusCode).toBe(400);
    expect(tooShort.json().error.details.issues).toEqual([{ field: 'newPassword', message: 'must be at least 12 characters' }]);
    const tooLong = await browser.request('POST', '/api/v1/auth/password', { newPassword: 'x'.repeat(1025) });
    expect(tooLong.json().error.details.issues).toEqual([{ field: 'newPassword', message: 'must be at most 1024 characters' }]);

    expect((await browser.request('POST', '/api/v1/auth/password', { newPassword: PASSWORD })).statusCode).toBe(204);
    // Setting it signed out the other session, not this one, and ended the link no one had used yet.
    expect((await other.request('GET', '/api/v1/auth/session')).json()).toEqual(SESSION_ENDED);
    expect((await browser.request('GET', '/api/v1/auth/session')).statusCode).toBe(200);
    const stale = await api.app.inject({ method: 'GET', url: outstanding.url.slice(TEST_PUBLIC_URL.length) });
    expect(stale.statusCode).toBe(410);
    expect(stale.body).toContain('has expired');
    const redeemed = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: tokenOf(outstanding.url) } });
    expect(redeemed.statusCode).toBe(401);
    const later = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    const third = await signIn(person);

    const missing = await browser.request('POST', '/api/v1/auth/password', { newPassword: 'another good password' });
    expect(missing.statusCode).toBe(400);
    expect(missing.json().error.details.issues).toEqual([{ field: 'currentPassword', message: 'is required once a password is set' }]);
    const wrong = await browser.request('POST', '/api/v1/auth/password', { currentPassword: 'not the password!', newPassword: 'another good password' });
    expect(wrong.statusCode).toBe(403);
    expect(wrong.json()).toEqual({ error: { code: 'forbidden', message: 'The current password is wrong' } });

    expect((await browser.request('POST', '/api/v1/auth/password', { currentPassword: PASSWORD, newPassword: 'another good password' })).statusCode).toBe(204);
    expect((await third.request('GET', '/api/v1/auth/session')).json()).toEqual(SESSION_ENDED);
    expect((await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: tokenOf(later.url) } })).statusCode).toBe(401);
    expect((await signInRequest(person.email, PASSWORD)).json()).toEqual(INVALID_CREDENTIALS);
    expect((await signInRequest(person.email, 'another good password')).statusCode).toBe(200);
  });
});

describe.each(testDrivers)('session requests on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const { db, newPerson, signIn, join } = helpers(() => api);

  const taskRow = async (id: string) => (await db().select().from(tasks).where(eq(tasks.id, id)))[0]!;

  it('needs X-CSRF-Token and, when sent, the public origin on unsafe methods; GET needs neither', async () => {
    const person = await newPerson({ password: PASSWORD });
    const browser = await signIn(person);
    const body = { command: 'Fix the flaky login test' };

    const withoutToken = await browser.request('POST', '/api/v1/tasks', body, { 'x-csrf-token': undefined });
    expect(withoutToken.statusCode).toBe(403);
    expect(withoutToken.json().error).toMatchObject({ code: 'forbidden', message: expect.stringContaining('X-CSRF-Token') });
    const wrongToken = await browser.request('POST', '/api/v1/tasks', body, { 'x-csrf-token': 'x'.repeat(43) });
    expect(wrongToken.statusCode).toBe(403);
    // Another session's token is as wrong as any other.
    const otherToken = await browser.request('POST', '/api/v1/tasks', body, { 'x-csrf-token': (await signIn(person)).csrfToken });
    expect(otherToken.statusCode).toBe(403);
    const wrongOrigin = await browser.request('POST', '/api/v1/tasks', body, { origin: 'https://evil.example' });
    expect(wrongOrigin.statusCode).toBe(403);
    expect(wrongOrigin.json().error).toMatchObject({ code: 'forbidden', message: expect.stringContaining('Origin https://evil.example is not allowed') });
    for (const method of ['PUT', 'DELETE'] as const) {
      const refused = await browser.request(method, '/api/v1/routing-configs/docs', method === 'PUT' ? { mode: 'ask', agent: DEFAULT_AGENT, effort: 'low' } : undefined, {
        'x-csrf-token': undefined,
      });
      expect(refused.statusCode, method).toBe(403);
    }
    expect(await queryRows(db(), sql`select id from tasks where workspace_id = ${person.personal.id}`)).toEqual([]);

    const sameOrigin = await browser.request('POST', '/api/v1/tasks', body, { origin: TEST_PUBLIC_URL });
    expect(sameOrigin.statusCode, sameOrigin.body).toBe(201);
    expect((await browser.request('POST', '/api/v1/tasks', body)).statusCode).toBe(201);
    const listed = await browser.request('GET', '/api/v1/tasks', undefined, { origin: 'https://evil.example' });
    expect(listed.statusCode).toBe(200);
    expect(listed.json().tasks).toHaveLength(2);
  });

  it('acts in the personal workspace by default and in an X-Svc-Workspace the user is a member of, and nowhere else', async () => {
    const person = await newPerson({ password: PASSWORD });
    const browser = await signIn(person);

    const personal = await browser.request('POST', '/api/v1/tasks', { command: 'Personal work' });
    expect(personal.statusCode, personal.body).toBe(201);
    const personalTask = await taskRow(personal.json().task.id);
    expect(personalTask).toMatchObject({ workspaceId: person.personal.id, createdByUserId: person.id, createdByKeyId: null });
    expect((await tenant.request('GET', `/api/v1/tasks/${personalTask.id}`)).statusCode).toBe(404);

    // Not a member (yet): 403, whatever the method, and nothing is created.
    for (const header of [tenant.workspace.id, tenant.workspace.id.toUpperCase(), 'not-a-uuid', '', '00000000-0000-0000-0000-000000000000']) {
      for (const [method, body] of [['GET', undefined], ['POST', { command: 'Sneak in' }]] as const) {
        const refused = await browser.request(method, '/api/v1/tasks', body, { 'x-svc-workspace': header });
        expect(refused.statusCode, `${method} ${header}`).toBe(403);
        expect(refused.json().error).toMatchObject({ code: 'forbidden', message: 'X-Svc-Workspace must be the id of a workspace you are a member of' });
      }
    }
    expect((await tenant.request('GET', '/api/v1/tasks')).json().tasks).toEqual([]);

    await join(person, tenant.workspace, 'member');
    const shared = await browser.request('POST', '/api/v1/tasks', { command: 'Shared work' }, { 'x-svc-workspace': tenant.workspace.id });
    expect(shared.statusCode, shared.body).toBe(201);
    expect(await taskRow(shared.json().task.id)).toMatchObject({ workspaceId: tenant.workspace.id, createdByUserId: person.id, createdByKeyId: null });
    expect((await tenant.request('GET', `/api/v1/tasks/${shared.json().task.id}`)).statusCode).toBe(200);
    const inShared = await browser.request('GET', '/api/v1/tasks', undefined, { 'x-svc-workspace': tenant.workspace.id });
    expect(inShared.json().tasks.map((task: { id: string }) => task.id)).toEqual([shared.json().task.id]);
    const inPersonal = await browser.request('GET', '/api/v1/tasks');
    expect(inPersonal.json().tasks.map((task: { id: string }) => task.id)).toEqual([personalTask.id]);
  });

  it('lets a Bearer header win over the cookie: the key\'s workspace, and a bad key is 401 whatever the cookie', async () => {
    const person = await newPerson({ password: PASSWORD });
    const browser = await signIn(person);
    const tenant = await api.newTenant();
    const both = await browser.request('POST', '/api/v1/tasks', { command: 'Made with the key' }, { ...tenant.headers, 'x-csrf-token': undefined });
    expect(both.statusCode, both.body).toBe(201);
    expect(await taskRow(both.json().task.id)).toMatchObject({ workspaceId: tenant.workspace.id, createdByUserId: null, createdByKeyId: expect.any(String) });
    // With a key, X-Svc-Workspace says nothing.
    const header = await browser.request('GET', '/api/v1/tasks', undefined, { ...tenant.headers, 'x-svc-workspace': person.personal.id });
    expect(header.json().tasks.map((task: { id: string }) => task.id)).toEqual([both.json().task.id]);

    const badKey = await browser.request('GET', '/api/v1/tasks', undefined, { authorization: `Bearer service_${'x'.repeat(43)}` });
    expect(badKey.statusCode).toBe(401);
    expect(badKey.json().error.message).toBe('Invalid or missing API key');
    // requireUser sees the key, not the cookie.
    expect((await browser.request('GET', '/api/v1/auth/session', undefined, tenant.headers)).json()).toEqual(USER_REQUIRED);
  });

  it('answers as the OpenAPI document says', async () => {
    const document = (await api.app.inject({ method: 'GET', url: '/api/v1/openapi.json' })).json() as Json;
    expect((document.components as { securitySchemes: Json }).securitySchemes).toMatchObject({
      bearerAuth: { type: 'http', scheme: 'bearer' },
      sessionCookie: { type: 'apiKey', in: 'cookie', name: 'svc_session' },
    });
    const person = await newPerson({ password: PASSWORD });
    const problems: string[] = [];
    const check = (method: string, path: string, response: LightMyRequestResponse) =>
      problems.push(
        ...answerProblems(document, {
          method,
          path,
          status: response.statusCode,
          headers: new Headers(Object.entries(response.headers).flatMap(([name, value]) => (value === undefined ? [] : [[name, String(value)] as [string, string]]))),
          body: response.body,
        }),
      );
    const signedIn = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email: person.email, password: PASSWORD } });
    check('POST', '/api/v1/auth/sign-in', signedIn);
    check('POST', '/api/v1/auth/sign-in', await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email: person.email, password: 'wrong password!' } }));
    check('POST', '/api/v1/auth/sign-in-link', await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: 'nope' } }));
    const browser = await signIn(person);
    check('GET', '/api/v1/auth/session', await browser.request('GET', '/api/v1/auth/session'));
    check('GET', '/api/v1/auth/session', await tenant.request('GET', '/api/v1/auth/session'));
    check('POST', '/api/v1/tasks', await browser.request('POST', '/api/v1/tasks', { command: 'x' }, { 'x-csrf-token': undefined }));
    check('GET', '/api/v1/tasks', await browser.request('GET', '/api/v1/tasks', undefined, { 'x-svc-workspace': tenant.workspace.id }));
    check('POST', '/api/v1/auth/password', await browser.request('POST', '/api/v1/auth/password', { newPassword: 'short' }));
    check('POST', '/api/v1/auth/sign-out', await browser.request('POST', '/api/v1/auth/sign-out'));
    check('GET', '/api/v1/tasks', await browser.request('GET', '/api/v1/tasks'));
    expect(problems).toEqual([]);
  });
});

describe.each(testDrivers)('the per-user rate limit on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready), { rateLimits: { perMinute: 5, perHour: 100 } });
  const { db, newPerson, signIn, signInRequest, join } = helpers(() => api);

  it('counts a user\'s session requests in every workspace together, apart from keys and other users', async () => {
    const person = await newPerson({ password: PASSWORD });
    await join(person, tenant.workspace, 'member');
    const browser = await signIn(person);
    for (let i = 0; i < 3; i++) expect((await browser.request('GET', '/api/v1/tasks')).statusCode, `request ${i + 1}`).toBe(200);
    // A second session of the same user shares the limit; so does another workspace.
    const second = await signIn(person);
    expect((await second.request('GET', '/api/v1/tasks', undefined, { 'x-svc-workspace': tenant.workspace.id })).statusCode).toBe(200);
    expect((await browser.request('GET', '/api/v1/tasks')).statusCode).toBe(200);

    const refused = await browser.request('GET', '/api/v1/tasks', undefined, { 'x-svc-workspace': tenant.workspace.id });
    expect(refused.statusCode).toBe(429);
    expect(refused.json().error).toMatchObject({ code: 'rate_limited', message: 'Rate limit exceeded. Max 5 requests per minute.', details: { window: 'minute', limit: 5 } });
    expect(Number(refused.headers['retry-after'])).toBeGreaterThanOrEqual(1);
    expect((await second.request('POST', '/api/v1/tasks', { command: 'Too many' })).statusCode).toBe(429);

    // The workspace's key and another user have limits of their own; signing in is not a counted request.
    expect((await tenant.request('GET', '/api/v1/tasks')).statusCode).toBe(200);
    const other = await newPerson({ password: PASSWORD });
    expect((await (await signIn(other)).request('GET', '/api/v1/tasks')).statusCode).toBe(200);
  });

  it('prunes what is left of deleted users and keeps the living; failed sign-ins are not counted here', async () => {
    const tallies = async () =>
      new Set((await queryRows<{ key_id: string }>(db(), sql`select key_id from rate_limit_buckets where second = ${TALLY_SECOND}`)).map((row) => row.key_id));
    const gone = await newPerson({ password: PASSWORD });
    const kept = await newPerson({ password: PASSWORD });
    for (const person of [gone, kept]) expect((await (await signIn(person)).request('GET', '/api/v1/tasks')).statusCode).toBe(200);
    const before = await tallies();
    expect((await signInRequest(`nobody-${randomBytes(4).toString('hex')}@example.com`, 'a wrong password')).statusCode).toBe(401);
    // Failed sign-ins have a table of their own (sign_in_throttles; test/api/sign-in-throttle.test.ts).
    expect([...(await tallies())].filter((id) => !before.has(id))).toEqual([]);
    const subjects = [gone.id, kept.id];

    await db().delete(users).where(eq(users.id, gone.id));
    // While their buckets are recent, every tally stays: a request may still be counting against it.
    await pruneRateLimitBuckets(db());
    expect([...(await tallies())]).toEqual(expect.arrayContaining(subjects));
    await db().execute(sql`update rate_limit_buckets set second = second - 7200 where second >= 0 and key_id in (${sql.join(subjects.map((id) => sql`${id}::uuid`), sql`, `)})`);
    await pruneRateLimitBuckets(db());
    const after = await tallies();
    expect(after.has(kept.id)).toBe(true);
    expect(after.has(gone.id)).toBe(false);
    expect((await tenant.request('GET', '/api/v1/tasks')).statusCode).toBe(200);
    expect(await tallies()).toContain((await queryRows<{ id: string }>(db(), sql`select id from api_keys where workspace_id = ${tenant.workspace.id}`))[0]!.id);
  });
});
