/**
 * The sign-in throttles on both databases: only failures count (an attempt that succeeds is taken
 * back), per email with a lock that doubles, per client network whatever the email, and stale rows go.
 */
import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import { describe, expect, it } from 'vitest';
import { hashPassword } from '../../src/domain/passwords.js';
import { emailSubject, EMAIL_THROTTLE, findOrCreateAccount, NETWORK_THROTTLE, networkOf, networkSubject } from '../../src/engine/users.js';
import { queryRows } from '../../src/store/db.js';
import { setPasswordHash } from '../../src/store/users.js';
import { DEFAULT_AGENT, startTestApi, useTestApi, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const PASSWORD = 'correct horse battery staple';
const WRONG = 'not the password at all';

describe('networkOf', () => {
  it('is an IPv4 address itself (mapped or not) and the /64 of an IPv6 one', () => {
    expect(networkOf('203.0.113.7')).toBe('203.0.113.7');
    expect(networkOf('::ffff:203.0.113.7')).toBe('203.0.113.7');
    expect(networkOf('2001:db8:0:1:aaaa:bbbb:cccc:dddd')).toBe('2001:db8:0:1::/64');
    expect(networkOf('2001:0db8:0000:0001::1')).toBe('2001:db8:0:1::/64');
    expect(networkOf('2001:db8::1')).toBe('2001:db8:0:0::/64');
    expect(networkOf('::1')).toBe('0:0:0:0::/64');
  });
});

describe.each(testDrivers)('the sign-in throttles on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const db = () => api.db.database.db;

  async function newPerson(): Promise<{ id: string; email: string }> {
    const email = `throttle-${randomBytes(5).toString('hex')}@example.com`;
    const { user } = await db().transaction((tx) => findOrCreateAccount(tx, { email, defaultAgent: DEFAULT_AGENT }));
    await setPasswordHash(db(), user.id, await hashPassword(PASSWORD));
    return { id: user.id, email };
  }

  const signIn = (email: string, password: string, ip: string) =>
    api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in', payload: { email, password }, remoteAddress: ip });

  async function failuresOf(subject: string): Promise<number | null> {
    const [row] = await queryRows<{ failures: number }>(db(), sql`select failures from sign_in_throttles where subject = ${subject}`);
    return row ? Number(row.failures) : null;
  }

  const setFailures = (subject: string, failures: number, secondsAgo = 0) =>
    db().execute(sql`
      insert into sign_in_throttles (subject, failures, last_failure_at) values (${subject}, ${failures}, now() - ${secondsAgo} * interval '1 second')
      on conflict (subject) do update set failures = excluded.failures, last_failure_at = excluded.last_failure_at`);

  function expectLocked(response: Awaited<ReturnType<typeof signIn>>, of: 'this email' | 'your network', atMostSeconds: number, moreThanSeconds = 0) {
    expect(response.statusCode, response.body).toBe(429);
    expect(response.json().error).toMatchObject({ code: 'rate_limited', message: `Too many failed sign-in attempts for ${of}; try again later` });
    const retryAfter = Number(response.headers['retry-after']);
    expect(retryAfter).toBeGreaterThan(moreThanSeconds);
    expect(retryAfter).toBeLessThanOrEqual(atMostSeconds);
    expect(response.json().error.details).toEqual({ retryAfterSeconds: retryAfter });
  }

  it('counts only failures of a network: successes are taken back; at the limit every email of it is refused, other networks are not', async () => {
    const ip = '203.0.113.7';
    const person = await newPerson();
    const other = await newPerson();
    await setFailures(networkSubject(ip), NETWORK_THROTTLE.limit - 1, 60);

    // One short of the limit, successes come and go without counting.
    for (let i = 0; i < 3; i++) expect((await signIn(person.email, PASSWORD, ip)).statusCode, `success ${i + 1}`).toBe(200);
    expect(await failuresOf(networkSubject(ip))).toBe(NETWORK_THROTTLE.limit - 1);
    // Nor did they move the time of the last failure (which would lengthen the lock to come).
    const [age] = await queryRows<{ seconds: number }>(db(), sql`select extract(epoch from now() - last_failure_at)::int as seconds from sign_in_throttles where subject = ${networkSubject(ip)}`);
    expect(Number(age!.seconds)).toBeGreaterThanOrEqual(59);

    expect((await signIn(person.email, WRONG, ip)).statusCode).toBe(401);
    expectLocked(await signIn(other.email, PASSWORD, ip), 'your network', NETWORK_THROTTLE.lockSeconds);
    // The same /64 of IPv6 is one network; the refused attempt was not counted.
    expect(await failuresOf(networkSubject(ip))).toBe(NETWORK_THROTTLE.limit);
    expect((await signIn(other.email, PASSWORD, '198.51.100.9')).statusCode).toBe(200);
    await setFailures(networkSubject('2001:db8:0:1::1'), NETWORK_THROTTLE.limit, 0);
    expectLocked(await signIn(other.email, PASSWORD, '2001:db8:0:1:ffff::2'), 'your network', NETWORK_THROTTLE.lockSeconds);
    expect((await signIn(other.email, PASSWORD, '2001:db8:0:2::1')).statusCode).toBe(200);
    // The email of the one failure is far from its own limit, and its success forgot it.
    expect(await failuresOf(emailSubject(person.email))).toBe(1);
    expect((await signIn(person.email, PASSWORD, '198.51.100.9')).statusCode).toBe(200);
    expect(await failuresOf(emailSubject(person.email))).toBeNull();
  });

  it('locks an email at ten failures for 15 minutes, doubling with each failure after a lock, and forgets a day after', async () => {
    const person = await newPerson();
    const subject = emailSubject(person.email);
    const ip = '198.51.100.20';
    for (let i = 0; i < EMAIL_THROTTLE.limit; i++) expect((await signIn(person.email, WRONG, ip)).statusCode, `failure ${i + 1}`).toBe(401);
    expectLocked(await signIn(person.email, PASSWORD, ip), 'this email', EMAIL_THROTTLE.lockSeconds);
    expect(await failuresOf(subject)).toBe(EMAIL_THROTTLE.limit);

    // Once the lock has passed, one more failure locks it twice as long.
    await setFailures(subject, EMAIL_THROTTLE.limit, EMAIL_THROTTLE.lockSeconds + 1);
    expect((await signIn(person.email, WRONG, ip)).statusCode).toBe(401);
    expectLocked(await signIn(person.email, PASSWORD, ip), 'this email', 2 * EMAIL_THROTTLE.lockSeconds, EMAIL_THROTTLE.lockSeconds);

    // A day after the last lock ended, the failures are forgotten: the next one is the first again.
    await setFailures(subject, EMAIL_THROTTLE.limit + 1, 2 * EMAIL_THROTTLE.lockSeconds + EMAIL_THROTTLE.forgetSeconds + 1);
    expect((await signIn(person.email, WRONG, ip)).statusCode).toBe(401);
    expect(await failuresOf(subject)).toBe(1);
    expect((await signIn(person.email, PASSWORD, ip)).statusCode).toBe(200);
    expect(await failuresOf(subject)).toBeNull();
  });

  it('deletes rows that say nothing any more: a success leaves no row without failures, a failed sign-in prunes stale rows', async () => {
    const person = await newPerson();
    // The success's attempt, counted while it was checked, is taken back with the row it made.
    expect((await signIn(person.email, PASSWORD, '192.0.2.2')).statusCode).toBe(200);
    expect(await failuresOf(networkSubject('192.0.2.2'))).toBeNull();
    expect(await failuresOf(emailSubject(person.email))).toBeNull();

    const stale = networkSubject('192.0.2.1');
    const recent = networkSubject('192.0.2.3');
    await setFailures(stale, 5, 3 * 24 * 3600);
    await setFailures(recent, 5, 3600);
    expect((await signIn(`nobody-${randomBytes(4).toString('hex')}@example.com`, WRONG, '192.0.2.4')).statusCode).toBe(401);
    expect(await failuresOf(stale)).toBeNull();
    expect(await failuresOf(recent)).toBe(5);
    expect(await failuresOf(networkSubject('192.0.2.4'))).toBe(1);
  });
});

