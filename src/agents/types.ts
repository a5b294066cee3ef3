/**
 * The harness interface: every agent (the built-in loop, agent CLIs) takes a run manifest and reports
 * normalized events, which the executor writes to the job journal.
 */
import type { AgentId } from '../domain/agents.js';
import type { Effort, TaskMode } from '../protocol/rest.js';
import type { PermissionMode, Question, QuestionAnswer } from '../protocol/runner.js';

/** The event vocabulary every harness emits (journal `kind` and `data`). */
export type AgentEvent =
  | { kind: 'message'; data: { text: string } }
  | { kind: 'tool_call'; data: { id: string; name: string; input: unknown } }
  | { kind: 'tool_result'; data: { id: string; name: string; output: string; isError: boolean } }
  | { kind: 'usage'; data: { inputTokens: number; outputTokens: number } }
  | { kind: 'question'; data: { question: string } }
  | { kind: 'plan'; data: { plan: string } }
  | { kind: 'final'; data: { answer: string } }
  | { kind: 'error'; data: { message: string } }
  /** Written by the executor around the harness: a check's run (the proof), a pushed pull request. */
  | { kind: 'check'; data: { round: number; repository: string; name: string; command: string; passed: boolean; exitCode: number | null; timedOut: boolean; durationMs: number; outputTail: string } }
  | { kind: 'pull_request'; data: { repository: string; number: number; url: string; branch: string; head: string; opened: boolean } };

/** What the agent may do to the workspace: implemented over a sandboxed fork. */
export interface Workspace {
  listFiles(path: string): Promise<string>;
  readFile(path: string): Promise<string>;
  writeFile(path: string, content: string): Promise<void>;
  search(pattern: string, path: string): Promise<string>;
  runCommand(command: string, timeoutMs: number): Promise<{ exitCode: number | null; output: string; timedOut: boolean }>;
  /**
   * Runs a program (argv, no shell) and hands each line of its standard output to `onLine` as it comes:
   * how CLI harnesses read an agent CLI's JSON stream. Resolves when its process group is gone.
   */
  runStreaming(
    argv: readonly string[],
    options: {
      env?: Record<string, string>;
      timeoutMs: number;
      network?: boolean;
      /** A host directory of unix sockets, the program's only way out of a private network (sandbox/fork.ts `egressDir`). */
      egressDir?: string;
      stdin?: string;
      onLine: (line: string) => void;
    },
  ): Promise<{ exitCode: number | null; stderr: string; timedOut: boolean }>;
}

export interface RunManifest {
  /** The message that queued the job (trigger stripped). */
  input: string;
  /** Earlier turns of the task's thread, oldest first. */
  history: Array<{ role: 'user' | 'assistant'; content: string }>;
  mode: TaskMode;
  agent: AgentId;
  effort: Effort;
  instructions: string | null;
  workspace: Workspace;
  signal?: AbortSignal;
  /**
   * A person who answers while the run goes on: a desktop runner's owner. Without it (the cloud) nobody
   * is asked, every tool runs, and `ask_user` ends the run with a question.
   */
  interaction?: Interaction;
}

/** What the built-in loop asks a person, and how the person answers (docs/runner-protocol.md, permissions). */
export interface Interaction {
  /** `full`: nothing asks; `auto`: running a command asks; `ask`: every tool that writes or runs asks. */
  permissionMode: PermissionMode;
  /** Resolves with the person's decision; the tool that asked waits for it. */
  request(ask: InteractionRequest): Promise<InteractionAnswer>;
}

export interface InteractionRequest {
  requestId: string;
  tool?: string;
  input?: unknown;
  /** A blocking question rather than a permission for a tool. */
  kind?: 'question';
  questions?: Question[];
}

export interface InteractionAnswer {
  decision: 'allow' | 'deny';
  answers?: QuestionAnswer[];
}

export type RunOutcome =
  | { status: 'completed'; answer: string }
  | { status: 'question'; question: string }
  | { status: 'plan'; plan: string }
  | { status: 'failed'; error: string };

export interface Harness {
  run(manifest: RunManifest, emit: (event: AgentEvent) => Promise<void>): Promise<RunOutcome>;
}
