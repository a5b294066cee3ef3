/**
 * GET and POST /pair-runner: the browser's way to a pairing code. `svc runner pair` prints
 * `{public URL}/pair-runner?challenge=…&name=…`; a signed-in person opens it, confirms with a click (a
 * form carrying the session's CSRF token, from this origin only), and reads the code to type into the
 * terminal. A page, not an API route: it is hidden from the OpenAPI document.
 */
import type { FastifyPluginAsync, FastifyReply } from 'fastify';
import { AppError } from '../../domain/errors.js';
import { sameSecret } from '../../domain/secrets.js';
import * as enrollment from '../../engine/runners/enrollment.js';
import { CreatePairingBody, RUNNER_LIMITS } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { countRequest, type RateLimits } from '../../store/rate-limit.js';
import { findUser } from '../../store/users.js';
import { assertSameOrigin, requestSession, type SessionSettings } from '../auth.js';
import { acceptForms, code, escapeHtml, hiddenField, sendPage } from '../pages.js';

export const PAIR_PAGE_PATH = '/pair-runner';
const TTL_MINUTES = Math.round(RUNNER_LIMITS.pairingCodeTtlMs / 60_000);

export interface PairPageDeps {
  db: Db;
  settings: SessionSettings;
  /** The per-user limit of session requests: issuing a code counts as one. */
  rateLimits: RateLimits;
}

type PairingRequest = { challenge: string; name: string | undefined };

/** The challenge and name of a query or form, or null when they are not what `svc runner pair` sends. */
function pairingRequestOf(fields: unknown): PairingRequest | null {
  const values = (fields ?? {}) as Record<string, unknown>;
  const name = typeof values.name === 'string' && values.name.trim() !== '' ? values.name : undefined;
  const parsed = CreatePairingBody.safeParse({ challenge: values.challenge, ...(name === undefined ? {} : { name }) });
  return parsed.success ? { challenge: parsed.data.challenge, name: parsed.data.name } : null;
}

export const pairRunnerPage: FastifyPluginAsync<PairPageDeps> = async (app, { db, settings, rateLimits }) => {
  acceptForms(app);

  const badRequest = (reply: FastifyReply) =>
    sendPage(
      reply,
      400,
      'This pairing link is not valid',
      `<p>It needs the <code>challenge</code> that ${code('svc runner pair')} printed (43 characters) and at most a 100-character name. ` +
        `Copy the whole link from the terminal, or run ${code('svc runner pair')} again.</p>`,
    );

  function signInFirst(reply: FastifyReply, request: PairingRequest): FastifyReply {
    const back = `${PAIR_PAGE_PATH}?${new URLSearchParams({ challenge: request.challenge, ...(request.name ? { name: request.name } : {}) })}`;
    return sendPage(
      reply,
      401,
      'Sign in to pair this computer',
      `<p>Pairing a computer needs you to be signed in to this service in this browser.</p>
<p>Ask the operator for a one-time sign-in link (${code('svc admin user sign-in-link --email you@example.com')} prints one), ` +
        `open it, then open this page again. Adding ${code(`?next=${encodeURIComponent(back)}`)} to the sign-in link brings you back here by itself.</p>`,
    );
  }

  app.get(PAIR_PAGE_PATH, { schema: { hide: true } }, async (request, reply) => {
    const pairing = pairingRequestOf(request.query);
    if (!pairing) return badRequest(reply);
    const session = await requestSession(db, settings, request, reply, null);
    const user = session && (await findUser(db, session.userId));
    if (!session || !user) return signInFirst(reply, pairing);
    const computer = pairing.name ? `the computer ${code(pairing.name)}` : 'a computer';
    return sendPage(
      reply,
      200,
      'Pair a computer',
      `<p>Signed in as <strong>${escapeHtml(user.email)}</strong>. If that is not you, sign out of this service in this browser first.</p>
<p>${computer} asks to run tasks for you with its own coding agents, in your personal workspace. ` +
        `Only continue if you just ran ${code('svc runner pair')} on it yourself.</p>
<form method="post" action="${PAIR_PAGE_PATH}">
${hiddenField('challenge', pairing.challenge)}
${pairing.name ? `${hiddenField('name', pairing.name)}\n` : ''}${hiddenField('csrfToken', session.csrfToken)}
<button type="submit" style="font-size: 1.1rem; padding: 0.5rem 1rem">Show a pairing code</button>
</form>
<p>The code works once, for ${TTL_MINUTES} minutes, and only together with the secret that stays on that computer.</p>`,
    );
  });

  app.post(PAIR_PAGE_PATH, { schema: { hide: true } }, async (request, reply) => {
    const pairing = pairingRequestOf(request.body);
    if (!pairing) return badRequest(reply);
    const session = await requestSession(db, settings, request, reply, null);
    if (!session) return signInFirst(reply, pairing);
    const form = request.body as Record<string, unknown>;
    const csrf = typeof form.csrfToken === 'string' ? form.csrfToken : '';
    let sameOrigin = true;
    try {
      assertSameOrigin(request, settings.publicUrl);
    } catch {
      sameOrigin = false;
    }
    if (!sameOrigin || !sameSecret(csrf, session.csrfToken)) {
      return sendPage(
        reply,
        403,
        'This request did not come from this page',
        '<p>No code was issued. Open the pairing link again and use its button.</p>',
      );
    }
    const counted = await countRequest(db, session.userId, rateLimits);
    if (counted.kind === 'limited') {
      reply.header('retry-after', String(counted.retryAfterSeconds));
      return sendPage(reply, 429, 'Too many requests', `<p>Try again in ${counted.retryAfterSeconds} seconds.</p>`);
    }
    let issued: { pairingCode: string; expiresAt: Date };
    try {
      issued = await enrollment.createPairing(db, { userId: session.userId, challenge: pairing.challenge, name: pairing.name });
    } catch (error) {
      if (error instanceof AppError && error.status < 500) return sendPage(reply, error.status, 'No code was issued', `<p>${escapeHtml(error.message)}</p>`);
      throw error;
    }
    const until = issued.expiresAt.toISOString();
    return sendPage(
      reply,
      200,
      'Your pairing code',
      `<p style="font-size: 3rem; font-family: ui-monospace, monospace; letter-spacing: 0.1em; margin: 1.5rem 0">${escapeHtml(issued.pairingCode)}</p>
<p>Type it into the terminal where ${code('svc runner pair')} waits. It works once, until <time datetime="${escapeHtml(until)}">${escapeHtml(
        until.replace('T', ' ').replace(/\.\d+Z$/, ' UTC'),
      )}</time> (${TTL_MINUTES} minutes).</p>`,
    );
  });
};
