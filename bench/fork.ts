/**
 * `npm run bench -- fork`: what a job pays before the agent's first command — ForkManager.create and the
 * first `fork.run(['true'])` in bubblewrap — for environments of 1 MB, 100 MB and 1 GB, against the
 * baseline of copying the same tree with `cp -a` in the same run. Target: under 30 ms p50 at every size.
 *
 * Each environment is generated once in a temp dir (a git checkout with tracked sources and assets, an
 * ignored node_modules of many small files and some large binaries), reused by every iteration, and
 * deleted before the next size is made. The tree is in the page cache for fork and copy alike.
 */
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdirSync, mkdtempSync, rmSync, statfsSync, writeFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { ForkManager, sandboxCapabilities, type Fork, type ForkMode } from '../src/sandbox/fork.js';
import { latencyOf, latencyRow, ms, since, verdict, type Latency } from './support.js';

const MB = 1024 * 1024;
const TARGET_MS = 30;
/** Each measured loop stops at its iteration count or after this long, whichever comes first. */
const LOOP_BUDGET_MS = 120_000;

interface Size {
  label: string;
  bytes: number;
  forkIterations: number;
  copyIterations: number;
  /** Iterations of the fallback mode (a real copy); 0 to skip it. */
  cloneIterations: number;
}

const SIZES: Size[] = [
  { label: '1 MB', bytes: MB, forkIterations: 50, copyIterations: 20, cloneIterations: 20 },
  { label: '100 MB', bytes: 100 * MB, forkIterations: 50, copyIterations: 10, cloneIterations: 5 },
  { label: '1 GB', bytes: 1024 * MB, forkIterations: 50, copyIterations: 3, cloneIterations: 0 },
];

// --- the environment -------------------------------------------------------------------------------

