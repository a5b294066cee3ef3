/** `npm run demo` takes a newcomer from a prompt to a verified pull request, offline, with no key. */
import { spawnSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';

describe('npm run demo', () => {
  it('runs a task to a verified pull request and merges nothing', () => {
    const result = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/demo.ts'], { encoding: 'utf8', timeout: 180_000, env: { ...process.env, OPENAI_COMPATIBLE_BASE_URL: '' } });
    expect(result.status, result.stderr).toBe(0);
    expect(result.stdout).toContain('✓ check test (npm test): passed');
    expect(result.stdout).toMatch(/⇒ pull request demo\/greeter#1 opened/);
    expect(result.stdout).toContain('Task status: IN_REVIEW');
    expect(result.stdout).toContain('| test | `npm test` | passed |');
    expect(result.stdout).toContain("+module.exports = (name) => `Hello, ${name}!`;");
  }, 200_000);
});
