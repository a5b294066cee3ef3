/**
 * `npm run bench [-- part…]`: every benchmark, or the parts named (`http`, `fork`, `task-start`). Each
 * prints its figures as ratios to a baseline measured in the same run on the same machine; none is a
 * test assertion. Several parts run one after the other, each in a process of its own, so that one
 * part's memory (a generated 1 GB tree, a closed PGlite) does not weigh on the next one's figures.
 */
import { spawn } from 'node:child_process';
import { forkBench } from './fork.js';
import { httpBench } from './http.js';
import { runnersBench } from './runners.js';
import { taskStartBench } from './task-start.js';

const PARTS: Record<string, () => Promise<void>> = {
  http: httpBench,
  fork: forkBench,
  'task-start': taskStartBench,
  runners: runnersBench,
};

function runAlone(name: string): Promise<number | null> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [...process.execArgv, process.argv[1]!, name], { stdio: 'inherit' });
    child.once('error', reject);
    child.once('exit', resolve);
  });
}

async function main(): Promise<void> {
  const named = process.argv.slice(2);
  const unknown = named.filter((name) => !(name in PARTS));
  if (unknown.length > 0) throw new Error(`unknown benchmark ${unknown.join(', ')}; choose from ${Object.keys(PARTS).join(', ')}`);
  if (named.length === 1) {
    process.stdout.write(`\n== ${named[0]}\n`);
    await PARTS[named[0]!]!();
    return;
  }
  for (const name of named.length > 0 ? named : Object.keys(PARTS)) {
    const code = await runAlone(name);
    if (code !== 0) process.exitCode = 1;
  }
}

main().then(
  // Servers, pools and timers of a part must not keep the process alive after its last figure.
  () => process.exit(),
  (error: unknown) => {
    process.stderr.write(`bench failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
    process.exit(1);
  },
);
