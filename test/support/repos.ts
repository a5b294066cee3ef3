/** Sample git repositories for end-to-end tests: a tiny package with a test that checks its greeting. */
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export function gitIn(dir: string, ...args: string[]): string {
  return execFileSync('git', args, {
    cwd: dir,
    encoding: 'utf8',
    env: { ...process.env, GIT_AUTHOR_NAME: 't', GIT_AUTHOR_EMAIL: 't@t', GIT_COMMITTER_NAME: 't', GIT_COMMITTER_EMAIL: 't@t', GIT_CONFIG_GLOBAL: '/dev/null' },
  });
}

/**
 * A repository whose `npm test` passes when greeting.txt holds `expected`; it starts out holding
 * `initial`, so a test decides whether its check passes before the agent works.
 */
export function sampleRepository(name: string, options: { initial?: string; expected?: string } = {}): string {
  const dir = join(mkdtempSync(join(tmpdir(), 'svc-sample-')), name);
  mkdirSync(dir);
  const expected = options.expected ?? 'hello';
  writeFileSync(join(dir, 'greeting.txt'), `${options.initial ?? 'hi'}\n`);
  writeFileSync(
    join(dir, 'package.json'),
    `${JSON.stringify({ name, version: '1.0.0', private: true, scripts: { test: 'node test.js' } }, null, 2)}\n`,
  );
  writeFileSync(
    join(dir, 'test.js'),
    `const text = require('fs').readFileSync('greeting.txt', 'utf8').trim();\n` +
      `if (text !== ${JSON.stringify(expected)}) { console.error('expected ${expected}, got ' + text); process.exit(1); }\n` +
      `console.log('greeting ok');\n`,
  );
  gitIn(dir, 'init', '--quiet', '--initial-branch=main');
  gitIn(dir, 'add', '-A');
  gitIn(dir, 'commit', '--quiet', '-m', 'initial');
  return dir;
}
