import { randomBytes } from 'node:crypto';

const ALPHABET = 'abcdefghijklmnopqrstuvwxyz0123456789';

/** A URL-safe, human-readable slug: words of the title plus a random suffix (never UUID-shaped). */
export function makeSlug(title: string, random: Buffer = randomBytes(6)): string {
  const words = title
    .normalize('NFKD')
    .replace(/[\u0300-\u036f]/g, '')
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, '-')
    .replace(/^-+|-+$/g, '')
    .slice(0, 48)
    .replace(/-+$/, '');
  const suffix = Array.from(random, (byte) => ALPHABET[byte % ALPHABET.length]).join('');
  return words ? `${words}-${suffix}` : `task-${suffix}`;
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

export function isUuid(value: string): boolean {
  return UUID.test(value);
}

/** The title a task gets when none is given: the first line of its message, at most 80 characters. */
export function titleFromMessage(message: string): string {
  const line = message.trim().split(/\r?\n/, 1)[0]?.trim() ?? '';
  if (line.length === 0) return 'Untitled task';
  return line.length <= 80 ? line : `${line.slice(0, 79).trimEnd()}…`;
}
