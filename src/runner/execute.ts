/**
 * Executes one claimed run on this computer: its task's folder (worktree.ts), the harness its manifest
 * names (the same src/agents code as the cloud; agent CLIs with the user's own login), a local workspace
 * whose processes run as the user, and every harness event appended to the run's outbox.
 *
 * Permissions and questions: the built-in loop gets an `interaction` that appends a `permission` event
 * and waits for the matching `permission` control (the daemon hands controls over with `deliver`). Agent
 * CLIs in print mode cannot ask: they run with full access, so a run that writes is refused unless its
 * permission mode is `full` (read-only modes run as they are).
 */
import { isReadOnlyMode, parseAgentId } from '../domain/agents.js';
import { assertNever } from '../domain/errors.js';
import { harnessFor } from '../agents/registry.js';
import { localWorkspace } from '../agents/local-workspace.js';
import type { AgentEvent, Harness, Interaction, InteractionAnswer, RunOutcome as AgentOutcome } from '../agents/types.js';
import type { TaskMode } from '../protocol/rest.js';
import type { ControlMessage, RunManifest, RunOutcome, RunnerEvent } from '../protocol/runner.js';
import { BUILTIN_HARNESSES } from './discovery.js';
import type { RunnerHome } from './home.js';
import { errorText, type Log } from './log.js';
import type { RunOutbox } from './outbox.js';
import { backoffDelay, sleep } from './backoff.js';
import { ProcessGroupsSurviveError, type RunRecords } from './run-state.js';
import { prepareTaskFolder } from './worktree.js';

/** Why a run stopped before its harness ended by itself. */
export type StopReason = 'cancelled' | 'deleted' | 'shutdown';

export interface ExecutionContext {
  home: RunnerHome;
  records: RunRecords;
  /** The runner's environment: provider keys for the built-in loop, PATH for the CLIs. */
  env: NodeJS.ProcessEnv;
  log: Log;
}

export interface Execution {
  readonly manifest: RunManifest;
  /** Hands a control to the run; once it returns, the run has taken it (and the cursor may pass it). */
  deliver(control: ControlMessage): void;
  stop(reason: StopReason): void;
  /**
   * The run's outcome once the harness ended and its process groups are gone; null when it was stopped
   * for deletion or shutdown (nothing is reported then: a shutdown leaves the run `executing`, and the
   * next start reports it failed).
   */
  readonly done: Promise<RunOutcome | null>;
}

/** The limits of the completion receipt's texts. */
const TEXT_LIMIT = 1_000_000;
const ERROR_LIMIT = 100_000;

const cut = (text: string, limit: number) => (text.length <= limit ? text : `${text.slice(0, limit - 40)}\n… (cut: too long for the receipt)`);

/** The receipt's outcome of a harness's outcome. */
export function receiptOutcome(outcome: AgentOutcome, manifest: Pick<RunManifest, 'nativeMode'>): RunOutcome {
  const nativeMode = manifest.nativeMode ? { nativeMode: manifest.nativeMode } : {};
  switch (outcome.status) {
    case 'completed':
      return { status: 'completed', finalAnswer: cut(outcome.answer, TEXT_LIMIT), ...nativeMode };
    case 'question':
      return { status: 'completed', question: cut(outcome.question, TEXT_LIMIT), ...nativeMode };
    case 'plan':
      return { status: 'completed', plan: cut(outcome.plan, TEXT_LIMIT), planOutcome: manifest.nativeMode === 'plan' ? 'NATIVE' : 'READY', ...nativeMode };
    case 'failed':
      return { status: 'failed', error: cut(outcome.error, ERROR_LIMIT), ...nativeMode };
    default:
      return assertNever(outcome);
  }
}

/** The user's environment for the run's processes, without the runner's own settings. */
export function childEnvironment(env: NodeJS.ProcessEnv): Record<string, string> {
  return Object.fromEntries(
    Object.entries(env).filter((entry): entry is [string, string] => entry[1] !== undefined && !/^(SVC|SERVICE)_/.test(entry[0])),
  );
}

class RunFailure extends Error {}

