/**
 * Temporary shell access to a cloud workspace for a local run (docs/runner-protocol.md "POST
 * /runs/{runId}/workspace-ssh"; SPEC.md "Other credentials": valid 60 minutes).
 *
 * The run asks for a grant: a `service_ssh_…` token (only its SHA-256 is stored) for one workspace of its
 * user where every repository of its project is connected. The token works on one endpoint only,
 * `POST /api/v1/workspace-shell`, which runs a command with `sh -c` in a writable fork of the workspace
 * environment kept for the grant: files written by one command are there for the next. The forks live
 * under `dataDir/forks/ssh/<workspace id>/<grant id>`, where environment garbage collection
 * (`ForkLifecycle.versionsInUse`) sees the version each one uses; `expireWorkspaceShells` removes them
 * once their grant has ended.
 *
 * What one run may hold is bounded: at most SHELL_GRANTS_PER_RUN grants of a run work at once (each has
 * its fork on disk), and a grant runs one command at a time with at most SHELL_QUEUED_COMMANDS waiting
 * behind it; more are refused (429) instead of being held, bodies and all, for as long as those run.
 */
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { AppError } from '../../domain/errors.js';
import { hashSecret } from '../../domain/secrets.js';
import { isUuid } from '../../domain/slugs.js';
import {
  RUNNER_LIMITS,
  SSH_TOKEN_PREFIX,
  type WorkspaceShellBody,
  type WorkspaceShellResponse,
  type WorkspaceSshBody,
  type WorkspaceSshResponse,
} from '../../protocol/runner.js';
import { parseEnvironmentConfig } from '../../sandbox/environment.js';
import { ForkManager, type Fork, type SandboxPolicy } from '../../sandbox/fork.js';
import type { Db } from '../../store/db.js';
import {
  countActiveSshGrants,
  endedSshGrants,
  findActiveSshGrant,
  insertSshGrant,
  isSshGrantActive,
  type SshGrantRow,
} from '../../store/delegations.js';
import { findRunnerProject, projectRepositories, type RunnerRow } from '../../store/runners.js';
import { findMembership } from '../../store/users.js';
import { findWorkspace, type Workspace } from '../../store/workspaces.js';
import type { Environments } from '../environments.js';
import { activeRun, chooseDestination } from './delegation.js';

/** The REST path the grant's token works on, under the public URL (src/server/rest/workspace-shell.ts). */
export const WORKSPACE_SHELL_PATH = '/api/v1/workspace-shell';
const TOKEN = /^service_ssh_[A-Za-z0-9_-]{43}$/;
export const SHELL_UNAUTHORIZED = 'Invalid, expired or revoked workspace shell token';

/** Grants of one run that work at once; a run asking for another is refused until one ends. */
export const SHELL_GRANTS_PER_RUN = 3;
/** Commands of one grant that may wait behind the one running; more are refused (429). */
export const SHELL_QUEUED_COMMANDS = 3;
/**
 * The Retry-After of a command refused because its grant is busy. Nothing tells when the running command
 * ends (it may run 600 s): a few seconds lets a client that waits for its own commands' answers go on.
 */
export const SHELL_BUSY_RETRY_AFTER_SECONDS = 5;

/** Where the grants' forks live: beside the task forks of each host, as a "host" of their own. */
export const shellForksRoot = (dataDir: string): string => join(dataDir, 'forks', 'ssh');

function workspaceMarkdown(workspace: { id: string; name: string }, expiresAt: Date): string {
  return [
    `You have temporary shell access to the cloud workspace "${workspace.name}" until ${expiresAt.toISOString()}: run commands there with the ssh helper ` +
      '(`ssh.localCommand`; its credential stays in your run directory). Files you write there stay for your later commands. ' +
      "Do not copy local secrets to the shared workspace without the user's consent.",
    '',
    'End your final message with this block, verbatim and outside a code fence:',
    '',
    '[[CLOUD_WORKSPACE]]',
    `workspaceId: ${workspace.id}`,
    '[[/CLOUD_WORKSPACE]]',
  ].join('\n');
}

/**
 * POST /runs/{runId}/workspace-ssh: a grant for a workspace of the run's user that has every repository
 * of the run's project connected (one is chosen; several are offered; none gets setup guidance).
 */
