/**
 * Signed-in people and enrolled desktop runners for tests, made through the real HTTP routes: a one-time
 * sign-in link redeemed for a session, a pairing issued to that session, an enrollment with a verifier
 * and a credential the "runner" made.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import { challengeOf, generateRunnerCredential } from '../../src/domain/runners.js';
import { findOrCreateAccount, issueSignInLink } from '../../src/engine/users.js';
import type { Capabilities, ProjectRegistration } from '../../src/protocol/runner.js';
import { findPersonalWorkspace } from '../../src/store/users.js';
import type { Workspace } from '../../src/store/workspaces.js';
import { DEFAULT_AGENT, TEST_PUBLIC_URL, type TestApi } from './api.js';

type Request = (method: InjectOptions['method'], url: string, body?: unknown, headers?: Record<string, string>) => Promise<LightMyRequestResponse>;

export interface SignedIn {
  userId: string;
  email: string;
  personal: Workspace;
  cookie: string;
  csrfToken: string;
  /** Carries the session cookie, and the CSRF token on unsafe methods. */
  request: Request;
}

export async function signedInUser(api: TestApi): Promise<SignedIn> {
  const db = api.db.database.db;
  const email = `runner-owner-${randomBytes(5).toString('hex')}@example.com`;
  const { user } = await db.transaction((tx) => findOrCreateAccount(tx, { email, name: undefined, defaultAgent: DEFAULT_AGENT }));
  const link = await issueSignInLink(db, user.id, TEST_PUBLIC_URL);
  const signedIn = await api.app.inject({ method: 'POST', url: '/api/v1/auth/sign-in-link', payload: { token: link.url.slice(link.url.lastIndexOf('/') + 1) } });
  if (signedIn.statusCode !== 200) throw new Error(`sign-in failed: ${signedIn.statusCode} ${signedIn.body}`);
  const header = signedIn.headers['set-cookie'];
  const cookie = (Array.isArray(header) ? header : [String(header)]).find((line) => line.startsWith('svc_session='))!.split(';')[0]!;
  const csrfToken: string = signedIn.json().csrfToken;
  return {
    userId: user.id,
    email,
    personal: (await findPersonalWorkspace(db, user.id))!,
    cookie,
    csrfToken,
    request(method, url, body, headers = {}) {
      const unsafe = !['GET', 'HEAD', 'OPTIONS'].includes(String(method).toUpperCase());
      return api.app.inject({
        method,
        url,
        headers: { cookie, ...(unsafe ? { 'x-csrf-token': csrfToken } : {}), ...headers },
        ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }),
      });
    },
  };
}

export interface TestRunner {
  id: string;
  credential: string;
  projectId: string;
  /** Carries the runner's credential. */
  request: Request;
}

/** A project with one repository, and the capabilities of a runner that runs the fake model. */
export const TEST_CAPABILITIES: Capabilities = {
  models: { 'openai-compatible': [{ id: 'fake', name: 'Fake' }] },
  modelSource: 'discovered',
  nativeControls: { 'openai-compatible': { commands: ['permission'], fullAccess: true, questions: true, asyncQuestions: true, finishBackgroundWait: true } },
};

export async function enrolledRunner(
  api: TestApi,
  owner: SignedIn,
  options: { capabilities?: Capabilities; projects?: ProjectRegistration[] } = {},
): Promise<TestRunner> {
  const verifier = randomBytes(32).toString('base64url');
  const paired = await owner.request('POST', '/api/v1/runner-pairings', { challenge: challengeOf(verifier), name: 'laptop' });
  if (paired.statusCode !== 201) throw new Error(`pairing failed: ${paired.statusCode} ${paired.body}`);
  const credential = generateRunnerCredential();
  const projectId = randomUUID();
  const projects = options.projects ?? [{ id: projectId, name: 'web', repositories: [{ name: 'acme/web' }] }];
  const enrolled = await api.app.inject({
    method: 'POST',
    url: '/api/v1/runners/enroll',
    payload: { pairingCode: paired.json().pairingCode, verifier, credential, name: 'laptop', capabilities: options.capabilities ?? TEST_CAPABILITIES, projects },
  });
  if (enrolled.statusCode !== 200) throw new Error(`enrollment failed: ${enrolled.statusCode} ${enrolled.body}`);
  return {
    id: enrolled.json().runnerId,
    credential,
    projectId: projects[0]?.id ?? projectId,
    request: (method, url, body, headers = {}) =>
      api.app.inject({
        method,
        url,
        headers: { authorization: `Bearer ${credential}`, ...headers },
        ...(body === undefined ? {} : { payload: body as InjectOptions['payload'] }),
      }),
  };
}
