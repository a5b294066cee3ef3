/** The import-direction rule of ARCHITECTURE.md fires where it should and nowhere else. */
import { rmSync, writeFileSync } from 'node:fs';
import { ESLint } from 'eslint';
import { afterAll, describe, expect, it } from 'vitest';

const written: string[] = [];

async function ruleHits(path: string, code: string): Promise<number> {
  writeFileSync(path, code);
  written.push(path);
  const [result] = await new ESLint({ cwd: process.cwd() }).lintFiles([path]);
  return result!.messages.filter((message) => message.ruleId === 'import-x/no-restricted-paths').length;
}

describe('import direction', () => {
  afterAll(() => {
    for (const path of written) rmSync(path, { force: true });
  });

  it.each([
    ['src/domain/zz-lint-probe.ts', "import { tasks } from '../store/schema.js';\nexport const x = tasks;\n", 1],
    ['src/protocol/zz-lint-probe.ts', "import { AppError } from '../domain/errors.js';\nexport const x = AppError;\n", 1],
    ['src/store/zz-lint-probe.ts', "import { createTask } from '../engine/tasks.js';\nexport const x = createTask;\n", 1],
    ['src/engine/zz-lint-probe.ts', "import { buildServer } from '../server/app.js';\nexport const x = buildServer;\n", 1],
    ['src/cli/zz-lint-probe.ts', "import { startService } from '../main.js';\nexport const x = startService;\n", 1],
    ['src/cli/zz-lint-probe2.ts', "import { listTasks } from '../store/tasks.js';\nexport const x = listTasks;\n", 1],
    ['src/server/zz-lint-probe.ts', "import { createTask } from '../engine/tasks.js';\nexport const x = createTask;\n", 0],
    ['src/engine/zz-lint-probe2.ts', "import { listTasks } from '../store/tasks.js';\nexport const x = listTasks;\n", 0],
    ['src/cli/zz-lint-probe3.ts', "import { Task } from '../protocol/rest.js';\nexport const x = Task;\n", 0],
  ])('%s gets %#: %i violation(s)', async (path, code, expected) => {
    expect(await ruleHits(path, code)).toBe(expected);
  });

  it('lets svc server and svc admin reach the composition root', async () => {
    const [result] = await new ESLint({ cwd: process.cwd() }).lintFiles(['src/cli/admin.ts', 'src/cli/server.ts']);
    expect(result!.messages.filter((message) => message.ruleId === 'import-x/no-restricted-paths')).toEqual([]);
  });
});
