import { ValidationError } from './errors.js';

/**
 * Opaque keyset cursors: base64url of `{k, s}` where `k` names the listing (a jobs cursor is refused by
 * the tasks listing) and `s` is the `seq` of the last row returned.
 */
export function encodeCursor(kind: 'tasks' | 'jobs', seq: number): string {
  return Buffer.from(JSON.stringify({ k: kind, s: seq })).toString('base64url');
}

export function decodeCursor(kind: 'tasks' | 'jobs', cursor: string | undefined): number | null {
  if (cursor === undefined) return null;
  try {
    const value = JSON.parse(Buffer.from(cursor, 'base64url').toString('utf8')) as { k?: unknown; s?: unknown };
    if (value.k === kind && Number.isSafeInteger(value.s) && (value.s as number) > 0) return value.s as number;
  } catch {
    // fall through
  }
  throw new ValidationError([{ field: 'cursor', message: 'is not a cursor this listing returned' }], 'Invalid query parameters');
}