export async function requestWorkspaceSsh(
  deps: { db: Db; publicUrl: string },
  runner: RunnerRow,
  runId: string,
  body: WorkspaceSshBody,
): Promise<WorkspaceSshResponse> {
  const { db } = deps;
  const { task } = await activeRun(db, runner, runId, body.generation);
  const project = task.projectId ? await findRunnerProject(db, runner.id, task.projectId) : null;
  if (!project) return { ok: false, message: "The run's project is no longer registered by this runner; register it again (svc runner project add) and ask again." };
  const repositories = projectRepositories(project).map((repository) => repository.name);
  const destination = await chooseDestination(db, { userId: runner.userId, repositories, workspaceId: body.input.workspaceId, sourceTaskId: task.id });
  if (destination.kind === 'refused') {
    const { kind: _kind, ...refusal } = destination;
    return { ok: false, ...refusal };
  }
  const token = `${SSH_TOKEN_PREFIX}${randomBytes(32).toString('base64url')}`;
  const issued = await db.transaction(async (tx) => {
    // The run's row is locked: two requests of one run count each other's grants.
    const { job } = await activeRun(tx, runner, runId, body.generation, true);
    const active = await countActiveSshGrants(tx, job.id);
    if (active.count >= SHELL_GRANTS_PER_RUN) return { kind: 'refused' as const, firstExpiry: active.firstExpiry };
    const grant = await insertSshGrant(tx, {
      tokenHash: hashSecret(token),
      userId: runner.userId,
      workspaceId: destination.workspace.id,
      runnerId: runner.id,
      jobId: job.id,
      ttlMs: RUNNER_LIMITS.sshAccessTtlMs,
    });
    return { kind: 'granted' as const, grant };
  });
  if (issued.kind === 'refused') {
    const ends = issued.firstExpiry ? ` (the first ends at ${issued.firstExpiry.toISOString()})` : '';
    return {
      ok: false,
      message: `This run already holds ${SHELL_GRANTS_PER_RUN} workspace shell grants, the most one run may hold at once${ends}: keep using their tokens, or ask again once one has ended.`,
    };
  }
  const { grant } = issued;
  return {
    ok: true,
    workspaceId: destination.workspace.id,
    expiresAt: grant.expiresAt.toISOString(),
    ssh: { url: `${deps.publicUrl}${WORKSPACE_SHELL_PATH}`, token },
    markdown: workspaceMarkdown(destination.workspace, grant.expiresAt),
  };
}

/** The live grant a presented token stands for; null for anything else (malformed, unknown, expired, revoked). */
export async function authenticateShellToken(db: Db, token: string): Promise<SshGrantRow | null> {
  if (!TOKEN.test(token)) return null;
  return findActiveSshGrant(db, hashSecret(token));
}

/**
 * The shell script that runs the command and keeps at most `$2` bytes of each of its outputs: the rest is
 * read and dropped inside the sandbox, so that a command printing without end costs the service nothing
 * and still runs to its end (its exit code is the script's).
 */
const CAPPED_SHELL = [
  'd=$(mktemp -d) && mkfifo "$d/out" "$d/err" || exit 125',
  '{ head -c "$2"; cat >/dev/null; } <"$d/out" & o=$!',
  '{ head -c "$2" >&2; cat >/dev/null; } <"$d/err" & e=$!',
  'sh -c "$1" >"$d/out" 2>"$d/err"',
  'c=$?',
  'wait "$o" "$e"',
  'rm -rf "$d"',
  'exit "$c"',
].join('\n');

/** An output cut to the cap, and whether it went past it (the script keeps one byte more to tell). */
function capped(text: string): { text: string; truncated: boolean } {
  const bytes = Buffer.from(text, 'utf8');
  if (bytes.length <= RUNNER_LIMITS.shellOutputBytes) return { text, truncated: false };
  return { text: bytes.subarray(0, RUNNER_LIMITS.shellOutputBytes).toString('utf8'), truncated: true };
}

export interface WorkspaceShellsOptions {
  db: Db;
  environments: Environments;
  dataDir: string;
  /** The service's sandbox policy: what every sandboxed process may see and use. */
  policy: SandboxPolicy;
}

/**
 * Runs the commands of grants in their forks. Commands of one grant run one after the other in this
 * process: overlayfs does not take two mounts of one upper directory at once. (A grant used through
 * several server processes on one host at once is not serialised across them.)
 */
export class WorkspaceShells {
  private readonly lanes = new CommandLanes(SHELL_QUEUED_COMMANDS);

  constructor(private readonly options: WorkspaceShellsOptions) {}

  /** Whether the grant has no room for another command: its request is refused before its body is read. */
  busy(grantId: string): boolean {
    return this.lanes.full(grantId);
  }

