/**
 * From a fork's changes to pull requests: find the repositories the run changed, run their checks (the
 * proof), commit each one on the task's branch inside the sandbox, carry the branch out as a git bundle
 * and push it to the code host, then open or update one pull request per repository.
 *
 * Everything that runs repository code or reads the agent's git config happens inside the sandbox; the
 * host only reads bundles (data, copied out without following links) into repositories it owns.
 */
import { constants } from 'node:fs';
import { copyFile, mkdir, mkdtemp, open, realpath, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { LocalCodeHost } from '../codehost/local.js';
import type { Fork } from '../sandbox/fork.js';
import type { CheckSpec } from '../sandbox/environment.js';
import type { CheckProof } from '../store/schema.js';

/** Where bundles pass between host and sandbox, at the fork's root; never part of a commit. */
export const TRANSFER_DIR = '.svc-transfer';
const TAIL_LINES = 40;
const TAIL_CHARS = 4_000;

export interface RepositoryState {
  dir: string;
  head: string;
  dirty: boolean;
}

function tail(text: string): string {
  const lines = text.trimEnd().split('\n').slice(-TAIL_LINES).join('\n');
  return lines.length > TAIL_CHARS ? lines.slice(-TAIL_CHARS) : lines;
}

async function checked(fork: Fork, argv: string[], options: { signal?: AbortSignal; cwd?: string } = {}): Promise<string> {
  const result = await fork.run(argv, { timeoutMs: 120_000, ...options });
  if (result.exitCode !== 0) throw new Error(`${argv.slice(0, 3).join(' ')} failed in the fork: ${tail(result.stderr || result.stdout)}`);
  return result.stdout;
}

/** Each repository's HEAD and whether its working tree has changes, as the fork sees them. */
export async function inspectRepositories(fork: Fork, dirs: readonly string[], signal?: AbortSignal): Promise<RepositoryState[]> {
  if (dirs.length === 0) return [];
  const script = 'for d in "$@"; do cd "/workspace/$d" && printf "%s\\t%s\\t%s\\n" "$d" "$(git rev-parse HEAD)" "$(git status --porcelain | head -n 1)"; done';
  const out = await checked(fork, ['sh', '-c', script, 'sh', ...dirs], signal ? { signal } : {});
  return out
    .split('\n')
    .filter(Boolean)
    .map((line) => {
      const [dir, head, change] = line.split('\t');
      return { dir: dir!, head: head!, dirty: Boolean(change) };
    });
}

/** Runs checks in a repository of the fork; each becomes a line of proof. */
export async function runChecks(
  fork: Fork,
  dir: string,
  checks: readonly CheckSpec[],
  options: { network: boolean; signal?: AbortSignal; env?: Record<string, string> },
): Promise<CheckProof[]> {
  const proofs: CheckProof[] = [];
  for (const check of checks) {
    if (options.signal?.aborted) break;
    const result = await fork.run(['sh', '-c', `exec 2>&1\n${check.command}`], {
      cwd: dir === '.' ? '' : dir,
      timeoutMs: check.timeoutSeconds * 1000,
      network: options.network,
      ...(options.signal ? { signal: options.signal } : {}),
      ...(options.env ? { env: options.env } : {}),
    });
    proofs.push({
      name: check.name,
      command: check.command,
      passed: result.exitCode === 0 && !result.timedOut,
      exitCode: result.exitCode,
      timedOut: result.timedOut,
      durationMs: result.durationMs,
      outputTail: tail(result.stdout),
    });
  }
  return proofs;
}

/**
 * Commits the repository's changes inside the sandbox and bundles what its HEAD adds since `since`.
 * Answers the new head and a host path to the bundle (a private copy), or null when nothing changed.
 */
export async function commitAndBundle(
  fork: Fork,
  input: { dir: string; since: string; message: string; bundleName: string; signal?: AbortSignal },
): Promise<{ head: string; bundle: string } | null> {
  const script = [
    'set -e',
    'cd "/workspace/$1"',
    'git add -A',
    'if ! git diff --cached --quiet; then',
    '  git -c user.name=svc -c user.email=svc@localhost -c commit.gpgsign=false -c core.hooksPath=/dev/null commit --quiet --no-verify -m "$3"',
    'fi',
    'head=$(git rev-parse HEAD)',
    'if [ "$head" = "$2" ]; then echo unchanged; exit 0; fi',
    `mkdir -p "/workspace/${TRANSFER_DIR}"`,
    `git bundle create --quiet "/workspace/${TRANSFER_DIR}/$4" HEAD "^$2"`,
    'echo "head $head"',
  ].join('\n');
  const out = await checked(fork, ['sh', '-c', script, 'sh', input.dir, input.since, input.message, input.bundleName], input.signal ? { signal: input.signal } : {});
  const head = /^head ([0-9a-f]{40})$/m.exec(out)?.[1];
  if (!head) return null;
  return { head, bundle: await copyOut(fork, input.bundleName) };
}

/**
 * Copies a file the sandbox wrote into the transfer dir to a private host path, refusing links: the
 * agent controls the fork's files, and a link there must not make the host read anything else.
 */
async function copyOut(fork: Fork, name: string): Promise<string> {
  const dir = join(await realpath(fork.changesDir), TRANSFER_DIR);
  if ((await realpath(dir)) !== dir) throw new Error(`${TRANSFER_DIR} in the fork is a link; refusing to read it`);
  const handle = await open(join(dir, name), constants.O_RDONLY | constants.O_NOFOLLOW);
  try {
    if (!(await handle.stat()).isFile()) throw new Error(`${TRANSFER_DIR}/${name} is not a file`);
    const target = join(await mkdtemp(join(tmpdir(), 'svc-bundle-')), name);
    const out = await open(target, 'w', 0o600);
    try {
      await handle.readFile().then((data) => out.writeFile(data));
    } finally {
      await out.close();
    }
    return target;
  } finally {
    await handle.close();
  }
}

/** Removes the transfer dir from the fork (host side). */
export async function clearTransfers(fork: Fork): Promise<void> {
  await rm(join(fork.changesDir, TRANSFER_DIR), { recursive: true, force: true });
}

/**
 * Puts the task's earlier branch into a fresh fork's repository (a follow-up on another host, or after
 * the old fork was deleted): the code host writes a bundle, the sandbox fetches and checks it out.
 */
export async function restoreBranch(
  fork: Fork,
  host: LocalCodeHost,
  input: { workspaceId: string; fullName: string; dir: string; branch: string; base: string; bundleName: string },
): Promise<boolean> {
  await clearTransfers(fork);
  const dir = join(fork.changesDir, TRANSFER_DIR);
  await mkdir(dir);
  const staging = await mkdtemp(join(tmpdir(), 'svc-bundle-'));
  try {
    const head = await host.bundleBranch(input.workspaceId, input.fullName, input.branch, input.base, join(staging, input.bundleName));
    if (!head) return false;
    await copyFile(join(staging, input.bundleName), join(dir, input.bundleName));
    const script = [
      'set -e',
      'cd "/workspace/$1"',
      `git fetch --quiet --no-tags "/workspace/${TRANSFER_DIR}/$3" "refs/heads/$2"`,
      'git checkout --quiet -B "$2" FETCH_HEAD',
    ].join('\n');
    await checked(fork, ['sh', '-c', script, 'sh', input.dir, input.branch, input.bundleName]);
    return true;
  } finally {
    await rm(staging, { recursive: true, force: true });
    await clearTransfers(fork);
  }
}

export interface ProofInput {
  summary: string;
  files: Array<{ file: string; added: number; removed: number }>;
  checks: readonly CheckProof[];
  taskUrl: string;
}

const seconds = (ms: number): string => `${(ms / 1000).toFixed(1)} s`;

/** The pull request's description: what changed, and each check's command, result, duration and output. */
export function proofMarkdown(input: ProofInput): string {
  const lines = [input.summary.trim() || 'Changes made by svc.', '', `Task: ${input.taskUrl}`, '', '## Changes', ''];
  for (const file of input.files) lines.push(`- \`${file.file}\` (+${file.added} −${file.removed})`);
  lines.push('', '## Proof', '');
  if (input.checks.length === 0) {
    lines.push('No checks are configured for this repository (`.svc/environment.json`).');
  } else {
    lines.push('| Check | Command | Result | Duration |', '| --- | --- | --- | --- |');
    for (const check of input.checks) {
      const result = check.passed ? 'passed' : check.timedOut ? 'timed out' : `failed (exit ${check.exitCode ?? 'signal'})`;
      lines.push(`| ${check.name} | \`${check.command.replaceAll('|', '\\|')}\` | ${result} | ${seconds(check.durationMs)} |`);
    }
    for (const check of input.checks) {
      lines.push('', `<details><summary>${check.name} output (last lines)</summary>`, '', '```text', check.outputTail.replaceAll('```', '`\u200b``'), '```', '', '</details>');
    }
  }
  return `${lines.join('\n')}\n`;
}
