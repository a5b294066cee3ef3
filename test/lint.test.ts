/** The import-direction rules of ARCHITECTURE.md (.dependency-cruiser.cjs) fire where they should and nowhere else. */
import { execFileSync } from 'node:child_process';
import { rmSync, writeFileSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

const PROBES: Array<[path: string, code: string, rule: string | null]> = [
  ['src/domain/zz-probe.ts', "export { tasks } from '../store/schema.js';\n", 'domain-is-pure'],
  ['src/protocol/zz-probe.ts', "export { AppError } from '../domain/errors.js';\n", 'protocol-is-zod-only'],
  ['src/store/zz-probe.ts', "export { createTask } from '../engine/tasks.js';\n", 'store-sandbox-codehost-below-engine'],
  ['src/engine/zz-probe.ts', "export { buildServer } from '../server/app.js';\n", 'engine-below-server'],
  ['src/server/zz-probe.ts', "export { startService } from '../main.js';\n", 'server-below-main'],
  ['src/cli/zz-probe.ts', "export { startService } from '../main.js';\n", 'only-server-and-admin-commands-reach-main'],
  ['src/platform/zz-probe.ts', "export { tasks } from '../store/schema.js';\n", 'platform-is-generic'],
  ['src/runner/zz-probe.ts', "export { acquireLockFile } from '../platform/lock-file.js';\n", null],
  ['src/store/zz-probe2.ts', "export { acquireLockFile } from '../platform/lock-file.js';\n", null],
  ['src/domain/zz-probe2.ts', "export { acquireLockFile } from '../platform/lock-file.js';\n", 'domain-is-pure'],
  ['src/cli/zz-probe2.ts', "export { listTasks } from '../store/tasks.js';\n", 'clients-speak-http'],
  ['src/server/zz-probe2.ts', "export { createTask } from '../engine/tasks.js';\n", null],
  ['src/engine/zz-probe2.ts', "export { listTasks } from '../store/tasks.js';\n", null],
  ['src/cli/zz-probe3.ts', "export { Task } from '../protocol/rest.js';\n", null],
];

interface Violation {
  from: string;
  to: string;
  rule: { name: string };
}

let violations: Violation[] = [];

describe('import direction', () => {
  beforeAll(() => {
    for (const [path, code] of PROBES) writeFileSync(path, code);
    let output: string;
    try {
      output = execFileSync(process.execPath, ['node_modules/dependency-cruiser/bin/dependency-cruise.mjs', 'src', '--config', '.dependency-cruiser.cjs', '--output-type', 'json'], {
        encoding: 'utf8',
        maxBuffer: 64 * 1024 * 1024,
      });
    } catch (error) {
      // It exits non-zero when it finds violations, which the probes make it do.
      output = (error as { stdout: string }).stdout;
    }
    violations = (JSON.parse(output) as { summary: { violations: Violation[] } }).summary.violations;
  }, 60_000);
  afterAll(() => {
    for (const [path] of PROBES) rmSync(path, { force: true });
  });

  it.each(PROBES)('%s: %#', (path, _code, rule) => {
    const found = violations.filter((violation) => violation.from === path).map((violation) => violation.rule.name);
    expect(found).toEqual(rule ? [rule] : []);
  });

  it('finds nothing in the real code', () => {
    const probes = new Set(PROBES.map(([path]) => path));
    expect(violations.filter((violation) => !probes.has(violation.from))).toEqual([]);
  });
});