describe.each(testDrivers)('the client a sign-in comes from on %s', (driver) => {
  it('is the TCP peer unless SVC_TRUST_PROXY names it a proxy, then the address it forwards for', async () => {
    const proxy = '10.9.8.7';
    const forwardedFor = `203.0.113.${randomBytes(1)[0]! % 200}`;
    const attempt = (api: TestApi) =>
      api.app.inject({
        method: 'POST',
        url: '/api/v1/auth/sign-in',
        payload: { email: `nobody-${randomBytes(4).toString('hex')}@example.com`, password: WRONG },
        remoteAddress: proxy,
        headers: { 'x-forwarded-for': forwardedFor },
      });
    const failuresOf = async (api: TestApi, ip: string) =>
      (await queryRows<{ failures: number }>(api.db.database.db, sql`select failures from sign_in_throttles where subject = ${networkSubject(ip)}`)).map((row) => Number(row.failures));

    const direct = await startTestApi(driver);
    try {
      expect((await attempt(direct)).statusCode).toBe(401);
      // Without the setting a forwarded address is the client's say-so: the proxy's address is counted.
      expect(await failuresOf(direct, proxy)).toEqual([1]);
      expect(await failuresOf(direct, forwardedFor)).toEqual([]);
    } finally {
      await direct.close();
    }
    const behind = await startTestApi(driver, { trustProxy: [proxy] });
    try {
      expect((await attempt(behind)).statusCode).toBe(401);
      expect(await failuresOf(behind, forwardedFor)).toEqual([1]);
      expect(await failuresOf(behind, proxy)).toEqual([]);
    } finally {
      await behind.close();
    }
  });
});
