import type { Effort, RoutingMode } from '../protocol/rest.js';

export const DEFAULT_ROUTING_NAME = 'default';

/** What a new workspace's `default` config says (SPEC.md "Routing configs" rule 1). */
export const DEFAULT_ROUTING: { mode: RoutingMode; effort: Effort } = { mode: 'agent', effort: 'medium' };

/** Trigger keywords: lowercase letters, digits, `-` and `_`, starting with a letter or digit. */
export const TRIGGER_NAME = /^[a-z0-9][a-z0-9_-]{0,39}$/;

export function routingNameError(name: string): string | null {
  if (name === DEFAULT_ROUTING_NAME) return null;
  return TRIGGER_NAME.test(name)
    ? null
    : 'must be 1-40 lowercase letters, digits, "-" or "_", starting with a letter or digit';
}

/**
 * Splits a leading `/keyword` off a message. Returns the keyword (lowercased) and the rest of the text
 * with the trigger and the whitespace after it stripped; `trigger` is null when the message does not
 * start with a well-formed trigger. Whether the keyword names a config is the caller's question: an
 * unknown keyword leaves the message as it was (it may be a path such as `/usr/bin`).
 */
export function splitTrigger(message: string): { trigger: string | null; rest: string } {
  const match = /^\s*\/([A-Za-z0-9][A-Za-z0-9_-]{0,39})(?=\s|$)\s*/.exec(message);
  if (!match?.[1]) return { trigger: null, rest: message };
  return { trigger: match[1].toLowerCase(), rest: message.slice(match[0].length) };
}
