/**
 * From a fork's changes to pull requests: find the repositories the run changed, run their checks (the
 * proof), commit each one on the task's branch inside the sandbox, carry the branch out as a git bundle
 * and push it to the code host, then open or update one pull request per repository.
 *
 * Everything that runs repository code or reads the agent's git config happens inside the sandbox; the
 * host only reads bundles (data, copied out without following links) into repositories it owns.
 */
import { constants, createWriteStream } from 'node:fs';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { mkdir, mkdtemp, open, realpath, rm } from 'node:fs/promises';
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

/** What git tells of a repository of the fork. */
export interface RepositoryState {
  dir: string;
  head: string;
  /** The working tree has uncommitted changes. */
  dirty: boolean;
  /** Commits HEAD has that none of the repository's known commits reaches. */
  ahead: number;
}

/** A repository of the fork whose state git could not read: what could not be read, and git's last words. */
export interface UnreadableRepository {
  dir: string;
  /** A noun phrase: `a working tree that could not be read`. */
  what: string;
  /** The tail of git's stderr (may be empty). */
  detail: string;
}

/** A repository of the fork and commits the code host has (its default branch's recent history, the task's branch). */
export interface RepositoryTarget {
  dir: string;
  known: readonly string[];
}

const SHA = /^[0-9a-f]{40}$/;

/** `dir:sha,sha`: one argument per repository for the scripts below (dirs and shas hold no `:` or `,`). */
export const targetArgument = (target: RepositoryTarget): string => `${target.dir}:${target.known.filter((sha) => SHA.test(sha)).join(',')}`;

/**
 * Shell that sets `$nots` to the known commits (from `$shas`) that the repository has: the boundary of
 * what is new. Only commits the code host has may bound a bundle, so the fork's own refs are not used.
 */
export const KNOWN_IN_FORK = 'nots=""; for s in $(printf "%s" "$shas" | tr "," " "); do git cat-file -e "$s^{commit}" 2>/dev/null && nots="$nots $s"; done';

function tail(text: string): string {
  const lines = text.trimEnd().split('\n').slice(-TAIL_LINES).join('\n');
  return lines.length > TAIL_CHARS ? lines.slice(-TAIL_CHARS) : lines;
}

async function checked(fork: Fork, argv: string[], options: { signal?: AbortSignal; cwd?: string } = {}): Promise<string> {
  const result = await fork.run(argv, { timeoutMs: 120_000, ...options });
  if (result.exitCode !== 0) throw new Error(`${argv.slice(0, 3).join(' ')} failed in the fork: ${tail(result.stderr || result.stdout)}`);
  return result.stdout;
}

/**
 * Shell for a loop over the fork's repositories (`$d`, relative to /workspace) that reads each with git.
 * `enter` goes into the repository, or answers 1: silently where the fork lacks its directory (a
 * repository connected after the fork was made), having said why where git cannot read it. `unreadable
 * WHAT` says that of `$d` with the tail of git's stderr, which goes to `$e`: one line `<dir>\t!\t<what>\t<stderr>`
 * (`unreadableOf`). Each git command's output is captured on its own, `out=$(git … 2>"$e") || { unreadable
 * …; continue; }`: inside another command's arguments or a pipeline, its failure would read as an empty answer.
 */
export const READ_REPOSITORIES = [
  'e=$(mktemp) || exit 1',
  `trap 'rm -f "$e"' EXIT`,
  'unreadable() { printf "%s\t!\t%s\t%s\n" "$d" "$1" "$(tail -n 3 "$e" | tr "\t\n" "  ")"; }',
  'enter() {',
  '  [ -d "/workspace/$d" ] || return 1',
  '  cd "/workspace/$d" 2>"$e" || { unreadable "a directory that could not be entered"; return 1; }',
  // Without a .git of its own, git would read the repository around it (the environment's) instead.
  '  [ -e .git ] || { : >"$e"; unreadable "no .git"; return 1; }',
  '  top=$(git rev-parse --show-toplevel 2>"$e") || { unreadable "a .git that could not be read"; return 1; }',
  '  [ "$top" = "$(pwd -P)" ] || { echo "git found the repository at $top" >"$e"; unreadable "a .git that could not be read"; return 1; }',
  '}',
].join('\n');

/** The repository and what could not be read, from a line `unreadable` printed (`READ_REPOSITORIES`); null for any other line. */
export function unreadableOf(line: string): UnreadableRepository | null {
  const [dir, mark, what, detail] = line.split('\t');
  if (mark !== '!' || !dir || !what) return null;
  return { dir, what, detail: (detail ?? '').trim().slice(-TAIL_CHARS) };
}

/**
 * Each repository's HEAD, whether its tree has changes, and how far it is ahead of what the code host has;
 * or what of it git could not read (a broken index, a broken ref, no .git). A repository whose HEAD is
 * unborn, and one the fork has no directory for, are left out.
 */