  async run(grant: SshGrantRow, body: WorkspaceShellBody): Promise<WorkspaceShellResponse> {
    const { db } = this.options;
    return this.lanes.run(grant.id, async () => {
      // Checked when its turn comes: a command that waited may find its grant (or its user) gone.
      if (!(await isSshGrantActive(db, grant.id))) throw new AppError('unauthorized', SHELL_UNAUTHORIZED);
      const workspace = await findWorkspace(db, grant.workspaceId);
      if (!workspace || !(await findMembership(db, grant.workspaceId, grant.userId))) {
        throw new AppError('forbidden', "The grant's user is no longer a member of its workspace");
      }
      const fork = await this.forkOf(grant, workspace);
      const result = await fork.run(['sh', '-c', CAPPED_SHELL, 'sh', body.command, String(RUNNER_LIMITS.shellOutputBytes + 1)], {
        stdin: body.stdin ?? '',
        timeoutMs: body.timeoutSeconds * 1000,
        network: this.networkOf(workspace.id, fork),
      });
      const stdout = capped(result.stdout);
      const stderr = capped(result.stderr);
      return {
        exitCode: result.exitCode,
        stdout: stdout.text,
        stderr: stderr.text,
        timedOut: result.timedOut,
        stdoutTruncated: stdout.truncated,
        stderrTruncated: stderr.truncated,
      };
    });
  }

  /** The environment config's network policy of the version the fork was made from (off when it is broken). */
  private networkOf(workspaceId: string, fork: Fork): boolean {
    const version = this.options.environments.store(workspaceId).read(fork.info.lower.version);
    try {
      return parseEnvironmentConfig(version?.record.config ?? null).network;
    } catch {
      return false;
    }
  }

  /** The grant's fork: kept from its first command on, made of the environment's current version then. */
  private async forkOf(grant: SshGrantRow, workspace: Workspace): Promise<Fork> {
    const manager = new ForkManager(join(shellForksRoot(this.options.dataDir), workspace.id), this.options.policy);
    const dir = manager.dirOf(grant.id);
    if (existsSync(dir)) {
      const fork = await manager.open(grant.id, existsSync(join(dir, 'upper')) ? 'overlay' : 'clone');
      if (fork) return fork;
    }
    // Whatever a crash left half made goes; the grant's files start from the environment again.
    await manager.removeAll(grant.id);
    return manager.create(grant.id, await this.options.environments.ensure(workspace));
  }
}

/** 429 for a command its grant has no room for. */
export function shellBusy(waiting: number): AppError {
  return new AppError('rate_limited', `This grant already runs a command with ${waiting} more waiting; send this one once an answer came back`, {
    details: { retryAfterSeconds: SHELL_BUSY_RETRY_AFTER_SECONDS },
    headers: { 'retry-after': String(SHELL_BUSY_RETRY_AFTER_SECONDS) },
  });
}

const ignore = () => undefined;

/**
 * Work in lanes, one lane per key: a lane's work runs one at a time in arrival order, with at most
 * `waiting` more queued behind the one running. Work beyond that is refused at once (shellBusy).
 */
export class CommandLanes {
  private readonly lanes = new Map<string, { tail: Promise<void>; size: number }>();

  constructor(private readonly waiting: number) {}

  /** Whether the lane has a running piece of work and `waiting` more queued. */
  full(key: string): boolean {
    return (this.lanes.get(key)?.size ?? 0) > this.waiting;
  }

  run<T>(key: string, work: () => Promise<T>): Promise<T> {
    if (this.full(key)) return Promise.reject(shellBusy(this.waiting));
    let lane = this.lanes.get(key);
    if (!lane) this.lanes.set(key, (lane = { tail: Promise.resolve(), size: 0 }));
    const current = lane;
    current.size += 1;
    const next = current.tail.then(work);
    current.tail = next.then(ignore, ignore);
    void current.tail.then(() => {
      current.size -= 1;
      if (current.size === 0 && this.lanes.get(key) === current) this.lanes.delete(key);
    });
    return next;
  }
}

/**
 * Scheduler work: removes the forks of grants that ended (expired or revoked) longer ago than a command
 * may run, or that no longer exist. Answers how many went.
 */
export async function expireWorkspaceShells(input: { db: Db; dataDir: string }): Promise<{ removed: number }> {
  const root = shellForksRoot(input.dataDir);
  let removed = 0;
  if (!existsSync(root)) return { removed };
  for (const workspaceId of readdirSync(root)) {
    const dir = join(root, workspaceId);
    if (!isUuid(workspaceId)) continue;
    const names = [...new Set(readdirSync(dir).map((entry) => entry.replace(/\.(?:lower|restoring|tar\.gz)$/, '')))].filter(isUuid);
    const ended = await endedSshGrants(input.db, names, RUNNER_LIMITS.shellTimeoutSeconds * 1000);
    // Removing needs no sandbox: the policy is only there because forks are made with one.
    const manager = new ForkManager(dir, { hiddenPaths: [], allowUnsandboxed: false });
    for (const id of ended) {
      await manager.removeAll(id);
      removed += 1;
    }
  }
  return { removed };
}
