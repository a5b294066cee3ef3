/**
 * Signing in and out: /api/v1/auth (JSON) and the browser's one-time link, /auth/sign-in/{token} (GET
 * shows a page, its form's POST signs in). Rules and cookie attributes: docs/api.md "Users and sessions".
 */
import { z } from 'zod';
import type { FastifyPluginAsync, FastifyReply, FastifyRequest } from 'fastify';
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { AppError } from '../../domain/errors.js';
import { ChangePasswordBody, SessionResponse, SignInBody, SignInLinkBody, SignInResponse } from '../../protocol/auth.js';
import * as users from '../../engine/users.js';
import type { Db } from '../../store/db.js';
import { assertSameOrigin, clearedSessionCookie, requireUser, sessionCookie, sessionTokenOf, USER_REQUIRED, type SessionSettings } from '../auth.js';
import { refuseNulBytes } from '../nul.js';
import { acceptForms, escapeHtml, hiddenField, sendPage } from '../pages.js';
import { describedErrorResponses } from './responses.js';

export interface AuthDeps {
  db: Db;
  settings: SessionSettings;
}

const TAG = ['auth'];
/** The operations whose success sets the session cookie (the OpenAPI document lists `Set-Cookie` on them). */
export const SIGN_IN_OPERATIONS = ['signIn', 'signInWithLink'] as const;

function signInOptions(request: FastifyRequest, settings: SessionSettings): users.SignInOptions {
  return {
    ttlMs: settings.ttlMs,
    userAgent: request.headers['user-agent'] ?? null,
    replacedToken: sessionTokenOf(request, settings),
    ip: request.ip,
  };
}

function answerGrant(reply: FastifyReply, grant: users.SessionGrant, settings: SessionSettings) {
  return reply
    .header('set-cookie', sessionCookie(grant.token, settings))
    .header('cache-control', 'no-store')
    .send({ user: users.presentUser(grant.user), csrfToken: grant.csrfToken, expiresAt: grant.expiresAt.toISOString() });
}

const SIGN_IN_ERRORS = {
  403: '`forbidden`: a browser request from a page of another origin (`Origin` is not the public URL\'s)',
  429:
    '`rate_limited` "Too many failed sign-in attempts for this email; try again later" (10 failures of one email lock it for 15 ' +
    'minutes, each further failure doubles that) or "… for your network; try again later" (100 failures from one client network); ' +
    '`Retry-After` says when to try again, `details` is `{ retryAfterSeconds }`',
};

/** The routes that sign in: they need no credential, only JSON bodies like every other route. */
export const signInRoutes: FastifyPluginAsyncZod<AuthDeps> = async (app, { db, settings }) => {
  app.addHook('onRequest', async (request) => assertSameOrigin(request, settings.publicUrl));
  app.addHook('preValidation', refuseNulBytes);

  app.post(
    '/auth/sign-in',
    {
      schema: {
        tags: TAG,
        operationId: 'signIn',
        summary: 'Sign in with email and password; sets the session cookie',
        security: [],
        body: SignInBody,
        response: {
          200: SignInResponse,
          ...describedErrorResponses(
            { ...SIGN_IN_ERRORS, 401: '`unauthorized` "Invalid email or password": the same answer for an unknown email, an account without a password and a wrong password' },
            400,
            403,
            413,
            415,
          ),
        },
      },
    },
    async (request, reply) => answerGrant(reply, await users.signInWithPassword(db, request.body, signInOptions(request, settings)), settings),
  );

  app.post(
    '/auth/sign-in-link',
    {
      schema: {
        tags: TAG,
        operationId: 'signInWithLink',
        summary: 'Redeem a one-time sign-in link (for clients that are not browsers); sets the session cookie',
        security: [],
        body: SignInLinkBody,
        response: {
          200: SignInResponse,
          ...describedErrorResponses(
            {
              ...SIGN_IN_ERRORS,
              401: '`unauthorized` "Invalid, used or expired sign-in link": links work once, within 24 hours',
              429: '`rate_limited`: not answered by this route today (a link carries 256 random bits, so guessing needs no throttle)',
            },
            400,
            403,
            413,
            415,
          ),
        },
      },
    },
    async (request, reply) => {
      const outcome = await users.signInWithLink(db, request.body.token, signInOptions(request, settings));
      if (outcome.kind !== 'signed-in') throw new AppError('unauthorized', 'Invalid, used or expired sign-in link');
      return answerGrant(reply, outcome.grant, settings);
    },
  );
};

const SESSION_ONLY = {
  security: [{ sessionCookie: [] }],
};
const SESSION_ONLY_403 =
  '`forbidden`: "' + USER_REQUIRED + '" for an API key; for the session, a missing or wrong `X-CSRF-Token`, another `Origin` ' +
  'or an `X-Svc-Workspace` the user is not a member of';

