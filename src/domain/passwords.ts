/**
 * Password hashing with scrypt (memory-hard). A stored hash is a PHC-style string that carries its own
 * parameters, `$scrypt$ln=15,r=8,p=1$<salt>$<hash>` (base64 without padding), so the cost can be raised
 * later: old hashes still verify, and `needsRehash` says when to store a fresh one.
 */
import { randomBytes, scrypt, timingSafeEqual, type ScryptOptions } from 'node:crypto';

export const PASSWORD_MIN_LENGTH = 12;
export const PASSWORD_MAX_LENGTH = 1024;

/** The parameters new hashes get: N = 2^15, r = 8, p = 1 (32 MiB and tens of milliseconds per hash). */
export const CURRENT_PARAMETERS: ScryptParameters = { logN: 15, r: 8, p: 1 };

const SALT_BYTES = 16;
const KEY_BYTES = 32;
/**
 * Bounds on what a stored string may ask for, so that a tampered row cannot make one verification
 * take the process's memory or minutes of CPU.
 */
const MAX_LOG_N = 20;
const MAX_R = 32;
const MAX_P = 16;
const MAX_MEMORY_BYTES = 1024 * 1024 * 1024;

export interface ScryptParameters {
  logN: number;
  r: number;
  p: number;
}

export interface ParsedHash extends ScryptParameters {
  salt: Buffer;
  key: Buffer;
}

const FORMAT = /^\$scrypt\$ln=(\d{1,2}),r=(\d{1,3}),p=(\d{1,3})\$([A-Za-z0-9+/]{16,})\$([A-Za-z0-9+/]{16,})$/;

/** What is wrong with a new password, or null: 12 to 1,024 characters (code points, after NFC). */
export function passwordProblem(password: string): string | null {
  const length = [...password.normalize('NFC')].length;
  if (length < PASSWORD_MIN_LENGTH) return `must be at least ${PASSWORD_MIN_LENGTH} characters`;
  if (length > PASSWORD_MAX_LENGTH) return `must be at most ${PASSWORD_MAX_LENGTH} characters`;
  return null;
}

function derive(password: string, salt: Buffer, parameters: ScryptParameters, length: number): Promise<Buffer> {
  const N = 2 ** parameters.logN;
  const memory = 128 * N * parameters.r * parameters.p;
  const options: ScryptOptions = { N, r: parameters.r, p: parameters.p, maxmem: memory + 64 * 1024 * 1024 };
  // The same text typed on different systems can arrive composed or decomposed; NFC makes them one.
  const input = Buffer.from(password.normalize('NFC'), 'utf8');
  return new Promise((resolve, reject) => {
    scrypt(input, salt, length, options, (error, key) => (error ? reject(error) : resolve(key)));
  });
}

const b64 = (bytes: Buffer) => bytes.toString('base64').replace(/=+$/, '');

export async function hashPassword(password: string, parameters: ScryptParameters = CURRENT_PARAMETERS): Promise<string> {
  const salt = randomBytes(SALT_BYTES);
  const key = await derive(password, salt, parameters, KEY_BYTES);
  return `$scrypt$ln=${parameters.logN},r=${parameters.r},p=${parameters.p}$${b64(salt)}$${b64(key)}`;
}

/** The parameters, salt and key of a stored hash; null when it is not one this module wrote or could verify. */
export function parseHash(stored: string): ParsedHash | null {
  const match = FORMAT.exec(stored);
  if (!match) return null;
  const [logN, r, p] = [Number(match[1]), Number(match[2]), Number(match[3])];
  if (logN < 1 || logN > MAX_LOG_N || r < 1 || r > MAX_R || p < 1 || p > MAX_P) return null;
  if (128 * 2 ** logN * r * p > MAX_MEMORY_BYTES) return null;
  const parsed = { logN, r, p, salt: Buffer.from(match[4]!, 'base64'), key: Buffer.from(match[5]!, 'base64') };
  if (parsed.salt.length < SALT_BYTES || parsed.key.length < 16) return null;
  return parsed;
}

/** Whether `password` matches `stored`; false for a stored string that cannot be parsed. */
export async function verifyPassword(password: string, stored: string): Promise<boolean> {
  const parsed = parseHash(stored);
  if (!parsed) return false;
  const key = await derive(password, parsed.salt, parsed, parsed.key.length);
  return timingSafeEqual(key, parsed.key);
}

/** Whether a verified hash was made with weaker parameters than new ones get. */
export function needsRehash(stored: string, parameters: ScryptParameters = CURRENT_PARAMETERS): boolean {
  const parsed = parseHash(stored);
  if (!parsed) return true;
  return (
    parsed.logN < parameters.logN ||
    parsed.r < parameters.r ||
    parsed.p < parameters.p ||
    parsed.salt.length < SALT_BYTES ||
    parsed.key.length < KEY_BYTES
  );
}

let dummy: Promise<string> | null = null;

/**
 * A hash of nothing anyone knows, at the current parameters: a sign-in for an unknown email (or an
 * account without a password) is verified against it, so it takes as long as a real one.
 */
export function dummyHash(): Promise<string> {
  dummy ??= hashPassword(randomBytes(32).toString('base64'));
  return dummy;
}