export function startExecution(context: ExecutionContext, manifest: RunManifest, outbox: RunOutbox, onEvent: () => void): Execution {
  const controller = new AbortController();
  let stopReason: StopReason | null = null;
  const waiting = new Map<string, { resolve: (answer: InteractionAnswer) => void; reject: (error: Error) => void }>();

  const append = async (event: RunnerEvent) => {
    await outbox.append(event);
    onEvent();
  };
  const emit = (event: AgentEvent) => append({ kind: event.kind, data: event.data });

  const interaction: Interaction = {
    permissionMode: manifest.permissionMode,
    request: (ask) =>
      new Promise<InteractionAnswer>((resolve, reject) => {
        if (controller.signal.aborted) return reject(new Error('the run was stopped'));
        // Waiting before the event exists: the answer can only come after the server has it.
        waiting.set(ask.requestId, { resolve, reject });
        const data = Object.fromEntries(Object.entries(ask).filter(([, value]) => value !== undefined));
        append({ kind: 'permission', data }).catch((error: unknown) => {
          waiting.delete(ask.requestId);
          reject(error instanceof Error ? error : new Error(String(error)));
        });
      }),
  };

  const execute = async (): Promise<AgentOutcome> => {
    const agent = parseAgentId(`${manifest.harness}/${manifest.model}`);
    if ('error' in agent) throw new RunFailure(`the agent ${manifest.harness}/${manifest.model} cannot run: ${agent.error}`);
    if (manifest.resumeParked) throw new RunFailure('this runner keeps no parked session to resume');
    const project = context.home.readProjects().find((candidate) => candidate.id === manifest.projectId);
    if (!project) throw new RunFailure(`the project ${manifest.projectId} is not registered on this computer (svc runner project add)`);
    const mode: TaskMode = manifest.nativeMode === 'plan' ? 'plan' : manifest.mode;
    const builtin = (BUILTIN_HARNESSES as readonly string[]).includes(agent.provider);
    if (!builtin && !isReadOnlyMode(mode) && manifest.permissionMode !== 'full') {
      throw new RunFailure(
        `${agent.provider} runs unattended with full access on this computer and cannot ask for permission; ` +
          `start the task with permission mode "full", or use a built-in agent (openai, anthropic, openai-compatible) to be asked`,
      );
    }
    const folder = await prepareTaskFolder(context.home, project, manifest);
    let harness: Harness;
    try {
      harness = harnessFor(agent, context.env, { cliOwnLogin: true });
    } catch (error) {
      throw new RunFailure(errorText(error));
    }
    const inputContext = manifest.metadata?.inputContext;
    return harness.run(
      {
        input: inputContext ? `${manifest.input}\n\n${inputContext}` : manifest.input,
        history: manifest.history,
        mode,
        agent,
        effort: manifest.effort,
        // Local workers apply no custom system prompt (SPEC.md).
        instructions: null,
        workspace: localWorkspace(folder, { signal: controller.signal, env: childEnvironment(context.env), groupsDir: context.records.groupsDirOf(manifest.runId) }),
        signal: controller.signal,
        ...(builtin ? { interaction } : {}),
      },
      emit,
    );
  };

  /** Aborted by a shutdown, even of a run stopped before: no wait for its groups outlasts the daemon. */
  const shutdown = new AbortController();

  /**
   * Stops the run's process groups, trying again while any survives; false when a shutdown came first (the
   * record stays `executing` with the groups' files, and the next start stops them before reporting).
   */
  const stopAllGroups = async (): Promise<boolean> => {
    for (let attempt = 0; ; attempt++) {
      try {
        await context.records.stopGroups(manifest.runId);
        return true;
      } catch (error) {
        if (!(error instanceof ProcessGroupsSurviveError)) throw error;
        if (attempt === 0 || (attempt + 1) % 10 === 0) context.log(`run ${manifest.runId}: ${error.message}; it is not over until they are gone (trying again)`);
      }
      if (shutdown.signal.aborted) return false;
      try {
        await sleep(backoffDelay(attempt), shutdown.signal);
      } catch {
        return false;
      }
    }
  };

  const done = (async (): Promise<RunOutcome | null> => {
    let outcome: AgentOutcome;
    try {
      outcome = await execute();
    } catch (error) {
      const message = errorText(error);
      outcome = { status: 'failed', error: message };
      await emit({ kind: 'error', data: { message } }).catch((failure: unknown) => context.log(`run ${manifest.runId}: ${errorText(failure)}`));
    }
    // Whatever the harness left running goes before the run may report that its processes stopped.
    if (!(await stopAllGroups())) return null;
    if (stopReason === 'cancelled') return { status: 'cancelled', ...(manifest.nativeMode ? { nativeMode: manifest.nativeMode } : {}) };
    if (stopReason) return null;
    return receiptOutcome(outcome, manifest);
  })();

  return {
    manifest,
    done,
    deliver(control) {
      switch (control.type) {
        case 'permission': {
          const waiter = waiting.get(control.requestId);
          if (!waiter) {
            context.log(`run ${manifest.runId}: an answer to ${control.requestId}, which nothing waits for, was skipped`);
            return;
          }
          waiting.delete(control.requestId);
          waiter.resolve({ decision: control.decision, ...(control.answers ? { answers: control.answers } : {}) });
          return;
        }
        case 'async_question_answer':
        case 'finish_background_wait':
          // Not declared in nativeControls, so the server sends neither; one that comes anyway is skipped.
          context.log(`run ${manifest.runId}: a ${control.type} control was skipped (not supported here)`);
          return;
        default:
          assertNever(control);
      }
    },
    stop(reason) {
      if (reason === 'shutdown') shutdown.abort(new Error('the runner is stopping'));
      if (stopReason) return;
      stopReason = reason;
      controller.abort(new Error(`the run was stopped (${reason})`));
      for (const waiter of waiting.values()) waiter.reject(new Error(`the run was stopped (${reason})`));
      waiting.clear();
    },
  };
}
