/**
 * Hashing and comparing the service's random secrets: API keys, session and sign-in link tokens, runner
 * credentials and pairing codes. No one chooses them: the long ones carry 256 random bits, and a pairing
 * code lives minutes and works once with a verifier only its runner has. So one fast SHA-256 is enough to
 * keep them out of the database; passwords, which people choose, get scrypt instead (passwords.ts).
 */
import { createHash, timingSafeEqual } from 'node:crypto';

/** The stored form of a random secret: SHA-256, hex. */
export function hashSecret(secret: string): string {
  return createHash('sha256').update(secret).digest('hex');
}

/** Whether two secrets are equal, in time that does not depend on where they differ (or on their lengths). */
export function sameSecret(given: string, expected: string): boolean {
  const digest = (value: string) => createHash('sha256').update(value).digest();
  return timingSafeEqual(digest(given), digest(expected));
}