/** The routes of a signed-in user's own session; behind the authentication hook, refused to API keys. */
export const sessionRoutes: FastifyPluginAsyncZod<AuthDeps> = async (app, { db, settings }) => {
  app.addHook('preValidation', refuseNulBytes);

  app.get(
    '/auth/session',
    {
      schema: {
        tags: TAG,
        operationId: 'getSession',
        summary: 'The signed-in user, their workspaces and the session (CSRF token, expiry)',
        ...SESSION_ONLY,
        response: { 200: SessionResponse, ...describedErrorResponses({ 403: SESSION_ONLY_403 }, 403) },
      },
    },
    async (request, reply) => {
      const session = requireUser(request);
      const described = await users.describeSession(db, session);
      reply.header('cache-control', 'no-store');
      return { ...described, expiresAt: described.expiresAt.toISOString() };
    },
  );

  app.post(
    '/auth/sign-out',
    {
      schema: {
        tags: TAG,
        operationId: 'signOut',
        summary: 'End this session; its cookie stops working',
        ...SESSION_ONLY,
        response: { 204: z.null().describe('Signed out; `Set-Cookie` clears the session cookie'), ...describedErrorResponses({ 403: SESSION_ONLY_403 }, 403) },
      },
    },
    async (request, reply) => {
      const session = requireUser(request);
      await users.signOut(db, session.sessionId);
      // The authentication hook may have renewed the cookie on the way in; clearing it is the last word.
      reply.removeHeader('set-cookie');
      return reply.header('set-cookie', clearedSessionCookie(settings)).status(204).send(null);
    },
  );

  app.post(
    '/auth/password',
    {
      schema: {
        tags: TAG,
        operationId: 'changePassword',
        summary: 'Set or change the password (the current one is required once one is set); signs out every other session and ends unused sign-in links',
        ...SESSION_ONLY,
        body: ChangePasswordBody,
        response: {
          204: z.null().describe('The password is set; every other session of the user is signed out, and unused sign-in links stop working'),
          ...describedErrorResponses(
            {
              403: `${SESSION_ONLY_403}; "The current password is wrong"`,
              429:
                '`rate_limited`: over the rate limit of this user, or "Too many failed sign-in attempts for this email; try again later" ' +
                'when wrong current passwords and failed sign-ins of the email have locked it (or "… for your network", as for sign-in); ' +
                '`Retry-After` says when to try again',
            },
            400,
            403,
          ),
        },
      },
    },
    async (request, reply) => {
      const session = requireUser(request);
      await users.changePassword(db, session, request.body, { ip: request.ip });
      return reply.status(204).send(null);
    },
  );
};

const LINK_PAGES = {
  unknown: { status: 400, title: 'This sign-in link is not valid', text: 'Check that the whole link was copied, or ask for a new one.' },
  used: { status: 410, title: 'This sign-in link has already been used', text: 'Each link works once. Ask for a new one, or sign in with your password.' },
  expired: {
    status: 410,
    title: 'This sign-in link has expired',
    text: 'Links work for 24 hours; a newer link, or a new password, ends older ones. Ask for a new one, or sign in with your password.',
  },
} as const;

/** Where to go after signing in: a path on this origin, never another site (an open redirect). */
export function redirectTarget(next: unknown, publicUrl: string): string {
  if (typeof next !== 'string' || !next.startsWith('/') || next.startsWith('//') || /[\\\u0000-\u001f\u007f]/.test(next)) return '/';
  const origin = new URL(publicUrl).origin;
  try {
    const url = new URL(next, origin);
    return url.origin === origin ? `${url.pathname}${url.search}${url.hash}` : '/';
  } catch {
    return '/';
  }
}

/**
 * /auth/sign-in/{token}: the link a person opens. GET only shows a page (mail scanners and link
 * previews open links on their own, and must not use them up or sign anyone in): the account it is for
 * and a button. The button's POST, from a page of this origin, signs in and sends the person on (303) to
 * `/` or to a `next` path of this origin. A link that does not work answers a small page saying why.
 */
export const browserSignInRoute: FastifyPluginAsync<AuthDeps> = async (app, { db, settings }) => {
  acceptForms(app);
  const path = `${users.SIGN_IN_PATH}/:token`;
  const linkFailed = (reply: FastifyReply, kind: keyof typeof LINK_PAGES) => {
    const page = LINK_PAGES[kind];
    return sendPage(reply, page.status, page.title, `<p>${escapeHtml(page.text)}</p>`);
  };

  app.get(path, { schema: { hide: true } }, async (request, reply) => {
    const { token } = request.params as { token: string };
    const link = await users.previewSignInLink(db, token);
    if (link.kind !== 'live') return linkFailed(reply, link.kind);
    const next = redirectTarget((request.query as Record<string, unknown>).next, settings.publicUrl);
    return sendPage(
      reply,
      200,
      'Sign in',
      `<p>This one-time link signs you in as <strong>${escapeHtml(link.email)}</strong>.</p>
<form method="post" action="${escapeHtml(`${users.SIGN_IN_PATH}/${encodeURIComponent(token)}`)}">
${next === '/' ? '' : `${hiddenField('next', next)}\n`}<button type="submit" style="font-size: 1.1rem; padding: 0.5rem 1rem">Sign in</button>
</form>
<p>The link works once, within 24 hours of when it was made.</p>`,
    );
  });

  app.post(path, { schema: { hide: true } }, async (request, reply) => {
    const { token } = request.params as { token: string };
    const origin = request.headers.origin;
    // A page of another site could otherwise sign this browser in to an account of its choosing.
    if (origin !== undefined && origin !== new URL(settings.publicUrl).origin) {
      return sendPage(reply, 403, 'This sign-in did not come from this service', '<p>Nobody was signed in. Open the sign-in link again and use its button.</p>');
    }
    const outcome = await users.signInWithLink(db, token, signInOptions(request, settings));
    if (outcome.kind !== 'signed-in') return linkFailed(reply, outcome.kind);
    const form = (request.body ?? {}) as Record<string, unknown>;
    return reply
      .header('set-cookie', sessionCookie(outcome.grant.token, settings))
      .header('cache-control', 'no-store')
      .header('referrer-policy', 'no-referrer')
      .redirect(redirectTarget(form.next, settings.publicUrl), 303);
  });
};
