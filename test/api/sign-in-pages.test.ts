/**
 * The pages around signing in, on both databases: the pairing page says who is signed in, and request
 * logs never carry the secrets that travel in URLs (sign-in link tokens, codes and tokens in a query).
 */
import { randomBytes } from 'node:crypto';
import { Writable } from 'node:stream';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { challengeOf } from '../../src/domain/runners.js';
import { findOrCreateAccount, issueSignInLink } from '../../src/engine/users.js';
import { buildServer, redactUrl } from '../../src/server/app.js';
import { TEST_PUBLIC_URL, DEFAULT_AGENT, useTestApi, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

describe('redactUrl', () => {
  it('hides the token of a sign-in link and secret-bearing query values, and keeps the rest', () => {
    expect(redactUrl('/auth/sign-in/abcDEF123_-?next=%2Ftasks')).toBe('/auth/sign-in/[redacted]?next=%2Ftasks');
    expect(redactUrl('/pair-runner?challenge=c&code=ABCD-EFGH&pairingCode=X&token=t&name=laptop')).toBe(
      '/pair-runner?challenge=c&code=[redacted]&pairingCode=[redacted]&token=[redacted]&name=laptop',
    );
    expect(redactUrl('/api/v1/tasks?limit=5')).toBe('/api/v1/tasks?limit=5');
  });
});

describe.each(testDrivers)('sign-in pages on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const db = () => api.db.database.db;

  async function newPerson(): Promise<{ id: string; email: string }> {
    const email = `pages-${randomBytes(5).toString('hex')}@example.com`;
    const { user } = await db().transaction((tx) => findOrCreateAccount(tx, { email, defaultAgent: DEFAULT_AGENT }));
    return { id: user.id, email };
  }

  it('shows on the pairing page which email is signed in', async () => {
    const person = await newPerson();
    const { url } = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
    const signedIn = await api.app.inject({ method: 'POST', url: url.slice(TEST_PUBLIC_URL.length) });
    expect(signedIn.statusCode).toBe(303);
    const cookie = String(signedIn.headers['set-cookie']).split(';')[0]!;
    const challenge = challengeOf(randomBytes(32).toString('base64url'));
    const page = await api.app.inject({ method: 'GET', url: `/pair-runner?challenge=${challenge}&name=laptop`, headers: { cookie } });
    expect(page.statusCode, page.body).toBe(200);
    expect(page.body).toContain(`Signed in as <strong>${person.email}</strong>`);
    // Its form posts back with the real Origin: under no-referrer a browser would send `Origin: null`.
    expect(page.headers['referrer-policy']).toBe('same-origin');
  });

  it('keeps sign-in link tokens and secret query values out of the request logs', async () => {
    const lines: string[] = [];
    const sink = new Writable({
      write(chunk: Buffer, _encoding, done) {
        lines.push(...chunk.toString('utf8').split('\n').filter(Boolean));
        done();
      },
    });
    const logged = await buildServer({
      database: api.db.database,
      publicUrl: TEST_PUBLIC_URL,
      dataDir: api.dataDir,
      rateLimits: { perMinute: 1000, perHour: 10_000 },
      logger: pino({ level: 'info' }, sink),
    });
    try {
      const person = await newPerson();
      const { url } = await issueSignInLink(db(), person.id, TEST_PUBLIC_URL);
      const token = url.slice(url.lastIndexOf('/') + 1);
      expect((await logged.inject({ method: 'GET', url: `/auth/sign-in/${token}?next=%2Fx` })).statusCode).toBe(200);
      expect((await logged.inject({ method: 'POST', url: `/auth/sign-in/${token}` })).statusCode).toBe(303);
      expect((await logged.inject({ method: 'GET', url: '/pair-runner?challenge=x&code=ABCD-EFGH' })).statusCode).toBe(400);
      const requests = lines.map((line) => JSON.parse(line) as { msg: string; req?: { url: string } }).filter((line) => line.req);
      expect(requests.map((line) => line.req!.url)).toEqual([
        '/auth/sign-in/[redacted]?next=%2Fx',
        '/auth/sign-in/[redacted]',
        '/pair-runner?challenge=x&code=[redacted]',
      ]);
      const all = lines.join('\n');
      expect(all).not.toContain(token);
      expect(all).not.toContain('ABCD-EFGH');
    } finally {
      await logged.close();
    }
  });
});
