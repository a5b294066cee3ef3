/**
 * The few HTML pages the service answers itself (opening a sign-in link, pairing a computer): one
 * layout, escaped text, no script, forms to this origin only, and the one form body the service reads.
 */
import type { FastifyInstance, FastifyReply } from 'fastify';

/** The form's fields are a few tokens and names: a few hundred bytes. */
const FORM_LIMIT_BYTES = 16 * 1024;

export function escapeHtml(value: string): string {
  return value.replace(/[&<>"']/g, (char) => `&#${char.charCodeAt(0)};`);
}

export const code = (text: string) => `<code>${escapeHtml(text)}</code>`;

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

export function sendPage(reply: FastifyReply, status: number, title: string, body: string): FastifyReply {
  return (
    reply
      .status(status)
      // No script at all, forms only to this origin, and never inside another site's frame (a framed
      // page could trick the click that signs in or issues a code).
      .header('content-security-policy', "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
      .header('x-frame-options', 'DENY')
      .header('x-content-type-options', 'nosniff')
      .header('cache-control', 'no-store')
      // Not no-referrer: under it a browser sends `Origin: null` with the page's own form, and the
      // origin check would refuse it. same-origin keeps the URL (and a token in it) from other sites.
      .header('referrer-policy', 'same-origin')
      .type('text/html; charset=utf-8')
      .send(page(title, body))
  );
}

/** A hidden form field. */
export const hiddenField = (name: string, value: string) => `<input type="hidden" name="${escapeHtml(name)}" value="${escapeHtml(value)}">`;

/** Lets the plugin's routes read urlencoded form bodies (the API itself takes JSON only). */
export function acceptForms(app: FastifyInstance): void {
  app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string', bodyLimit: FORM_LIMIT_BYTES }, (_request, body, done) => {
    done(null, Object.fromEntries(new URLSearchParams(typeof body === 'string' ? body : body.toString('utf8'))));
  });
}