/** A deterministic generator, so every run lays out the same tree. */
function mulberry32(seed: number): () => number {
  let state = seed;
  return () => {
    state = (state + 0x6d2b79f5) | 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Source-like text to cut files from (compressible, as code is). */
const TEXT = Array.from({ length: 2048 }, (_, i) => `export function handler${i}(input: Request): Response { return respond(input, ${i * 7919}); }\n`).join('');

interface Part {
  /** Share of the working tree's bytes. */
  share: number;
  minBytes: number;
  maxBytes: number;
  binary: boolean;
  path: (index: number) => string;
}

/** A checkout as agents meet them: tracked sources and assets, an ignored node_modules. */
const PARTS: Part[] = [
  { share: 0.1, minBytes: 1024, maxBytes: 8 * 1024, binary: false, path: (i) => `src/module-${Math.floor(i / 40)}/file-${i}.ts` },
  { share: 0.08, minBytes: 64 * 1024, maxBytes: 4 * MB, binary: true, path: (i) => `assets/asset-${i}.bin` },
  { share: 0.37, minBytes: 512, maxBytes: 16 * 1024, binary: false, path: (i) => `node_modules/package-${Math.floor(i / 25)}/lib/file-${i}.js` },
  { share: 0.45, minBytes: MB, maxBytes: 24 * MB, binary: true, path: (i) => `node_modules/native-${Math.floor(i / 3)}/build/addon-${i}.node` },
];

function git(cwd: string, ...args: string[]): void {
  const result = spawnSync('git', ['-c', 'user.email=bench@example.com', '-c', 'user.name=bench', ...args], { cwd, encoding: 'utf8' });
  if (result.status !== 0) throw new Error(`git ${args.join(' ')} failed: ${result.stderr}`);
}

/** Writes a checkout of about `bytes` (working tree 90%, the packed .git the rest) under `environment/app`. */
function generateEnvironment(environment: string, bytes: number): { files: number; bytes: number } {
  const app = join(environment, 'app');
  mkdirSync(app, { recursive: true });
  const random = mulberry32(bytes);
  const made = new Set<string>();
  let files = 0;
  for (const part of PARTS) {
    let left = Math.floor(bytes * 0.9 * part.share);
    for (let index = 0; left > 0; index++) {
      const size = Math.min(left, Math.floor(part.minBytes + random() * (part.maxBytes - part.minBytes)));
      const path = join(app, part.path(index));
      if (!made.has(dirname(path))) {
        mkdirSync(dirname(path), { recursive: true });
        made.add(dirname(path));
      }
      if (part.binary) writeFileSync(path, randomBytes(size));
      else {
        // A unique first line, so that git stores every file as its own blob.
        const offset = Math.floor(random() * (TEXT.length - 9 * 1024));
        writeFileSync(path, `// ${part.path(index)}\n${TEXT.slice(offset, offset + size)}`);
      }
      left -= size;
      files += 1;
    }
  }
  writeFileSync(join(app, '.gitignore'), 'node_modules/\n');
  git(app, 'init', '--quiet', '--initial-branch=main');
  git(app, 'add', '-A');
  git(app, 'commit', '--quiet', '-m', 'The checkout');
  git(app, 'repack', '-a', '-d', '-q');
  const du = spawnSync('du', ['-sb', environment], { encoding: 'utf8' });
  return { files, bytes: Number(du.stdout.split('\t')[0]) };
}

// --- measuring -------------------------------------------------------------------------------------

function exited(argv: readonly string[]): Promise<number | null> {
  return new Promise((resolve, reject) => {
    const child = spawn(argv[0]!, argv.slice(1), { stdio: 'ignore' });
    child.once('error', reject);
    child.once('close', resolve);
  });
}

async function mustExit(argv: readonly string[]): Promise<void> {
  const code = await exited(argv);
  if (code !== 0) throw new Error(`${argv.join(' ')} exited with ${code}`);
}

/** Runs `once` (which answers the milliseconds it measured) after `warmup` unmeasured runs. */
async function sample(iterations: number, once: () => Promise<number>, warmup = 1): Promise<Latency> {
  // Writes still queued from the step before (generating, copying, removing) would land in this one.
  spawnSync('sync');
  for (let i = 0; i < warmup; i++) await once();
  const samples: number[] = [];
  const started = performance.now();
  while (samples.length < iterations && (samples.length < 3 || since(started) < LOOP_BUDGET_MS)) samples.push(await once());
  return latencyOf(samples);
}

/** The baseline: `cp -a` of the environment (the copy's removal is not timed). */
function copyOnce(environment: string, scratch: string): () => Promise<number> {
  return async () => {
    const target = join(scratch, 'copy');
    const start = performance.now();
    await mustExit(['cp', '-a', environment, target]);
    const elapsed = since(start);
    await rm(target, { recursive: true, force: true });
    return elapsed;
  };
}

/** What a job does before its agent's first command: create the fork and run a command in it. */
function forkOnce(forks: ForkManager, environment: string, mode: ForkMode, removals: number[]): () => Promise<number> {
  let count = 0;
  return async () => {
    const start = performance.now();
    const fork = await forks.create(`bench-${mode}-${count++}`, environment, { mode });
    const result = await fork.run(['true'], { timeoutMs: 60_000 });
    const elapsed = since(start);
    if (result.exitCode !== 0 || fork.info.mode !== mode) throw new Error(`fork.run(['true']) in a ${fork.info.mode} fork exited ${result.exitCode}: ${result.stderr}`);
    const removeStart = performance.now();
    await forks.remove(fork);
    removals.push(since(removeStart));
    return elapsed;
  };
}

/**
 * Where the overlay fork's time goes: the same steps as Fork.run, one layer at a time (a process, a
 * mount namespace, the overlay mount, bubblewrap with and without its network namespace).
 */
async function profile(forks: ForkManager, environment: string): Promise<Array<{ step: string; latency: Latency }>> {
  const fork: Fork = await forks.create('bench-profile', environment, { mode: 'overlay' });
  const { dir } = fork.info;
  const base = fork.info.lower.layers[0]!;
  const merged = join(dir, 'merged');
  const unshare = ['unshare', '-m', '--propagation', 'private'];
  const mount = `mount -t overlay overlay -o "lowerdir=${base},upperdir=${join(dir, 'upper')},workdir=${join(dir, 'work')}" "${merged}" || exit 125`;
  const sandbox = ['--die-with-parent', '--ro-bind', '/usr', '/usr', '--ro-bind-try', '/bin', '/bin', '--ro-bind-try', '/lib', '/lib', '--ro-bind-try', '/lib64', '/lib64', '--ro-bind', '/etc', '/etc'];
  sandbox.push('--dev', '/dev', '--proc', '/proc', '--tmpfs', '/tmp', '--bind', base, '/workspace', '--chdir', '/workspace');
  sandbox.push('--unshare-pid', '--unshare-ipc', '--unshare-uts', '--hostname', 'sandbox');
  const steps: Array<{ step: string; argv: string[] }> = [
    { step: 'spawn `true` (the floor)', argv: ['true'] },
    { step: 'sh -c `exec true`', argv: ['sh', '-c', 'exec true'] },
    { step: 'unshare -m + sh', argv: [...unshare, 'sh', '-c', 'exec true'] },
    { step: 'unshare -m + sh + overlay mount', argv: [...unshare, 'sh', '-c', `${mount}\nexec true`] },
    { step: 'bwrap --ro-bind / / (minimal)', argv: ['bwrap', '--ro-bind', '/', '/', 'true'] },
    { step: 'bwrap sandbox, shared network', argv: ['bwrap', ...sandbox, 'true'] },
    { step: 'bwrap sandbox + --unshare-net', argv: ['bwrap', ...sandbox, '--unshare-net', 'true'] },
  ];
  const results: Array<{ step: string; latency: Latency }> = [];
  try {
    for (const { step, argv } of steps) {
      results.push({
        step,
        latency: await sample(
          40,
          async () => {
            const start = performance.now();
            await mustExit(argv);
            return since(start);
          },
          3,
        ),
      });
    }
  } finally {
    await forks.remove(fork);
  }
  return results;
}

function freeBytes(path: string): number {
  const stats = statfsSync(path);
  return stats.bavail * stats.bsize;
}

/** Sizes to run: all, or those named in BENCH_FORK_SIZES (MB, comma separated: `1,100`). */
function selectedSizes(): Size[] {
  const wanted = process.env.BENCH_FORK_SIZES?.split(',').map((value) => Number(value.trim()) * MB);
  return wanted ? SIZES.filter((size) => wanted.includes(size.bytes)) : SIZES;
}

export async function forkBench(): Promise<void> {
  const out = (line: string) => process.stdout.write(`${line}\n`);
  const capabilities = sandboxCapabilities();
  if (!capabilities.bwrap || !capabilities.overlay) {
    out(`fork: skipped (bubblewrap ${capabilities.bwrap ? 'works' : 'missing'}, overlay mounts ${capabilities.overlay ? 'work' : 'unavailable'}: both are needed)`);
    return;
  }
  const root = mkdtempSync(join(tmpdir(), 'svc-bench-fork-'));
  const onSignal = () => {
    rmSync(root, { recursive: true, force: true });
    process.exit(130);
  };
  process.once('SIGINT', onSignal);
  const forks = new ForkManager(join(root, 'forks'), { hiddenPaths: [root], allowUnsandboxed: false });
  const forkP50s: Array<{ label: string; p50: number }> = [];
  out(`fork: temp dir ${root}, ${(freeBytes(root) / 1024 ** 3).toFixed(1)} GiB free`);
  out('fork: ratio = p50 / p50 of `cp -a` of the same size (profile rows: / p50 of the overlay fork)');
  try {
    mkdirSync(join(root, 'forks'));
    for (const size of selectedSizes()) {
      // The environment, one copy of it and a margin.
      const needed = 2.5 * size.bytes + 512 * MB;
      if (freeBytes(root) < needed) {
        out(`fork ${size.label}: skipped, ${(needed / 1024 ** 3).toFixed(1)} GiB of free disk needed`);
        continue;
      }
      const environment = join(root, `environment-${size.bytes / MB}mb`);
      const generated = performance.now();
      const tree = generateEnvironment(environment, size.bytes);
      out(`fork ${size.label}: generated ${tree.files} files, ${(tree.bytes / MB).toFixed(1)} MiB on disk, in ${ms(since(generated))}`);
      try {
        const removals: number[] = [];
        const overlay = await sample(size.forkIterations, forkOnce(forks, environment, 'overlay', removals), 3);
        forkP50s.push({ label: size.label, p50: overlay.p50 });
        const profiled = size === SIZES[0] ? await profile(forks, environment) : [];
        const cloneRemovals: number[] = [];
        const clone = size.cloneIterations > 0 ? await sample(size.cloneIterations, forkOnce(forks, environment, 'clone', cloneRemovals)) : null;
        // Last: the copies leave the most behind for the disk to write back.
        const copy = await sample(size.copyIterations, copyOnce(environment, root));
        out(latencyRow(`${size.label}: cp -a (baseline)`, copy, copy));
        out(latencyRow(`${size.label}: fork + first run (overlay)`, overlay, copy, `remove p50 ${ms(latencyOf(removals).p50)}`));
        if (clone) out(latencyRow(`${size.label}: fork + first run (clone fallback)`, clone, copy, `remove p50 ${ms(latencyOf(cloneRemovals).p50)}`));
        for (const { step, latency } of profiled) out(latencyRow(`  profile: ${step}`, latency, overlay));
      } finally {
        await rm(environment, { recursive: true, force: true });
      }
    }
  } finally {
    process.removeListener('SIGINT', onSignal);
    await rm(root, { recursive: true, force: true });
  }
  for (const { label, p50 } of forkP50s) out(verdict(`fork + sandbox start p50 at ${label}`, p50, TARGET_MS));
}
