/**
 * Desktop runner connections on both databases, through the real server: pairing codes (session only),
 * enrollment with the verifier (wrong verifiers burn a code, a code works once, retries get the same
 * receipt, racing enrollments have one winner), the runner credential, revocation and reconnecting (the
 * old connection's claimed runs fail exactly once; on PostgreSQL, without a deadlock against a receipt or
 * an owner's answer racing it), heartbeats (workspace, capabilities, projects),
 * validation and body limits, the user's list of connections, the browser's pairing page, and the check
 * of a local task's target.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import { eq, sql } from 'drizzle-orm';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import { ValidationError } from '../src/domain/errors.js';
import { challengeOf, hashPairingCode, hashRunnerCredential, normalizePairingCode } from '../src/domain/runners.js';
import { RECONNECT_STOPPED_RUN, resolveLocalTarget, type LocalTargetInput } from '../src/engine/runners/enrollment.js';
import { findOrCreateAccount, issueSignInLink } from '../src/engine/users.js';
import { RUNNER_LIMITS, type Capabilities, type EnrollmentReceipt, type ProjectRegistration } from '../src/protocol/runner.js';
import { queryRows } from '../src/store/db.js';
import { eventParts, jobs, localRequests, runnerPairings, runnerProjects, runners, tasks } from '../src/store/schema.js';
import { addMembership, findPersonalWorkspace } from '../src/store/users.js';
import type { Workspace } from '../src/store/workspaces.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, useTestApi, type Tenant, type TestApi } from './support/api.js';
import { postgresUrl, testDrivers } from './support/db.js';

const INVALID_PAIRING = { error: { code: 'unauthorized', message: 'Invalid pairing code or verifier' } };
const RUNNER_UNAUTHORIZED = { error: { code: 'unauthorized', message: 'Invalid or missing runner credential' } };
const USER_REQUIRED = { error: { code: 'forbidden', message: 'This endpoint needs a signed-in user; workspace API keys cannot use it' } };

interface Person {
  id: string;
  personal: Workspace;
  browser: Browser;
}

interface Browser {
  cookie: string;
  csrfToken: string;
  request(method: InjectOptions['method'], url: string, body?: unknown, headers?: Record<string, string>): Promise<LightMyRequestResponse>;
}

interface Enrolled {
  receipt: EnrollmentReceipt;
  credential: string;
}

const newVerifier = () => {
  const verifier = randomBytes(32).toString('base64url');
  return { verifier, challenge: challengeOf(verifier) };
};
const newCredential = () => `service_runner_${randomBytes(32).toString('base64url')}`;
const project = (name: string, repositories: ProjectRegistration['repositories'] = [{ name: 'acme/web', remoteUrl: 'git@github.com:acme/web.git', defaultBranch: 'main' }]) => ({
  id: randomUUID(),
  name,
  repositories,
});
const CAPABILITIES: Capabilities = {
  models: { 'claude-code': [{ id: 'claude-sonnet-4-5', name: 'Claude Sonnet 4.5' }], codex: [{ id: 'gpt-5-codex', name: 'GPT-5 Codex' }] },
  modelSource: 'discovered',
  nativeControls: { 'claude-code': { commands: ['permission'], fullAccess: true, questions: true, asyncQuestions: true } },
};

function helpers(api: () => TestApi) {
  const db = () => api().db.database.db;
  const inject = (options: InjectOptions) => api().app.inject(options);

  async function newPerson(): Promise<Person> {
    const email = `runner-${randomBytes(5).toString('hex')}@example.com`;
    const { user } = await db().transaction((tx) => findOrCreateAccount(tx, { email, defaultAgent: DEFAULT_AGENT }));
    const { url } = await issueSignInLink(db(), user.id, TEST_PUBLIC_URL);
    const signedIn = await inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: url.slice(url.lastIndexOf('/') + 1) } });
    expect(signedIn.statusCode, signedIn.body).toBe(200);
    const setCookie = String(signedIn.headers['set-cookie']);
    const cookie = setCookie.slice(0, setCookie.indexOf(';'));
    const csrfToken: string = signedIn.json().csrfToken;
    const browser: Browser = {
      cookie,
      csrfToken,
      request: (method, url, body, headers = {}) =>
        inject({ method, url, headers: { cookie, 'x-csrf-token': csrfToken, ...headers }, ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }) }),
    };
    return { id: user.id, personal: (await findPersonalWorkspace(db(), user.id))!, browser };
  }

  async function pairingCode(person: Person, challenge: string): Promise<string> {
    const response = await person.browser.request('POST', '/api/v1/runner-pairings', { challenge, name: 'laptop' });
    expect(response.statusCode, response.body).toBe(201);
    return response.json().pairingCode;
  }

  const enrollRequest = (body: unknown) => inject({ method: 'POST', url: '/api/v1/runners/enroll', payload: body as InjectOptions['payload'] });

  /** Pairs and enrolls a new connection of `person`; `extra` goes into the enroll body. */
  async function enroll(person: Person, extra: Record<string, unknown> = {}): Promise<Enrolled> {
    const { verifier, challenge } = newVerifier();
    const credential = newCredential();
    const response = await enrollRequest({ pairingCode: await pairingCode(person, challenge), verifier, credential, name: 'laptop', ...extra });
    expect(response.statusCode, response.body).toBe(200);
    return { receipt: response.json(), credential };
  }

  const asRunner = (credential: string, method: InjectOptions['method'], url: string, body?: unknown) =>
    inject({ method, url, headers: { authorization: `Bearer ${credential}` }, ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }) });

  const runnerRow = async (id: string) => (await db().select().from(runners).where(eq(runners.id, id)))[0]!;
  const projectIds = async (runnerId: string) =>
    (await db().select({ id: runnerProjects.id }).from(runnerProjects).where(eq(runnerProjects.runnerId, runnerId))).map((row) => row.id).sort();

  /** A local task of the runner with one run in `status`, as the runs side would have made it. */
  async function localRun(person: Person, runnerId: string, projectId: string, status: 'PENDING' | 'IN_PROGRESS') {
    const [task] = await db()
      .insert(tasks)
      .values({
        workspaceId: person.personal.id,
        slug: `local-${randomBytes(4).toString('hex')}`,
        title: 'Local work',
        status,
        mode: 'agent',
        agent: 'claude-code/claude-sonnet-4-5',
        effort: 'medium',
        createdByUserId: person.id,
        runnerId,
        projectId,
        permissionMode: 'ask',
      })
      .returning();
    const [job] = await db()
      .insert(jobs)
      .values({
        taskId: task!.id,
        workspaceId: person.personal.id,
        status,
        type: 'SWE',
        agent: 'claude-code/claude-sonnet-4-5',
        agentProvider: 'claude-code',
        input: 'Fix it',
        runnerId,
        ...(status === 'IN_PROGRESS' ? { runnerState: 'executing', generation: 1, startedAt: new Date() } : {}),
      })
      .returning();
    return { task: task!, job: job! };
  }
  const jobRow = async (id: string) => (await db().select().from(jobs).where(eq(jobs.id, id)))[0]!;
  const taskRow = async (id: string) => (await db().select().from(tasks).where(eq(tasks.id, id)))[0]!;

  return { db, inject, newPerson, pairingCode, enrollRequest, enroll, asRunner, runnerRow, projectIds, localRun, jobRow, taskRow };
}

