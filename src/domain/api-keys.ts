import { randomBytes } from 'node:crypto';
import { hashSecret } from './secrets.js';

export const API_KEY_PREFIX = 'service_';
/** 32 random bytes as base64url: 43 URL-safe characters after the prefix. */
const RANDOM_BYTES = 32;
const KEY_SHAPE = /^service_[A-Za-z0-9_-]{32,128}$/;

export function generateApiKey(): string {
  return API_KEY_PREFIX + randomBytes(RANDOM_BYTES).toString('base64url');
}

/** The stored form of a key (secrets.ts): keys carry 256 random bits, so a fast hash is enough. */
export const hashApiKey: (key: string) => string = hashSecret;

export function isWellFormedApiKey(value: string): boolean {
  return KEY_SHAPE.test(value);
}

/** The part of a key shown in listings: the prefix and six characters. */
export function displayPrefix(key: string): string {
  return key.slice(0, API_KEY_PREFIX.length + 6);
}

/** Parses `30m`, `1h`, `7d`, `2w` or `1y` into milliseconds; null when malformed. */
export function parseDuration(value: string): number | null {
  const match = /^(\d{1,6})\s*(s|m|h|d|w|y)$/.exec(value.trim());
  if (!match?.[1] || !match[2]) return null;
  const amount = Number(match[1]);
  if (amount <= 0) return null;
  const unit = { s: 1_000, m: 60_000, h: 3_600_000, d: 86_400_000, w: 604_800_000, y: 31_536_000_000 }[match[2] as 's'];
  return amount * unit;
}
