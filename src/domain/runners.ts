/**
 * Pure rules of the runner protocol: credentials and their hashes, pairing codes and the verifier's
 * challenge, and how a local run's state reads from its job.
 */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { hashSecret } from './secrets.js';
import { RUNNER_CREDENTIAL_PREFIX, type RunState } from '../protocol/runner.js';
import type { JobStatus } from '../protocol/rest.js';

const CREDENTIAL = /^service_runner_[A-Za-z0-9_-]{43,128}$/;

export function isWellFormedRunnerCredential(value: string): boolean {
  return CREDENTIAL.test(value);
}

/** A new runner credential (the runner makes its own; the server never sees one it did not receive). */
export function generateRunnerCredential(): string {
  return RUNNER_CREDENTIAL_PREFIX + randomBytes(32).toString('base64url');
}

/** The stored form of a runner credential (secrets.ts). */
export const hashRunnerCredential: (credential: string) => string = hashSecret;

/** The challenge of a verifier: base64url(SHA-256(verifier)), as the runner sends it through the setup flow. */
export function challengeOf(verifier: string): string {
  return createHash('sha256').update(verifier).digest('base64url');
}

/** Compares a verifier with a registered challenge in constant time. */
export function verifierMatches(verifier: string, challenge: string): boolean {
  const actual = Buffer.from(challengeOf(verifier));
  const expected = Buffer.from(challenge);
  return actual.length === expected.length && timingSafeEqual(actual, expected);
}

/** No look-alikes (0/O, 1/I/L, 5/S, 2/Z, 8/B): a code a person reads and types. */
const CODE_ALPHABET = 'ACDEFGHJKMNPQRTUVWXY34679';
const CODE_LENGTH = 8;

/** A pairing code, shown as `ABCD-EFGH`. */
export function generatePairingCode(): string {
  const bytes = randomBytes(CODE_LENGTH);
  let code = '';
  for (const byte of bytes) code += CODE_ALPHABET[byte % CODE_ALPHABET.length];
  return `${code.slice(0, 4)}-${code.slice(4)}`;
}

/** A typed code as stored: upper case, without dashes or spaces; null when it cannot be one. */
export function normalizePairingCode(code: string): string | null {
  const normalized = code.toUpperCase().replace(/[\s-]/g, '');
  return normalized.length === CODE_LENGTH && [...normalized].every((c) => CODE_ALPHABET.includes(c)) ? normalized : null;
}

/** The stored form of a normalized pairing code (secrets.ts). */
export const hashPairingCode: (normalized: string) => string = hashSecret;

/** How a local run's job reads to its runner. */
export function runStateOf(status: JobStatus, runnerState: string | null): RunState {
  switch (status) {
    case 'PENDING':
      return 'queued';
    case 'IN_PROGRESS':
      return runnerState === 'syncing' ? 'syncing' : 'executing';
    case 'COMPLETED':
      return 'completed';
    case 'FAILED':
      return 'failed';
    case 'CANCELLED':
      return 'cancelled';
  }
}
