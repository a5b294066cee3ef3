/**
 * `svc runner pair`: connects this computer to the user's account (docs/runner-protocol.md, "Pairing and
 * enrollment"). The runner makes a private verifier and shows the signed-in user a link carrying its
 * challenge; the user brings back the pairing code the page shows; the runner enrolls with the code, the
 * verifier and a credential it made itself, and keeps the connection in its home (0600).
 *
 * Pairing again after the user revoked the connection reconnects it: same runner id and project
 * identities, a new credential, `reconnect` naming the old one. Pairing anew replaces a connection the
 * server no longer knows. Either is only allowed while nothing of the old connection runs here, which
 * holding the daemon's lock (and stopping any process group a crashed daemon left) makes sure of: a group
 * that survives its stop refuses the pairing. The old connection's local runs are dropped once the new one
 * is enrolled (the server finalizes them on a reconnect; a new runner cannot report them).
 */
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { challengeOf, generateRunnerCredential } from '../domain/runners.js';
import { EnrollBody, type EnrollmentReceipt } from '../protocol/runner.js';
import { runnerPlatform, runnerVersion } from './about.js';
import { RunnerClient, RunnerHttpError, type RunnerClientOptions } from './client.js';
import { discoverCapabilities } from './discovery.js';
import type { Connection, RunnerHome } from './home.js';
import { acquireRunnerLock } from './lock.js';
import { errorText } from './log.js';
import { registrationOf } from './projects.js';
import { ProcessGroupsSurviveError, RunRecords, type GroupControl } from './run-state.js';

export class PairingError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'PairingError';
  }
}

export interface PairOptions {
  home: RunnerHome;
  /** The REST base URL, ending in /api/v1. */
  server: string;
  name?: string;
  env: NodeJS.ProcessEnv;
  /** The link goes to the user: a line on stdout. */
  show: (line: string) => void;
  /** The pairing code the user brings back (from --code, or a line of stdin). */
  readCode: () => Promise<string>;
  /** Client seams (tests). */
  client?: Pick<RunnerClientOptions, 'sleep' | 'random' | 'timeoutMs' | 'maxAttempts'>;
  /** Process group seams (tests). */
  groups?: GroupControl;
}

export interface PairResult {
  receipt: EnrollmentReceipt;
  reconnected: boolean;
}

/** The page where the signed-in user turns the challenge into a pairing code. */
export function pairingUrl(server: string, challenge: string, name: string): string {
  const url = new URL('/pair-runner', new URL(server).origin);
  url.searchParams.set('challenge', challenge);
  url.searchParams.set('name', name);
  return url.toString();
}

/** What pairing must do about the connection the home already holds. */
async function previousConnection(options: PairOptions, existing: Connection): Promise<'replace' | 'reconnect'> {
  const client = new RunnerClient({ baseUrl: existing.server, credential: existing.credential, maxAttempts: 3, ...options.client });
  try {
    const identity = await client.identity();
    if (!identity.revoked) {
      throw new PairingError(
        `this computer is paired already (runner ${existing.runnerId} with ${existing.server}); revoke that connection first, or use another --home`,
      );
    }
  } catch (error) {
    if (error instanceof PairingError) throw error;
    // The server no longer knows the credential at all: nothing to reconnect, pair anew.
    if (error instanceof RunnerHttpError && error.status === 401) return 'replace';
    throw new PairingError(`cannot check the current connection with ${existing.server}: ${errorText(error)}`);
  }
  if (existing.server !== options.server) {
    throw new PairingError(`the revoked connection belongs to ${existing.server}; pair again with --server ${existing.server}`);
  }
  return 'reconnect';
}

export async function pair(options: PairOptions): Promise<PairResult> {
  const { home } = options;
  home.ensure();
  const name = options.name?.trim() || hostname() || 'computer';
  const existing = home.readConnection();
  const mode = existing ? await previousConnection(options, existing) : 'replace';
  // Reconnecting or replacing, nothing of the old connection may run meanwhile: a daemon holding the
  // lock makes pairing fail, and what a crashed one left running is stopped.
  const lock = acquireRunnerLock(home.lockFile, home.dir);
  try {
    const records = new RunRecords(home, undefined, options.groups);
    for (const runId of records.runIds()) {
      try {
        await records.stopGroups(runId);
      } catch (error) {
        // Its folder (and the groups' files) would go once enrolled: nothing could stop them after that.
        if (error instanceof ProcessGroupsSurviveError) throw new PairingError(`${error.message}; pairing again drops that run, so try again once they are gone`);
        throw error;
      }
    }

    const verifier = randomBytes(32).toString('base64url');
    options.show(pairingUrl(options.server, challengeOf(verifier), name));
    const code = (await options.readCode()).trim();
    if (!code) throw new PairingError('no pairing code was given');

    const discovery = await discoverCapabilities(home, options.env);
    const version = runnerVersion();
    const credential = generateRunnerCredential();
    const body = EnrollBody.safeParse({
      pairingCode: code,
      verifier,
      credential,
      name,
      platform: runnerPlatform(),
      ...(version ? { runnerVersion: version } : {}),
      capabilities: discovery.capabilities,
      projects: home.readProjects().map(registrationOf),
      ...(mode === 'reconnect' && existing ? { reconnect: { runnerId: existing.runnerId, credential: existing.credential, stopped: true as const } } : {}),
    });
    if (!body.success) throw new PairingError(`cannot enroll: ${body.error.issues.map((issue) => `${issue.path.join('.')} ${issue.message}`).join('; ')}`);
    // A retry after a lost answer carries the same credential and gets the same receipt.
    const client = new RunnerClient({ baseUrl: options.server, maxAttempts: 5, ...options.client });
    const receipt = await client.enroll(body.data);
    home.writeConnection({
      server: options.server,
      runnerId: receipt.runnerId,
      userId: receipt.userId,
      workspaceId: receipt.workspaceId,
      name: receipt.name,
      credential,
      heartbeatIntervalMs: receipt.heartbeatIntervalMs,
      enrolledAt: receipt.enrolledAt,
    });
    // Reconnecting, the server finalized the old connection's claimed runs; replacing, they belong to a
    // runner the new credential cannot speak for. Either way nothing of them is left to report from here.
    for (const runId of records.runIds()) records.remove(runId);
    return { receipt, reconnected: mode === 'reconnect' };
  } finally {
    lock.release();
  }
}
