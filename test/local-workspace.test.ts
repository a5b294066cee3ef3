/**
 * The agent's read tools on a desktop runner's folder and in a sandboxed fork: a path or a pattern the
 * model chose is never taken for a program's option (list_files and search never ask, even in ask mode).
 */
import { existsSync, mkdirSync, mkdtempSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { forkWorkspace } from '../src/agents/fork-workspace.js';
import { localWorkspace } from '../src/agents/local-workspace.js';
import type { Workspace } from '../src/agents/types.js';
import { ForkManager } from '../src/sandbox/fork.js';

/** A folder with files at two depths, and a directory whose name looks like an option. */
function folder(): string {
  const dir = mkdtempSync(join(tmpdir(), 'svc-local-workspace-'));
  mkdirSync(join(dir, 'src'));
  mkdirSync(join(dir, '-delete'));
  writeFileSync(join(dir, 'keep.txt'), 'keep\n');
  writeFileSync(join(dir, 'src', 'index.ts'), 'export const answer = 42;\n');
  writeFileSync(join(dir, '-delete', 'inside.txt'), 'inside\n');
  return dir;
}

/** Every file below `dir`, relative. */
const files = (dir: string) =>
  readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((entry) => entry.isFile())
    .map((entry) => join(entry.parentPath, entry.name).slice(dir.length + 1))
    .sort();

const ALL = ['-delete/inside.txt', 'keep.txt', 'src/index.ts'];

/** The same checks over either workspace; `tree` is where its files are seen from the host. */
async function expectNoOptionInjection(workspace: Workspace, tree: () => string) {
  // A path that would be find's `-delete` action (or `!`, `(`: its expression) lists that path or fails.
  expect(await workspace.listFiles('-delete')).toBe('./-delete\n./-delete/inside.txt\n');
  await expect(workspace.listFiles('-delete -o -print')).rejects.toThrow(/No such file/);
  await expect(workspace.listFiles('!')).rejects.toThrow(/No such file/);
  await expect(workspace.listFiles('(')).rejects.toThrow(/No such file/);
  expect(files(tree())).toEqual(ALL);
  expect((await workspace.listFiles('.')).split('\n')).toEqual(expect.arrayContaining(['./keep.txt', './src/index.ts']));
  expect(await workspace.listFiles('src')).toBe('./src\n./src/index.ts\n');

  // A pattern or a path that starts with "-" is a pattern and a path, not grep's option.
  expect(await workspace.search('--files-with-matches', '.')).toBe('no matches');
  expect(await workspace.search('inside', '-delete')).toBe('-delete/inside.txt:1:inside\n');
  expect(await workspace.readFile('-delete/inside.txt')).toBe('inside\n');
  expect(files(tree())).toEqual(ALL);
}

describe('list_files and search take paths and patterns as such', () => {
  it("on a desktop runner's folder", async () => {
    const dir = folder();
    await expectNoOptionInjection(localWorkspace(dir, { env: { PATH: process.env.PATH ?? '/usr/bin:/bin' } }), () => dir);
  });

  it("refuses to confine a program to the credential proxy: a runner's folder has no sandbox to do it", async () => {
    const workspace = localWorkspace(folder(), { env: { PATH: process.env.PATH ?? '/usr/bin:/bin' } });
    await expect(workspace.runStreaming(['true'], { timeoutMs: 10_000, egressDir: tmpdir(), onLine: () => undefined })).rejects.toThrow(/no sandbox/);
  });

  it('in a sandboxed fork', async () => {
    const root = mkdtempSync(join(tmpdir(), 'svc-fork-workspace-'));
    const environment = folder();
    const forks = new ForkManager(join(root, 'forks'), { hiddenPaths: [join(root, 'forks')], allowUnsandboxed: false });
    const fork = await forks.create('options', environment, { mode: 'clone', fullCopy: true });
    await expectNoOptionInjection(forkWorkspace(fork, { network: false }), () => fork.changesDir);
    expect(existsSync(join(environment, 'keep.txt'))).toBe(true);
  });
});
