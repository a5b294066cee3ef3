import { describe, expect, it } from 'vitest';
import { CURRENT_PARAMETERS, dummyHash, hashPassword, needsRehash, parseHash, passwordProblem, verifyPassword } from './passwords.js';

/** Cheap parameters where a test only needs the format, not the cost. */
const FAST = { logN: 10, r: 8, p: 1 };

describe('password hashes', () => {
  it('verify the password they were made from and no other', async () => {
    const stored = await hashPassword('correct horse battery staple');
    expect(await verifyPassword('correct horse battery staple', stored)).toBe(true);
    expect(await verifyPassword('correct horse battery stapl', stored)).toBe(false);
    expect(await verifyPassword('Correct horse battery staple', stored)).toBe(false);
    expect(await verifyPassword('', stored)).toBe(false);
  });

  it('carry the current parameters and a 16-byte salt, so that two hashes of one password differ', async () => {
    const stored = await hashPassword('correct horse battery staple');
    expect(stored).toMatch(/^\$scrypt\$ln=15,r=8,p=1\$[A-Za-z0-9+/]{22}\$[A-Za-z0-9+/]{43}$/);
    expect(parseHash(stored)).toMatchObject({ ...CURRENT_PARAMETERS });
    expect(parseHash(stored)!.salt).toHaveLength(16);
    expect(parseHash(stored)!.key).toHaveLength(32);
    expect(CURRENT_PARAMETERS.logN).toBeGreaterThanOrEqual(15);
    expect(await hashPassword('correct horse battery staple')).not.toBe(stored);
  });

  it('are verified with the parameters written in them, and older ones ask to be rehashed', async () => {
    const weak = await hashPassword('an older password hash', FAST);
    expect(parseHash(weak)).toMatchObject(FAST);
    expect(await verifyPassword('an older password hash', weak)).toBe(true);
    expect(needsRehash(weak)).toBe(true);
    expect(needsRehash(await hashPassword('a current password hash'))).toBe(false);
  });

  it('refuse a tampered or foreign string instead of trusting it', async () => {
    const stored = await hashPassword('tamper with me please', FAST);
    const [, , params, salt, key] = stored.split('$') as [string, string, string, string, string];
    const flip = (text: string) => `${text.slice(0, 5)}${text[5] === 'A' ? 'B' : 'A'}${text.slice(6)}`;
    const tampered = [
      `$scrypt$${params}$${salt}$${flip(key)}`,
      `$scrypt$${params}$${flip(salt)}$${key}`,
      `$scrypt$ln=11,r=8,p=1$${salt}$${key}`,
    ];
    for (const text of tampered) expect(await verifyPassword('tamper with me please', text), text).toBe(false);
    // Strings that ask for absurd work, or are not hashes at all, never reach scrypt.
    for (const text of [`$scrypt$ln=40,r=8,p=1$${salt}$${key}`, `$scrypt$ln=15,r=999,p=1$${salt}$${key}`, 'tamper with me please', '', `$argon2id$v=19$${salt}$${key}`]) {
      expect(parseHash(text), text).toBeNull();
      expect(await verifyPassword('tamper with me please', text), text).toBe(false);
    }
  });

  it('treat the same text composed or decomposed as one password', async () => {
    const stored = await hashPassword('caf\u00e9 au lait, s\u2019il vous pla\u00eet', FAST);
    expect(await verifyPassword('cafe\u0301 au lait, s\u2019il vous pla\u00eet', stored)).toBe(true);
  });

  it('have a dummy that nothing verifies against', async () => {
    const dummy = await dummyHash();
    expect(parseHash(dummy)).toMatchObject(CURRENT_PARAMETERS);
    expect(await dummyHash()).toBe(dummy);
    expect(await verifyPassword('', dummy)).toBe(false);
  });
});

describe('passwordProblem', () => {
  it('takes 12 to 1,024 characters, counted as code points', () => {
    expect(passwordProblem('a'.repeat(11))).toMatch(/at least 12/);
    expect(passwordProblem('a'.repeat(12))).toBeNull();
    expect(passwordProblem('a'.repeat(1024))).toBeNull();
    expect(passwordProblem('a'.repeat(1025))).toMatch(/at most 1024/);
    // Six emoji are twelve UTF-16 units but six characters.
    expect(passwordProblem('\u{1F511}'.repeat(6))).toMatch(/at least 12/);
    expect(passwordProblem('\u{1F511}'.repeat(12))).toBeNull();
  });
});
