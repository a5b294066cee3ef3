/**
 * GET and POST /pair-runner: the browser's way to a pairing code. `svc runner pair` prints
 * `{public URL}/pair-runner?challenge=…&name=…`; a signed-in person opens it, confirms with a click (a
 * form carrying the session's CSRF token, from this origin only), and reads the code to type into the
 * terminal. A page, not an API route: it is hidden from the OpenAPI document.
 */
import { createHash, timingSafeEqual } from 'node:crypto';
import type { FastifyPluginAsync, FastifyReply, FastifyRequest } from 'fastify';
import { AppError } from '../../domain/errors.js';
import * as enrollment from '../../engine/runners/enrollment.js';
import { hashToken, isWellFormedToken } from '../../engine/users.js';
import { CreatePairingBody, RUNNER_LIMITS } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { countRequest, type RateLimits } from '../../store/rate-limit.js';
import { resolveSession, type ResolvedSession } from '../../store/sessions.js';
import { assertSameOrigin, readCookie, SESSION_COOKIE, sessionCookie, type SessionSettings } from '../auth.js';

export const PAIR_PAGE_PATH = '/pair-runner';
/** The form's fields are a challenge, a name and a token: a few hundred bytes. */
const FORM_LIMIT_BYTES = 16 * 1024;
const TTL_MINUTES = Math.round(RUNNER_LIMITS.pairingCodeTtlMs / 60_000);

export interface PairPageDeps {
  db: Db;
  settings: SessionSettings;
  /** The per-user limit of session requests: issuing a code counts as one. */
  rateLimits: RateLimits;
}

export function escapeHtml(value: string): string {
  return value.replace(/[&<>"']/g, (char) => `&#${char.charCodeAt(0)};`);
}

const STYLE = 'font-family: system-ui, sans-serif; max-width: 36rem; margin: 4rem auto; padding: 0 1rem; line-height: 1.5';

/** A whole page; `body` is HTML the caller has escaped. */
function page(title: string, body: string): string {
  return `<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>${escapeHtml(title)}</title></head>
<body style="${STYLE}">
<h1 style="font-size: 1.4rem">${escapeHtml(title)}</h1>
${body}
</body>
</html>
`;
}

function sendPage(reply: FastifyReply, status: number, title: string, body: string): FastifyReply {
  return (
    reply
      .status(status)
      // No script at all, forms only to this origin, and never inside another site's frame (a framed
      // page could trick the click that issues a code).
      .header('content-security-policy', "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
      .header('x-frame-options', 'DENY')
      .header('x-content-type-options', 'nosniff')
      .header('cache-control', 'no-store')
      .header('referrer-policy', 'no-referrer')
      .type('text/html; charset=utf-8')
      .send(page(title, body))
  );
}

const code = (text: string) => `<code>${escapeHtml(text)}</code>`;

type PairingRequest = { challenge: string; name: string | undefined };

/** The challenge and name of a query or form, or null when they are not what `svc runner pair` sends. */
function pairingRequestOf(fields: unknown): PairingRequest | null {
  const values = (fields ?? {}) as Record<string, unknown>;
  const name = typeof values.name === 'string' && values.name.trim() !== '' ? values.name : undefined;
  const parsed = CreatePairingBody.safeParse({ challenge: values.challenge, ...(name === undefined ? {} : { name }) });
  return parsed.success ? { challenge: parsed.data.challenge, name: parsed.data.name } : null;
}

function sameSecret(given: string, expected: string): boolean {
  const digest = (value: string) => createHash('sha256').update(value).digest();
  return timingSafeEqual(digest(given), digest(expected));
}

export const pairRunnerPage: FastifyPluginAsync<PairPageDeps> = async (app, { db, settings, rateLimits }) => {
  // The one form of the service: only here is a urlencoded body read (the API takes JSON only).
  app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string', bodyLimit: FORM_LIMIT_BYTES }, (_request, body, done) => {
    done(null, Object.fromEntries(new URLSearchParams(typeof body === 'string' ? body : body.toString('utf8'))));
  });

  async function sessionOf(request: FastifyRequest, reply: FastifyReply): Promise<ResolvedSession | null> {
    const token = readCookie(request.headers.cookie, SESSION_COOKIE);
    if (token === null || !isWellFormedToken(token)) return null;
    const session = await resolveSession(db, { tokenHash: hashToken(token), workspaceId: null, ttlMs: settings.ttlMs });
    if (session?.renewed) reply.header('set-cookie', sessionCookie(token, settings));
    return session;
  }

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
    const session = await sessionOf(request, reply);
    if (!session) return signInFirst(reply, pairing);
    const computer = pairing.name ? `the computer ${code(pairing.name)}` : 'a computer';
    return sendPage(
      reply,
      200,
      'Pair a computer',
      `<p>${computer} asks to run tasks for you with its own coding agents, in your personal workspace. ` +
        `Only continue if you just ran ${code('svc runner pair')} on it yourself.</p>
<form method="post" action="${PAIR_PAGE_PATH}">
<input type="hidden" name="challenge" value="${escapeHtml(pairing.challenge)}">
${pairing.name ? `<input type="hidden" name="name" value="${escapeHtml(pairing.name)}">\n` : ''}<input type="hidden" name="csrfToken" value="${escapeHtml(session.csrfToken)}">
<button type="submit" style="font-size: 1.1rem; padding: 0.5rem 1rem">Show a pairing code</button>
</form>
<p>The code works once, for ${TTL_MINUTES} minutes, and only together with the secret that stays on that computer.</p>`,
    );
  });

  app.post(PAIR_PAGE_PATH, { schema: { hide: true } }, async (request, reply) => {
    const pairing = pairingRequestOf(request.body);
    if (!pairing) return badRequest(reply);
    const session = await sessionOf(request, reply);
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