export async function inspectRepositories(fork: Fork, targets: readonly RepositoryTarget[], signal?: AbortSignal): Promise<Array<RepositoryState | UnreadableRepository>> {
  if (targets.length === 0) return [];
  const script = [
    READ_REPOSITORIES,
    'for t in "$@"; do',
    '  d=${t%%:*}; shas=${t#*:}',
    '  enter || continue',
    '  if ! h=$(git rev-parse -q --verify HEAD 2>"$e"); then',
    // Unborn: HEAD names a branch that has no commit yet. A broken ref fails `symbolic-ref` too.
    '    git symbolic-ref -q HEAD >/dev/null 2>&1 && continue',
    '    git rev-parse --verify HEAD >/dev/null 2>"$e"; unreadable "a HEAD that could not be read"; continue',
    '  fi',
    '  st=$(git status --porcelain 2>"$e") || { unreadable "a working tree that could not be read"; continue; }',
    `  ${KNOWN_IN_FORK}`,
    '  n=$(git rev-list --count HEAD --not $nots 2>"$e") || { unreadable "history that could not be read"; continue; }',
    '  printf "%s\tok\t%s\t%s\t%s\n" "$d" "$h" "${st:+dirty}" "$n"',
    'done',
  ].join('\n');
  const out = await checked(fork, ['sh', '-c', script, 'sh', ...targets.map(targetArgument)], signal ? { signal } : {});
  return out
    .split('\n')
    .filter(Boolean)
    .map((line) => {
      const failure = unreadableOf(line);
      if (failure) return failure;
      const [dir, , head, dirty, ahead] = line.split('\t');
      return { dir: dir!, head: head!, dirty: dirty === 'dirty', ahead: Number(ahead) || 0 };
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
 * Commits the repository's changes inside the sandbox and bundles what its HEAD adds to the commits the
 * code host has (`known`). Answers the new head and a host path to the bundle (a private copy), or null
 * when there is nothing new.
 */
export async function commitAndBundle(
  fork: Fork,
  input: RepositoryTarget & { message: string; bundleName: string; signal?: AbortSignal },
): Promise<{ head: string; bundle: string } | null> {
  const script = [
    'set -e',
    't=$1; d=${t%%:*}; shas=${t#*:}',
    'cd "/workspace/$d"',
    'git add -A',
    'if ! git diff --cached --quiet; then',
    '  git -c user.name=svc -c user.email=svc@localhost -c commit.gpgsign=false -c core.hooksPath=/dev/null commit --quiet --no-verify -m "$2"',
    'fi',
    KNOWN_IN_FORK,
    'if [ "$(git rev-list --count HEAD --not $nots)" = 0 ]; then echo unchanged; exit 0; fi',
    `mkdir -p "/workspace/${TRANSFER_DIR}"`,
    `git bundle create --quiet "/workspace/${TRANSFER_DIR}/$3" HEAD --not $nots`,
    'echo "head $(git rev-parse HEAD)"',
  ].join('\n');
  const out = await checked(fork, ['sh', '-c', script, 'sh', targetArgument(input), input.message, input.bundleName], input.signal ? { signal: input.signal } : {});
  const head = /^head ([0-9a-f]{40})$/m.exec(out)?.[1];
  if (!head) return null;
  return { head, bundle: await copyOut(fork, input.bundleName) };
}

/** The largest bundle a job may push: far above any reasonable change, far below a host's memory. */
const MAX_BUNDLE_BYTES = 2 * 1024 ** 3;

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
    if ((await handle.stat()).size > MAX_BUNDLE_BYTES) throw new Error(`the change's bundle is larger than ${MAX_BUNDLE_BYTES} bytes`);
    const target = join(await mkdtemp(join(tmpdir(), 'svc-bundle-')), name);
    // Streamed, and cut at the cap: the file may still grow while it is read.
    let copied = 0;
    const capped = new Transform({
      transform(chunk: Buffer, _encoding, done) {
        copied += chunk.length;
        done(copied > MAX_BUNDLE_BYTES ? new Error(`the change's bundle is larger than ${MAX_BUNDLE_BYTES} bytes`) : null, chunk);
      },
    });
    await pipeline(handle.createReadStream({ autoClose: false }), capped, createWriteStream(target, { mode: 0o600 }));
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
  return bringBranch(fork, host, { ...input, apply: 'checkout' });
}

/** What the sandbox does with a branch the code host sent: check it out, fast-forward to it, or clone it. */
export type BranchApply = 'checkout' | 'fast-forward' | 'clone';

const APPLY_SCRIPT: Record<BranchApply, string[]> = {
  checkout: ['cd "/workspace/$1"', `git fetch --quiet --no-tags "/workspace/${TRANSFER_DIR}/$3" "refs/heads/$2"`, 'git checkout --quiet -B "$2" FETCH_HEAD'],
  'fast-forward': ['cd "/workspace/$1"', `git fetch --quiet --no-tags "/workspace/${TRANSFER_DIR}/$3" "refs/heads/$2"`, 'git merge --quiet --ff-only FETCH_HEAD'],
  clone: ['cd /workspace', `git clone --quiet --branch "$2" "/workspace/${TRANSFER_DIR}/$3" "$1"`, 'git -C "$1" remote remove origin'],
};

/**
 * Brings a code-host branch into a repository of the fork as a bundle (written by the host, read by the
 * sandbox: the sandbox never sees the code host). `base` is a commit the fork's repository has (the
 * bundle then holds only what is new), or null for the whole branch. False when there was nothing to bring.
 */
export async function bringBranch(
  fork: Fork,
  host: LocalCodeHost,
  input: { workspaceId: string; fullName: string; dir: string; branch: string; base: string | null; bundleName: string; apply: BranchApply },
): Promise<boolean> {
  // Nothing runs in the fork while this runs, so the transfer dir made here is ours.
  await clearTransfers(fork);
  const dir = join(fork.changesDir, TRANSFER_DIR);
  await mkdir(dir);
  try {
    const head = await host.bundleBranch(input.workspaceId, input.fullName, input.branch, input.base, join(dir, input.bundleName));
    if (!head) return false;
    await checked(fork, ['sh', '-c', ['set -e', ...APPLY_SCRIPT[input.apply]].join('\n'), 'sh', input.dir, input.branch, input.bundleName]);
    return true;
  } finally {
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