describe.each(testDrivers)('pairing and enrollment on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const { db, newPerson, pairingCode, enrollRequest, enroll, asRunner, runnerRow } = helpers(() => api);

  it('issues pairing codes to a signed-in user only, bound to the challenge, the user and the personal workspace', async () => {
    const person = await newPerson();
    const { challenge } = newVerifier();
    const withKey = await tenant.request('POST', '/api/v1/runner-pairings', { challenge });
    expect(withKey.statusCode).toBe(403);
    expect(withKey.json()).toEqual(USER_REQUIRED);
    const anonymous = await api.app.inject({ method: 'POST', url: '/api/v1/runner-pairings', payload: { challenge } });
    expect(anonymous.statusCode).toBe(401);
    const badChallenge = await person.browser.request('POST', '/api/v1/runner-pairings', { challenge: 'too-short' });
    expect(badChallenge.statusCode).toBe(400);
    expect(badChallenge.json().error.details.issues).toEqual([{ field: 'challenge', message: expect.any(String) }]);
    const noCsrf = await person.browser.request('POST', '/api/v1/runner-pairings', { challenge }, { 'x-csrf-token': 'wrong' });
    expect(noCsrf.statusCode).toBe(403);
    expect(await queryRows(db(), sql`select id from runner_pairings where challenge = ${challenge}`)).toEqual([]);

    const issued = await person.browser.request('POST', '/api/v1/runner-pairings', { challenge, name: 'Ada’s laptop' });
    expect(issued.statusCode, issued.body).toBe(201);
    const { pairingCode: code, expiresAt } = issued.json();
    expect(code).toMatch(/^[A-Z0-9]{4}-[A-Z0-9]{4}$/);
    const [row] = await db().select().from(runnerPairings).where(eq(runnerPairings.challenge, challenge));
    expect(row).toMatchObject({
      codeHash: hashPairingCode(normalizePairingCode(code)!),
      userId: person.id,
      workspaceId: person.personal.id,
      name: 'Ada’s laptop',
      usedAt: null,
      failedAttempts: 0,
    });
    expect(row!.expiresAt.toISOString()).toBe(new Date(expiresAt).toISOString());
    const [lifetime] = await queryRows<{ seconds: number }>(db(), sql`select extract(epoch from expires_at - created_at)::float8 as seconds from runner_pairings where id = ${row!.id}`);
    expect(Number(lifetime!.seconds)).toBe(RUNNER_LIMITS.pairingCodeTtlMs / 1000);
    // The code is never stored as given.
    expect(JSON.stringify(await queryRows(db(), sql`select * from runner_pairings where id = ${row!.id}`))).not.toContain(code.replace('-', ''));
  });

  it('enrolls with the code and its verifier: the receipt, the credential, the projects and capabilities', async () => {
    const person = await newPerson();
    const projects = [project('web'), project('scratch', [])];
    const { receipt, credential } = await enroll(person, { platform: 'darwin-arm64', runnerVersion: '0.1.0', capabilities: CAPABILITIES, projects });
    expect(receipt).toEqual({
      runnerId: expect.any(String),
      userId: person.id,
      workspaceId: person.personal.id,
      name: 'laptop',
      enrolledAt: expect.any(String),
      reconnected: false,
      finalizedRuns: [],
      heartbeatIntervalMs: 30_000,
    });
    const identity = await asRunner(credential, 'GET', '/api/v1/runners/identity');
    expect(identity.statusCode).toBe(200);
    expect(identity.json()).toEqual({ runnerId: receipt.runnerId, workspaceId: person.personal.id, userId: person.id, revoked: false });

    const row = await runnerRow(receipt.runnerId);
    expect(row).toMatchObject({ userId: person.id, platform: 'darwin-arm64', runnerVersion: '0.1.0', credentialHash: hashRunnerCredential(credential), revokedAt: null });
    expect(row.capabilities).toEqual({
      ...CAPABILITIES,
      nativeControls: { 'claude-code': { commands: ['permission'], fullAccess: true, questions: true, asyncQuestions: true } },
    });
    expect(JSON.stringify(await queryRows(db(), sql`select * from runners where id = ${receipt.runnerId}`))).not.toContain(credential);
    const stored = await db().select().from(runnerProjects).where(eq(runnerProjects.runnerId, receipt.runnerId));
    expect(stored.map(({ id, name, repositories }) => ({ id, name, repositories })).sort((a, b) => a.name.localeCompare(b.name))).toEqual(
      [...projects].sort((a, b) => a.name.localeCompare(b.name)),
    );
    const [pairing] = await queryRows<{ used: boolean }>(db(), sql`select used_at is not null as used from runner_pairings where user_id = ${person.id}`);
    expect(pairing!.used).toBe(true);
  });

  it('refuses a code without its verifier, and five wrong verifiers burn the code', async () => {
    const person = await newPerson();
    const attempt = (code: string, verifier: string) => enrollRequest({ pairingCode: code, verifier, credential: newCredential(), name: 'laptop' });

    const survivor = newVerifier();
    const survivorCode = await pairingCode(person, survivor.challenge);
    for (let i = 0; i < RUNNER_LIMITS.pairingAttempts - 1; i++) {
      const wrong = await attempt(survivorCode, newVerifier().verifier);
      expect(wrong.statusCode).toBe(401);
      expect(wrong.json()).toEqual(INVALID_PAIRING);
    }
    // Typed as a person would: lower case, without the dash.
    expect((await attempt(survivorCode.toLowerCase().replace('-', ''), survivor.verifier)).statusCode).toBe(200);

    const burnt = newVerifier();
    const burntCode = await pairingCode(person, burnt.challenge);
    for (let i = 0; i < RUNNER_LIMITS.pairingAttempts; i++) expect((await attempt(burntCode, newVerifier().verifier)).statusCode).toBe(401);
    const [row] = await db().select().from(runnerPairings).where(eq(runnerPairings.challenge, burnt.challenge));
    expect(row!.failedAttempts).toBe(RUNNER_LIMITS.pairingAttempts);
    const late = await attempt(burntCode, burnt.verifier);
    expect(late.statusCode).toBe(401);
    expect(late.json()).toEqual(INVALID_PAIRING);

    // Codes nobody issued, and ones that cannot be codes, get the same answer.
    expect((await attempt('ACDE-FGHK', burnt.verifier)).json()).toEqual(INVALID_PAIRING);
    expect((await attempt('00000000', burnt.verifier)).json()).toEqual(INVALID_PAIRING);
  });

  it('refuses an expired code and a used one', async () => {
    const person = await newPerson();
    const expired = newVerifier();
    const expiredCode = await pairingCode(person, expired.challenge);
    await db().update(runnerPairings).set({ expiresAt: sql`now() - interval '1 second'` }).where(eq(runnerPairings.challenge, expired.challenge));
    const late = await enrollRequest({ pairingCode: expiredCode, verifier: expired.verifier, credential: newCredential(), name: 'laptop' });
    expect(late.statusCode).toBe(401);
    expect(late.json()).toEqual(INVALID_PAIRING);

    const used = newVerifier();
    const usedCode = await pairingCode(person, used.challenge);
    expect((await enrollRequest({ pairingCode: usedCode, verifier: used.verifier, credential: newCredential(), name: 'laptop' })).statusCode).toBe(200);
    const again = await enrollRequest({ pairingCode: usedCode, verifier: used.verifier, credential: newCredential(), name: 'laptop' });
    expect(again.statusCode).toBe(401);
    expect(again.json()).toEqual(INVALID_PAIRING);
    expect(await queryRows(db(), sql`select id from runners where user_id = ${person.id}`)).toHaveLength(1);
  });

  it('answers a retry with the same credential with the same receipt, and never re-enables a connection revoked since', async () => {
    const person = await newPerson();
    const { verifier, challenge } = newVerifier();
    const body = { pairingCode: await pairingCode(person, challenge), verifier, credential: newCredential(), name: 'laptop', projects: [project('web')] };
    const first = await enrollRequest(body);
    expect(first.statusCode).toBe(200);
    const retry = await enrollRequest(body);
    expect(retry.statusCode).toBe(200);
    expect(retry.json()).toEqual(first.json());
    expect(await queryRows(db(), sql`select id from runners where user_id = ${person.id}`)).toHaveLength(1);

    const revoked = await person.browser.request('POST', `/api/v1/runners/${first.json().runnerId}/revoke`);
    expect(revoked.statusCode, revoked.body).toBe(200);
    await db().update(runnerPairings).set({ expiresAt: sql`now() - interval '1 second'` }).where(eq(runnerPairings.challenge, challenge));
    const afterRevoke = await enrollRequest(body);
    expect(afterRevoke.statusCode).toBe(200);
    expect(afterRevoke.json()).toEqual(first.json());
    expect((await asRunner(body.credential, 'GET', '/api/v1/runners/identity')).json().revoked).toBe(true);
    expect((await asRunner(body.credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id })).statusCode).toBe(401);
  });

  // PGlite has one connection, which serializes the two; on PostgreSQL they truly race.
  it('lets exactly one of two enrollments racing with one code win', async () => {
    const person = await newPerson();
    const { verifier, challenge } = newVerifier();
    const code = await pairingCode(person, challenge);
    const credentials = [newCredential(), newCredential()];
    const answers = await Promise.all(credentials.map((credential) => enrollRequest({ pairingCode: code, verifier, credential, name: 'laptop' })));
    expect(answers.map((answer) => answer.statusCode).sort()).toEqual([200, 401]);
    expect(answers.find((answer) => answer.statusCode === 401)!.json()).toEqual(INVALID_PAIRING);
    const hashes = credentials.map(hashRunnerCredential);
    const created = await queryRows<{ credential_hash: string }>(db(), sql`select credential_hash from runners where user_id = ${person.id}`);
    expect(created).toHaveLength(1);
    expect(hashes).toContain(created[0]!.credential_hash);
  });

  // A retry racing the request it repeats (the answer was slow, not lost): both get the one receipt.
  it('answers two identical enrollments racing with one code the same receipt', async () => {
    const person = await newPerson();
    const { verifier, challenge } = newVerifier();
    const body = { pairingCode: await pairingCode(person, challenge), verifier, credential: newCredential(), name: 'laptop' };
    const answers = await Promise.all([enrollRequest(body), enrollRequest(body)]);
    expect(answers.map((answer) => answer.statusCode), answers.map((answer) => answer.body).join('\n')).toEqual([200, 200]);
    expect(answers[1]!.json()).toEqual(answers[0]!.json());
    expect(await queryRows(db(), sql`select id from runners where user_id = ${person.id}`)).toHaveLength(1);
  });

  it('refuses a credential another connection already holds', async () => {
    const person = await newPerson();
    const { credential } = await enroll(person);
    const { verifier, challenge } = newVerifier();
    const code = await pairingCode(person, challenge);
    // A credential with a receipt is a retry and gets that receipt; without one (lost here on purpose),
    // a credential another connection holds is refused.
    await db().execute(sql`delete from runner_enrollments where credential_hash = ${hashRunnerCredential(credential)}`);
    const taken = await enrollRequest({ pairingCode: code, verifier, credential, name: 'laptop' });
    expect(taken.statusCode).toBe(409);
    expect(taken.json().error.code).toBe('conflict');
    // The refusal rolled back: the code still works with a fresh credential.
    expect((await enrollRequest({ pairingCode: code, verifier, credential: newCredential(), name: 'laptop' })).statusCode).toBe(200);
  });

  it('takes only runner credentials on /runners: API keys, session cookies and junk are 401', async () => {
    const person = await newPerson();
    await enroll(person);
    for (const headers of [
      tenant.headers,
      { cookie: person.browser.cookie },
      {},
      { authorization: `Bearer ${newCredential()}` },
      { authorization: 'Bearer service_runner_short' },
      { authorization: `Basic ${Buffer.from('a:b').toString('base64')}` },
    ]) {
      const response = await api.app.inject({ method: 'GET', url: '/api/v1/runners/identity', headers });
      expect(response.statusCode, JSON.stringify(headers)).toBe(401);
      expect(response.json()).toEqual(RUNNER_UNAUTHORIZED);
    }
  });

  it('revokes a connection for its owner only: the credential stops working but /identity says revoked', async () => {
    const person = await newPerson();
    const other = await newPerson();
    const { receipt, credential } = await enroll(person);
    const heartbeat = () => asRunner(credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id });
    expect((await heartbeat()).statusCode).toBe(200);
    const versionBefore = (await runnerRow(receipt.runnerId)).workVersion;

    expect((await other.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).statusCode).toBe(404);
    expect((await other.browser.request('POST', `/api/v1/runners/${randomUUID()}/revoke`)).json()).toEqual({ error: { code: 'not_found', message: 'Runner not found' } });
    expect((await tenant.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).json()).toEqual(USER_REQUIRED);
    expect((await heartbeat()).statusCode).toBe(200);

    const revoked = await person.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`);
    expect(revoked.statusCode, revoked.body).toBe(200);
    expect(revoked.json()).toMatchObject({ id: receipt.runnerId, revoked: true, online: false });
    expect((await runnerRow(receipt.runnerId)).workVersion).toBeGreaterThan(versionBefore);

    const refused = await heartbeat();
    expect(refused.statusCode).toBe(401);
    expect(refused.json().error).toEqual({ code: 'unauthorized', message: 'This runner connection was revoked; pair the computer again (svc runner pair)' });
    const identity = await asRunner(credential, 'GET', '/api/v1/runners/identity');
    expect(identity.statusCode).toBe(200);
    expect(identity.json()).toEqual({ runnerId: receipt.runnerId, workspaceId: person.personal.id, userId: person.id, revoked: true });
  });
});

describe.each(testDrivers)('reconnecting a revoked connection on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const { db, newPerson, pairingCode, enrollRequest, enroll, asRunner, runnerRow, projectIds, localRun, jobRow, taskRow } = helpers(() => api);

  it('fails the claimed runs exactly once, keeps queued ones, rotates the credential and keeps the project ids', async () => {
    const person = await newPerson();
    const projects = [project('web'), project('api')];
    const { receipt, credential: oldCredential } = await enroll(person, { projects, capabilities: CAPABILITIES });
    const claimed = await localRun(person, receipt.runnerId, projects[0]!.id, 'IN_PROGRESS');
    const queued = await localRun(person, receipt.runnerId, projects[1]!.id, 'PENDING');
    expect((await person.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).statusCode).toBe(200);

    const { verifier, challenge } = newVerifier();
    const newCredentialValue = newCredential();
    const body = {
      pairingCode: await pairingCode(person, challenge),
      verifier,
      credential: newCredentialValue,
      name: 'laptop',
      reconnect: { runnerId: receipt.runnerId, credential: oldCredential, stopped: true },
    };
    const reconnected = await enrollRequest(body);
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    expect(reconnected.json()).toMatchObject({
      runnerId: receipt.runnerId,
      userId: person.id,
      workspaceId: person.personal.id,
      reconnected: true,
      finalizedRuns: [claimed.job.id],
    });

    const failed = await jobRow(claimed.job.id);
    expect(failed).toMatchObject({ status: 'FAILED', error: RECONNECT_STOPPED_RUN });
    expect(failed.completedAt).not.toBeNull();
    expect((await taskRow(claimed.task.id)).status).toBe('FAILED');
    expect((await jobRow(queued.job.id)).status).toBe('PENDING');
    expect((await taskRow(queued.task.id)).status).toBe('PENDING');

    expect((await asRunner(oldCredential, 'GET', '/api/v1/runners/identity')).statusCode).toBe(401);
    expect((await asRunner(oldCredential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id })).statusCode).toBe(401);
    expect((await asRunner(newCredentialValue, 'GET', '/api/v1/runners/identity')).json()).toEqual({
      runnerId: receipt.runnerId,
      workspaceId: person.personal.id,
      userId: person.id,
      revoked: false,
    });
    expect((await asRunner(newCredentialValue, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id })).statusCode).toBe(200);
    expect(await projectIds(receipt.runnerId)).toEqual(projects.map((p) => p.id).sort());
    // Capabilities the reconnect did not send stay.
    expect((await runnerRow(receipt.runnerId)).capabilities).toMatchObject({ models: CAPABILITIES.models });

    // A run the new connection claims after the reconnect is not the old connection's: a retry leaves it.
    const laterClaim = await localRun(person, receipt.runnerId, projects[0]!.id, 'IN_PROGRESS');
    const retry = await enrollRequest(body);
    expect(retry.statusCode).toBe(200);
    expect(retry.json()).toEqual(reconnected.json());
    expect((await jobRow(laterClaim.job.id)).status).toBe('IN_PROGRESS');
    expect((await jobRow(claimed.job.id)).completedAt).toEqual(failed.completedAt);
  });

  it('clears the prompts still pending and drops the staged parts of the runs it ends, cancelled ones included', async () => {
    const person = await newPerson();
    const web = project('web');
    const { receipt, credential } = await enroll(person, { projects: [web] });
    const claimed = await localRun(person, receipt.runnerId, web.id, 'IN_PROGRESS');
    const cancelled = await localRun(person, receipt.runnerId, web.id, 'IN_PROGRESS');
    await db().update(jobs).set({ status: 'CANCELLED' }).where(eq(jobs.id, cancelled.job.id));
    await db().update(tasks).set({ status: 'CANCELLED' }).where(eq(tasks.id, cancelled.task.id));
    for (const { job, task } of [claimed, cancelled]) {
      await db()
        .insert(localRequests)
        .values([
          { jobId: job.id, taskId: task.id, requestId: 'p1', kind: 'permission', tool: 'bash', payload: {}, status: 'pending' },
          { jobId: job.id, taskId: task.id, requestId: 'q1', kind: 'async_question', tool: null, payload: {}, status: 'pending' },
        ]);
      await db().insert(eventParts).values({ jobId: job.id, generation: 1, sequence: 1, part: 0, digest: 'a'.repeat(64), sizeBytes: 10, data: Buffer.from('{"sequ') });
    }
    expect((await person.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).statusCode).toBe(200);
    const { verifier, challenge } = newVerifier();
    const reconnected = await enrollRequest({
      pairingCode: await pairingCode(person, challenge),
      verifier,
      credential: newCredential(),
      name: 'laptop',
      reconnect: { runnerId: receipt.runnerId, credential, stopped: true },
    });
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    expect(reconnected.json().finalizedRuns).toEqual([claimed.job.id]);

    for (const { job } of [claimed, cancelled]) {
      const requests = await db().select().from(localRequests).where(eq(localRequests.jobId, job.id));
      // Nothing will answer a permission now; an async question stays, as after syncing.
      expect(Object.fromEntries(requests.map((request) => [request.requestId, request.status]))).toEqual({ p1: 'cleared', q1: 'pending' });
      expect(await db().select().from(eventParts).where(eq(eventParts.jobId, job.id))).toEqual([]);
    }
    expect(await jobRow(cancelled.job.id)).toMatchObject({ status: 'CANCELLED', runnerState: null });
    expect((await taskRow(claimed.task.id)).status).toBe('FAILED');
  });

  type Lock = [text: string, values: unknown[]];

  /**
   * Reconnects the runner while another transaction (PostgreSQL only) holds the locks `first` takes: once
   * the reconnect waits for it, that transaction takes `then`'s and commits. A reconnect that held one of
   * `then`'s rows while waiting would make a cycle, and one of the two would fail with 40P01.
   */
  async function reconnectWhileLocked(person: Person, old: Enrolled, first: Lock[], then: Lock[]): Promise<LightMyRequestResponse> {
    const other = new pg.Client({ connectionString: postgresUrl(), options: `-c search_path=${api.db.schema}` });
    const observer = new pg.Client({ connectionString: postgresUrl() });
    await other.connect();
    await observer.connect();
    try {
      const [{ pid }] = (await other.query<{ pid: number }>('select pg_backend_pid() as pid')).rows as [{ pid: number }];
      await other.query('begin');
      for (const [text, values] of first) await other.query(text, values);
      const { verifier, challenge } = newVerifier();
      const reconnecting = enrollRequest({
        pairingCode: await pairingCode(person, challenge),
        verifier,
        credential: newCredential(),
        name: 'laptop',
        reconnect: { runnerId: old.receipt.runnerId, credential: old.credential, stopped: true },
      });
      let waiting = false;
      for (let i = 0; i < 400 && !waiting; i++) {
        await new Promise((resolve) => setTimeout(resolve, 25));
        const { rows } = await observer.query<{ n: number }>('select count(*)::int as n from pg_stat_activity where $1 = any(pg_blocking_pids(pid))', [pid]);
        waiting = rows[0]!.n > 0;
      }
      expect(waiting, 'the reconnect waits for the other transaction').toBe(true);
      for (const [text, values] of then) await other.query(text, values);
      await other.query('commit');
      return await reconnecting;
    } finally {
      await other.end();
      await observer.end();
    }
  }

  it.runIf(driver === 'postgres')('releases a cancelled run while its owner answers its prompt, without a deadlock', async () => {
    const person = await newPerson();
    const web = project('web');
    const old = await enroll(person, { projects: [web] });
    const claimed = await localRun(person, old.receipt.runnerId, web.id, 'IN_PROGRESS');
    // Cancelled under the runner, which still holds it (no receipt), with a prompt still pending.
    const cancelled = await localRun(person, old.receipt.runnerId, web.id, 'IN_PROGRESS');
    await db().update(jobs).set({ status: 'CANCELLED' }).where(eq(jobs.id, cancelled.job.id));
    await db().update(tasks).set({ status: 'CANCELLED' }).where(eq(tasks.id, cancelled.task.id));
    const [prompt] = await db()
      .insert(localRequests)
      .values({ jobId: cancelled.job.id, taskId: cancelled.task.id, requestId: 'p1', kind: 'permission', tool: 'bash', payload: {}, status: 'pending' })
      .returning();
    expect((await person.browser.request('POST', `/api/v1/runners/${old.receipt.runnerId}/revoke`)).statusCode).toBe(200);

    // The owner answers the prompt, with the locks answerPermission takes: the task, the request, then
    // the run (the answer is refused afterwards: the run no longer executes).
    const reconnected = await reconnectWhileLocked(
      person,
      old,
      [
        ['select id from tasks where id = $1 for update', [cancelled.task.id]],
        ['select id from local_requests where id = $1 for update', [prompt!.id]],
      ],
      [['select id from jobs where id = $1 for update', [cancelled.job.id]]],
    );
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    expect(reconnected.json().finalizedRuns).toEqual([claimed.job.id]);
    expect(await jobRow(cancelled.job.id)).toMatchObject({ status: 'CANCELLED', runnerState: null });
    expect((await db().select().from(localRequests).where(eq(localRequests.id, prompt!.id)))[0]!.status).toBe('cleared');
    expect((await jobRow(claimed.job.id)).status).toBe('FAILED');
  });

  it.runIf(driver === 'postgres')('finalizes a claimed run while a receipt for it holds its task, job and runner, without a deadlock', async () => {
    const person = await newPerson();
    const web = project('web');
    const old = await enroll(person, { projects: [web] });
    const claimed = await localRun(person, old.receipt.runnerId, web.id, 'IN_PROGRESS');
    expect((await person.browser.request('POST', `/api/v1/runners/${old.receipt.runnerId}/revoke`)).statusCode).toBe(200);

    // A receipt sent just before the revocation: the task, the run, then the runner's work version.
    const reconnected = await reconnectWhileLocked(
      person,
      old,
      [
        ['select id from tasks where id = $1 for update', [claimed.task.id]],
        ['select id from jobs where id = $1 for update', [claimed.job.id]],
      ],
      [
        ["update jobs set status = 'COMPLETED', runner_state = null, completed_at = now() where id = $1", [claimed.job.id]],
        ['update runners set work_version = work_version + 1 where id = $1', [old.receipt.runnerId]],
      ],
    );
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    // The receipt came first: nothing is left for the reconnect to finalize.
    expect(reconnected.json().finalizedRuns).toEqual([]);
    expect((await jobRow(claimed.job.id)).status).toBe('COMPLETED');
  });

  it('refuses a connection that is not revoked (409), a credential that is not its current one (401) and another user (403)', async () => {
    const person = await newPerson();
    const other = await newPerson();
    const { receipt, credential } = await enroll(person, { projects: [project('web')] });
    const { verifier, challenge } = newVerifier();
    const code = await pairingCode(person, challenge);
    const attempt = (reconnect: Record<string, unknown>, pairing = code, proof = verifier) =>
      enrollRequest({ pairingCode: pairing, verifier: proof, credential: newCredential(), name: 'laptop', reconnect: { runnerId: receipt.runnerId, stopped: true, ...reconnect } });

    const notRevoked = await attempt({ credential });
    expect(notRevoked.statusCode).toBe(409);
    expect(notRevoked.json().error.code).toBe('conflict');
    expect((await asRunner(credential, 'GET', '/api/v1/runners/identity')).json().revoked).toBe(false);

    expect((await person.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).statusCode).toBe(200);
    const wrongCredential = await attempt({ credential: newCredential() });
    expect(wrongCredential.statusCode).toBe(401);
    expect((await attempt({ credential, runnerId: randomUUID() })).statusCode).toBe(401);
    const foreign = newVerifier();
    const foreignPairing = await attempt({ credential }, await pairingCode(other, foreign.challenge), foreign.verifier);
    expect(foreignPairing.statusCode).toBe(403);
    expect(foreignPairing.json().error.code).toBe('forbidden');
    expect((await asRunner(credential, 'GET', '/api/v1/runners/identity')).json().revoked).toBe(true);
    expect((await attempt({ credential, stopped: false })).statusCode).toBe(400);

    // Each refusal left the code unused: it reconnects now.
    const reconnected = await attempt({ credential });
    expect(reconnected.statusCode, reconnected.body).toBe(200);
    expect(reconnected.json()).toMatchObject({ runnerId: receipt.runnerId, reconnected: true, finalizedRuns: [] });
  });
});

describe.each(testDrivers)('heartbeats and registrations on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const { db, newPerson, pairingCode, enrollRequest, enroll, asRunner, runnerRow, projectIds } = helpers(() => api);

  it('moves to a workspace the user is a member of and refuses one they are not', async () => {
    const person = await newPerson();
    const { receipt, credential } = await enroll(person);
    const beat = (workspaceId: string) => asRunner(credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId });

    const foreign = await beat(tenant.workspace.id);
    expect(foreign.statusCode).toBe(403);
    expect(foreign.json().error.code).toBe('forbidden');
    expect((await runnerRow(receipt.runnerId)).workspaceId).toBe(person.personal.id);

    await addMembership(db(), { workspaceId: tenant.workspace.id, userId: person.id, role: 'member' });
    const moved = await beat(tenant.workspace.id);
    expect(moved.statusCode, moved.body).toBe(200);
    expect(moved.json()).toEqual({
      runnerId: receipt.runnerId,
      workspaceId: tenant.workspace.id,
      version: String((await runnerRow(receipt.runnerId)).workVersion),
      heartbeatIntervalMs: 30_000,
      serverTime: expect.any(String),
    });
    expect((await asRunner(credential, 'GET', '/api/v1/runners/identity')).json().workspaceId).toBe(tenant.workspace.id);
    expect((await beat(person.personal.id)).json().workspaceId).toBe(person.personal.id);
  });

  it('keeps the model catalog when a heartbeat leaves models out, and stores an explicit empty list as empty', async () => {
    const person = await newPerson();
    const { receipt, credential } = await enroll(person, { capabilities: CAPABILITIES });
    const beat = (capabilities: unknown) => asRunner(credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id, capabilities, runnerVersion: '0.2.0' });

    expect((await beat({ modelSource: 'configured' })).statusCode).toBe(200);
    const kept = await runnerRow(receipt.runnerId);
    expect(kept.capabilities).toMatchObject({ models: CAPABILITIES.models, modelSource: 'configured', nativeControls: { 'claude-code': { asyncQuestions: true } } });
    expect(kept.runnerVersion).toBe('0.2.0');

    expect((await beat({ models: { 'claude-code': [] } })).statusCode).toBe(200);
    const emptied = (await runnerRow(receipt.runnerId)).capabilities as Capabilities;
    expect(emptied.models).toEqual({ 'claude-code': [] });
    expect(emptied.modelSource).toBe('configured');

    const listed = await person.browser.request('GET', '/api/v1/runners');
    expect(listed.json().runners[0].capabilities.models).toEqual({ 'claude-code': [] });
  });

  it('replaces the project list on a heartbeat that carries one, and keeps it on one that does not', async () => {
    const person = await newPerson();
    const [web, api_, docs] = [project('web'), project('api'), project('docs')];
    const { receipt, credential } = await enroll(person, { projects: [web, api_] });
    const beat = (body: Record<string, unknown>) => asRunner(credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id, ...body });
    expect((await beat({})).statusCode).toBe(200);
    expect(await projectIds(receipt.runnerId)).toEqual([web.id, api_.id].sort());
    expect((await beat({ projects: [{ ...web, name: 'website' }, docs] })).statusCode).toBe(200);
    expect(await projectIds(receipt.runnerId)).toEqual([web.id, docs.id].sort());
    const [renamed] = await db().select().from(runnerProjects).where(eq(runnerProjects.id, web.id));
    expect(renamed!.name).toBe('website');
    const twice = await beat({ projects: [web, web] });
    expect(twice.statusCode).toBe(400);
    expect(twice.json().error.details.issues).toEqual([{ field: 'projects.1.id', message: 'is listed twice' }]);
    expect((await beat({ projects: [] })).statusCode).toBe(200);
    expect(await projectIds(receipt.runnerId)).toEqual([]);
  });

  it('refuses native paths in projects, over 2,000 models for a harness and bodies over 4 MiB, in the error envelope', async () => {
    const person = await newPerson();
    const { credential } = await enroll(person);
    const beat = (body: unknown) => asRunner(credential, 'POST', '/api/v1/runners/heartbeat', body);

    for (const [bad, field] of [
      [{ ...project('x'), name: '/Users/ada/src/web' }, 'projects.0.name'],
      [{ ...project('x'), name: 'C:\\src\\web' }, 'projects.0.name'],
      [{ ...project('x'), name: '~/src/web' }, 'projects.0.name'],
      [project('x', [{ name: 'acme/web', remoteUrl: '/srv/git/web.git' }]), 'projects.0.repositories.0.remoteUrl'],
      [project('x', [{ name: '/srv/git/web' }]), 'projects.0.repositories.0.name'],
    ] as const) {
      const refused = await beat({ workspaceId: person.personal.id, projects: [bad] });
      expect(refused.statusCode, field).toBe(400);
      expect(refused.json().error).toMatchObject({ code: 'validation_error', message: 'Invalid request body' });
      expect(refused.json().error.details.issues.map((issue: { field: string }) => issue.field), field).toEqual([field]);
    }

    const models = (count: number) => Array.from({ length: count }, (_, i) => ({ id: `model-${i}`, name: `Model ${i}` }));
    const tooMany = await beat({ workspaceId: person.personal.id, capabilities: { models: { codex: models(RUNNER_LIMITS.modelsPerHarness + 1) } } });
    expect(tooMany.statusCode).toBe(400);
    expect(tooMany.json().error.details.issues).toEqual([{ field: 'capabilities.models.codex', message: expect.any(String) }]);
    expect((await beat({ workspaceId: person.personal.id, capabilities: { models: { codex: models(RUNNER_LIMITS.modelsPerHarness) } } })).statusCode).toBe(200);

    const { verifier, challenge } = newVerifier();
    const native = await enrollRequest({
      pairingCode: await pairingCode(person, challenge),
      verifier,
      credential: newCredential(),
      name: 'laptop',
      projects: [{ ...project('x'), name: '/home/ada/web' }],
    });
    expect(native.statusCode).toBe(400);
    expect(native.json().error.details.issues).toEqual([{ field: 'projects.0.name', message: 'must not be a native path' }]);

    const padding = 'x'.repeat(RUNNER_LIMITS.registrationBytes);
    const huge = await beat({ workspaceId: person.personal.id, runnerVersion: padding });
    expect(huge.statusCode).toBe(413);
    expect(huge.json().error.code).toBe('payload_too_large');
    const hugeEnroll = await enrollRequest({ pairingCode: 'ACDE-FGHK', verifier, credential: newCredential(), name: padding });
    expect(hugeEnroll.statusCode).toBe(413);
  });

  it('lists the user\'s connections with presence and projects, to the user only', async () => {
    const person = await newPerson();
    const other = await newPerson();
    const web = project('web');
    const scratch = project('scratch', []);
    const { receipt, credential } = await enroll(person, { projects: [web, scratch], capabilities: CAPABILITIES, platform: 'linux-x64' });
    const quiet = await enroll(person);
    await enroll(other);
    expect((await asRunner(credential, 'POST', '/api/v1/runners/heartbeat', { workspaceId: person.personal.id })).statusCode).toBe(200);

    const listed = await person.browser.request('GET', '/api/v1/runners');
    expect(listed.statusCode, listed.body).toBe(200);
    const { runners: list } = listed.json() as { runners: Array<Record<string, unknown>> };
    expect(list.map((runner) => runner.id).sort()).toEqual([receipt.runnerId, quiet.receipt.runnerId].sort());
    const active = list.find((runner) => runner.id === receipt.runnerId)!;
    expect(active).toMatchObject({ name: 'laptop', workspaceId: person.personal.id, revoked: false, online: true, platform: 'linux-x64', lastSeenAt: expect.any(String) });
    expect(active.projects).toEqual(
      expect.arrayContaining([
        { ...web, projectless: false },
        { ...scratch, projectless: true },
      ]),
    );
    expect(list.find((runner) => runner.id === quiet.receipt.runnerId)).toMatchObject({ online: false, lastSeenAt: null, projects: [] });

    // Presence lapses after two heartbeat intervals without a sign of life.
    await db().update(runners).set({ lastSeenAt: sql`now() - interval '61 seconds'` }).where(eq(runners.id, receipt.runnerId));
    const later = (await person.browser.request('GET', '/api/v1/runners')).json().runners.find((runner: { id: string }) => runner.id === receipt.runnerId);
    expect(later.online).toBe(false);

    expect((await tenant.request('GET', '/api/v1/runners')).json()).toEqual(USER_REQUIRED);
  });
});

describe.each(testDrivers)('the pairing page on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const { db, newPerson, enrollRequest } = helpers(() => api);
  const pageUrl = (query: Record<string, string>) => `/pair-runner?${new URLSearchParams(query)}`;
  const form = (fields: Record<string, string>) => new URLSearchParams(fields).toString();
  const pairingsOf = async (userId: string) => db().select().from(runnerPairings).where(eq(runnerPairings.userId, userId));

  it('asks a signed-out browser to sign in first, and refuses a link without a valid challenge', async () => {
    const { challenge } = newVerifier();
    const signedOut = await api.app.inject({ method: 'GET', url: pageUrl({ challenge, name: 'laptop' }) });
    expect(signedOut.statusCode).toBe(401);
    expect(signedOut.headers['content-type']).toMatch(/^text\/html/);
    expect(signedOut.body).toContain('svc admin user sign-in-link');
    expect(signedOut.body).not.toContain('<form');

    const person = await newPerson();
    for (const query of [{}, { challenge: 'short' }, { challenge, name: 'x'.repeat(101) }] as Array<Record<string, string>>) {
      const bad = await api.app.inject({ method: 'GET', url: pageUrl(query), headers: { cookie: person.browser.cookie } });
      expect(bad.statusCode, JSON.stringify(query)).toBe(400);
      expect(bad.body).toContain('This pairing link is not valid');
    }
  });

  it('shows a signed-in person a form, issues a code on its POST with the CSRF token, and the code enrolls', async () => {
    const person = await newPerson();
    const { verifier, challenge } = newVerifier();
    const name = '<script>alert("laptop")</script>';
    const shown = await api.app.inject({ method: 'GET', url: pageUrl({ challenge, name }), headers: { cookie: person.browser.cookie } });
    expect(shown.statusCode).toBe(200);
    expect(shown.headers['content-security-policy']).toContain("frame-ancestors 'none'");
    expect(shown.body).toContain('<form method="post" action="/pair-runner">');
    expect(shown.body).toContain(`name="csrfToken" value="${person.browser.csrfToken}"`);
    expect(shown.body).toContain(`name="challenge" value="${challenge}"`);
    expect(shown.body).not.toContain('<script>');
    expect(shown.body).toContain('&#60;script&#62;alert(&#34;laptop&#34;)&#60;/script&#62;');
    // Showing the form issues nothing.
    expect(await pairingsOf(person.id)).toEqual([]);

    const post = (fields: Record<string, string>, headers: Record<string, string> = {}) =>
      api.app.inject({
        method: 'POST',
        url: '/pair-runner',
        headers: { cookie: person.browser.cookie, 'content-type': 'application/x-www-form-urlencoded', origin: TEST_PUBLIC_URL, ...headers },
        payload: form(fields),
      });
    for (const [fields, headers] of [
      [{ challenge, name, csrfToken: 'x'.repeat(43) }, {}],
      [{ challenge, name }, {}],
      [{ challenge, name, csrfToken: person.browser.csrfToken }, { origin: 'https://evil.example' }],
    ] as const) {
      const refused = await post(fields, headers);
      expect(refused.statusCode).toBe(403);
      expect(refused.headers['content-type']).toMatch(/^text\/html/);
      expect(refused.body).toContain('No code was issued');
    }
    expect(await pairingsOf(person.id)).toEqual([]);
    const signedOut = await api.app.inject({
      method: 'POST',
      url: '/pair-runner',
      headers: { 'content-type': 'application/x-www-form-urlencoded' },
      payload: form({ challenge, csrfToken: person.browser.csrfToken }),
    });
    expect(signedOut.statusCode).toBe(401);

    const issued = await post({ challenge, name, csrfToken: person.browser.csrfToken });
    expect(issued.statusCode, issued.body).toBe(200);
    const code = /(?<code>[A-Z0-9]{4}-[A-Z0-9]{4})</.exec(issued.body)?.groups?.code;
    expect(code).toBeDefined();
    const [stored] = await pairingsOf(person.id);
    expect(stored).toMatchObject({ challenge, name, codeHash: hashPairingCode(normalizePairingCode(code!)!) });
    expect(issued.body).toContain(stored!.expiresAt.toISOString());

    const enrolled = await enrollRequest({ pairingCode: code, verifier, credential: newCredential(), name: 'laptop' });
    expect(enrolled.statusCode, enrolled.body).toBe(200);
    expect(enrolled.json()).toMatchObject({ userId: person.id, workspaceId: person.personal.id });
  });
});

describe.each(testDrivers)('local task targets on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));
  const { db, newPerson, enroll } = helpers(() => api);

  async function refusal(input: LocalTargetInput): Promise<{ field: string; message: string }> {
    const error = await resolveLocalTarget(db(), input).then(
      () => null,
      (thrown: unknown) => thrown,
    );
    expect(error).toBeInstanceOf(ValidationError);
    return (error as ValidationError & { details: { issues: Array<{ field: string; message: string }> } }).details.issues[0]!;
  }

  it('accepts the user\'s runner, a registered project and a model of its catalog, and refuses the rest', async () => {
    const person = await newPerson();
    const other = await newPerson();
    const web = project('web');
    const scratch = project('scratch', []);
    const capabilities: Capabilities = {
      models: { 'claude-code': [{ id: 'claude-sonnet-4-5', name: 'Sonnet' }], codex: [] },
      nativeControls: { 'claude-code': { commands: [], fullAccess: false, questions: true }, gemini: { commands: [], fullAccess: false, questions: false } },
    };
    const { receipt } = await enroll(person, { projects: [web, scratch], capabilities });
    const target = (agent: { provider: string; model: string }, overrides: Partial<LocalTargetInput> = {}): LocalTargetInput => ({
      userId: person.id,
      runnerId: receipt.runnerId,
      projectId: web.id,
      agent,
      ...overrides,
    });

    const accepted = await resolveLocalTarget(db(), target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }));
    expect(accepted.runner.id).toBe(receipt.runnerId);
    expect(accepted.project).toMatchObject({ id: web.id, name: 'web' });
    // The projectless environment is a valid target; a harness declared only in nativeControls has no catalog.
    expect((await resolveLocalTarget(db(), target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }, { projectId: scratch.id }))).project.id).toBe(scratch.id);
    expect((await resolveLocalTarget(db(), target({ provider: 'gemini', model: 'anything' }))).runner.id).toBe(receipt.runnerId);

    expect(await refusal(target({ provider: 'claude-code', model: 'claude-opus-9' }))).toEqual({ field: 'agent', message: expect.stringContaining('claude-opus-9') });
    expect(await refusal(target({ provider: 'codex', model: 'gpt-5-codex' }))).toEqual({ field: 'agent', message: expect.stringContaining('no models') });
    expect(await refusal(target({ provider: 'aider', model: 'x' }))).toEqual({ field: 'agent', message: expect.stringContaining('aider') });
    expect((await refusal(target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }, { projectId: randomUUID() }))).field).toBe('local.projectId');
    expect((await refusal(target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }, { userId: other.id }))).field).toBe('local.runnerId');
    expect((await refusal(target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }, { runnerId: randomUUID() }))).field).toBe('local.runnerId');

    expect((await person.browser.request('POST', `/api/v1/runners/${receipt.runnerId}/revoke`)).statusCode).toBe(200);
    expect(await refusal(target({ provider: 'claude-code', model: 'claude-sonnet-4-5' }))).toEqual({ field: 'local.runnerId', message: expect.stringContaining('revoked') });
  });

  it('checks nothing about the agent for a runner that registered no models (an older runner)', async () => {
    const person = await newPerson();
    const web = project('web');
    const { receipt } = await enroll(person, { projects: [web], capabilities: { nativeControls: { 'claude-code': { commands: [] } } } });
    const accepted = await resolveLocalTarget(db(), { userId: person.id, runnerId: receipt.runnerId, projectId: web.id, agent: { provider: 'codex', model: 'whatever' } });
    expect(accepted.project.id).toBe(web.id);
  });
});
