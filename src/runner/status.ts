/** `svc runner status`: what the home holds and what the server says about it, read without changing anything. */
import { RunnerClient, RunnerHttpError } from './client.js';
import type { RunnerHome } from './home.js';
import { lockHolder } from './lock.js';
import { errorText } from './log.js';
import { RunOutbox } from './outbox.js';
import { RunRecords, type RunPhase } from './run-state.js';

export interface RunnerStatus {
  home: string;
  connection: { server: string; runnerId: string; workspaceId: string; name: string } | null;
  /** What `GET /identity` says; `unreachable` when it did not answer, `unknown` when it refused the credential. */
  identity: { revoked: boolean; workspaceId: string } | 'unreachable' | 'unknown' | null;
  /** The daemon holding the home's lock, if one runs. */
  daemonPid: number | null;
  projects: Array<{ id: string; name: string; path: string; projectless: boolean; repositories: string[] }>;
  /**
   * Runs in progress here. One with a `problem` (its record or outbox is damaged) is quarantined: the
   * daemon leaves it alone; what its damaged record would say is null.
   */
  runs: Array<{
    runId: string;
    taskId: string | null;
    taskSlug: string | null;
    generation: number | null;
    phase: RunPhase | null;
    outcome: string | null;
    pendingEvents: number | null;
    pendingBytes: number | null;
    problem?: string;
  }>;
  /** Run folders the daemon moved aside because their state was damaged (their runs were reported failed). */
  quarantined: Array<{ runId: string; path: string }>;
}

export async function runnerStatus(home: RunnerHome, options: { timeoutMs?: number } = {}): Promise<RunnerStatus> {
  const connection = home.readConnection();
  let identity: RunnerStatus['identity'] = null;
  if (connection) {
    try {
      const client = new RunnerClient({ baseUrl: connection.server, credential: connection.credential, maxAttempts: 1, timeoutMs: options.timeoutMs ?? 5_000 });
      const answer = await client.identity();
      identity = { revoked: answer.revoked, workspaceId: answer.workspaceId };
    } catch (error) {
      identity = error instanceof RunnerHttpError && error.status === 401 ? 'unknown' : 'unreachable';
    }
  }
  const records = new RunRecords(home);
  const runs: RunnerStatus['runs'] = [];
  const scanned = records.scan();
  for (const { runId, problem } of scanned.damaged) {
    runs.push({ runId, taskId: null, taskSlug: null, generation: null, phase: null, outcome: null, pendingEvents: null, pendingBytes: null, problem: `the run record is damaged: ${problem}` });
  }
  for (const record of scanned.records) {
    let backlog: { entries: number | null; bytes: number | null; problem?: string };
    try {
      backlog = RunOutbox.inspect(records.dirOf(record.manifest.runId), record.manifest.eventsStored);
    } catch (error) {
      backlog = { entries: null, bytes: null, problem: errorText(error) };
    }
    runs.push({
      runId: record.manifest.runId,
      taskId: record.manifest.taskId,
      taskSlug: record.manifest.taskSlug,
      generation: record.manifest.generation,
      phase: record.phase,
      outcome: record.outcome?.status ?? null,
      pendingEvents: backlog.entries,
      pendingBytes: backlog.bytes,
      ...(backlog.problem ? { problem: backlog.problem } : {}),
    });
  }
  return {
    home: home.dir,
    connection: connection ? { server: connection.server, runnerId: connection.runnerId, workspaceId: connection.workspaceId, name: connection.name } : null,
    identity,
    daemonPid: lockHolder(home.lockFile),
    projects: home.readProjects().map((project) => ({
      id: project.id,
      name: project.name,
      path: project.path,
      projectless: project.repositories.length === 0,
      repositories: project.repositories.map((repository) => repository.name),
    })),
    runs,
    quarantined: records.quarantined(),
  };
}
