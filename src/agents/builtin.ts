/**
 * The built-in harness: an agent loop on the AI SDK with file, search and shell tools inside the
 * sandboxed fork, plus `ask_user`, `submit_plan` and `finish`, which end the run.
 *
 * With an `interaction` (a desktop runner, whose owner answers while the run goes on), tools that write
 * or run ask first as the permission mode says, a denied tool tells the model so and the run goes on, and
 * `ask_user` waits for the answer instead of ending the run. Without one (the cloud) nothing asks.
 */
import { randomUUID } from 'node:crypto';
import { generateText, hasToolCall, stepCountIs, tool, type LanguageModel, type ModelMessage, type ToolSet } from 'ai';
import { z } from 'zod';
import type { TaskMode } from '../protocol/rest.js';
import { isReadOnlyMode } from '../domain/agents.js';
import { assertNever } from '../domain/errors.js';
import { EFFORT, modelCallSettings } from './effort.js';
import type { AgentEvent, Harness, Interaction, RunManifest, RunOutcome, Workspace } from './types.js';

const OUTPUT_LIMIT = 20_000;
const COMMAND_TIMEOUT_MS = 10 * 60_000;
export const DENIED_BY_USER = 'denied by the user';

/** What a tool does that a person may have to allow: write files or run commands. */
type Effect = 'write' | 'run';

function asksFirst(interaction: Interaction, effect: Effect): boolean {
  switch (interaction.permissionMode) {
    case 'full':
      return false;
    case 'auto':
      return effect === 'run';
    case 'ask':
      return true;
    default:
      return assertNever(interaction.permissionMode);
  }
}

/** Keeps a tool's output within what is worth journaling and showing the model again. */
export const clip = (text: string): string =>
  text.length <= OUTPUT_LIMIT ? text : `${text.slice(0, OUTPUT_LIMIT)}\n… (${text.length - OUTPUT_LIMIT} more characters cut)`;

const MODE_PROMPT: Record<TaskMode, string> = {
  agent:
    'Implement the requested change in the repositories under /workspace, then verify it (tests, lint, types, build) ' +
    'with run_command. When it is done and verified, call finish with a summary of what you changed and the proof.',
  plan:
    'Research the request without changing files, then call submit_plan with a step-by-step plan in Markdown. ' +
    'Implementation starts only after a person approves the plan.',
  ask: 'Answer the question from the code under /workspace without changing anything. Call finish with the answer.',
  goal:
    'Work towards the goal in /workspace, checking it with run_command after each change, until the goal holds. ' +
    'Then call finish with the evidence.',
  dev_env:
    'Repair the development environment under /workspace (setup commands, dependencies, dev servers) so that it ' +
    'installs and runs cleanly. Call finish with what you repaired.',
};

export interface BuiltinOptions {
  model: (manifest: RunManifest) => LanguageModel;
  maxRetries?: number;
}

export class BuiltinHarness implements Harness {
  constructor(private readonly options: BuiltinOptions) {}

  async run(manifest: RunManifest, emit: (event: AgentEvent) => Promise<void>): Promise<RunOutcome> {
    let ending: RunOutcome | null = null;
    const tools = this.tools(manifest.workspace, manifest.mode, emit, (outcome) => (ending = outcome), manifest.interaction);
    const messages: ModelMessage[] = [
      ...manifest.history.map((turn) => ({ role: turn.role, content: turn.content }) as ModelMessage),
      { role: 'user', content: manifest.input },
    ];
    const maxSteps = EFFORT[manifest.effort].steps;
    try {
      const result = await generateText({
        model: this.options.model(manifest),
        ...modelCallSettings(manifest.agent, manifest.effort),
        system: [MODE_PROMPT[manifest.mode], manifest.instructions].filter(Boolean).join('\n\n'),
        messages,
        tools,
        // A question ends the run unless someone answers while it goes on.
        stopWhen: [stepCountIs(maxSteps), hasToolCall('finish'), ...(manifest.interaction ? [] : [hasToolCall('ask_user')]), hasToolCall('submit_plan')],
        maxRetries: this.options.maxRetries ?? 2,
        ...(manifest.signal ? { abortSignal: manifest.signal } : {}),
        onStepFinish: async (step) => {
          if (step.text.trim()) await emit({ kind: 'message', data: { text: step.text } });
          await emit({ kind: 'usage', data: { inputTokens: step.usage.inputTokens ?? 0, outputTokens: step.usage.outputTokens ?? 0 } });
        },
      });
      if (ending) return ending;
      if (result.finishReason === 'stop' && result.text.trim()) {
        await emit({ kind: 'final', data: { answer: result.text } });
        return { status: 'completed', answer: result.text };
      }
      const error = `the agent stopped after ${result.steps.length} steps without finishing (effort ${manifest.effort} allows ${maxSteps})`;
      await emit({ kind: 'error', data: { message: error } });
      return { status: 'failed', error };
    } catch (error) {
      const message = error instanceof Error ? error.message : String(error);
      await emit({ kind: 'error', data: { message } });
      return { status: 'failed', error: `model call failed: ${message}` };
    }
  }

  private tools(
    workspace: Workspace,
    mode: TaskMode,
    emit: (event: AgentEvent) => Promise<void>,
    end: (outcome: RunOutcome) => void,
    interaction: Interaction | undefined,
  ): ToolSet {
    /**
     * Wraps a tool's work so that its call and result land in the journal, errors included; a tool with an
     * effect asks the person first when the permission mode says so.
     */
    const traced = <T>(name: string, work: (input: T) => Promise<string>, effect?: Effect) => async (input: T, { toolCallId }: { toolCallId: string }) => {
      await emit({ kind: 'tool_call', data: { id: toolCallId, name, input } });
      try {
        if (effect && interaction && asksFirst(interaction, effect)) {
          const answer = await interaction.request({ requestId: randomUUID(), tool: name, input });
          if (answer.decision !== 'allow') {
            await emit({ kind: 'tool_result', data: { id: toolCallId, name, output: DENIED_BY_USER, isError: true } });
            return DENIED_BY_USER;
          }
        }
        const output = clip(await work(input));
        await emit({ kind: 'tool_result', data: { id: toolCallId, name, output, isError: false } });
        return output;
      } catch (error) {
        const output = `error: ${error instanceof Error ? error.message : String(error)}`;
        await emit({ kind: 'tool_result', data: { id: toolCallId, name, output, isError: true } });
        return output;
      }
    };
    const readOnly = isReadOnlyMode(mode);
    const Path = z.string().describe('Path relative to /workspace');
    const set: ToolSet = {
      list_files: tool({
        description: 'List files and directories under a path (two levels deep).',
        inputSchema: z.object({ path: Path.default('.') }),
        execute: traced('list_files', ({ path }: { path: string }) => workspace.listFiles(path)),
      }),
      read_file: tool({
        description: 'Read a text file.',
        inputSchema: z.object({ path: Path }),
        execute: traced('read_file', ({ path }: { path: string }) => workspace.readFile(path)),
      }),
      search: tool({
        description: 'Search file contents for a regular expression (grep -rn).',
        inputSchema: z.object({ pattern: z.string().min(1), path: Path.default('.') }),
        execute: traced('search', ({ pattern, path }: { pattern: string; path: string }) => workspace.search(pattern, path)),
      }),
      run_command: tool({
        description: 'Run a shell command in /workspace; answers its exit code and output.',
        inputSchema: z.object({ command: z.string().min(1) }),
        execute: traced('run_command', async ({ command }: { command: string }) => {
          const result = await workspace.runCommand(command, COMMAND_TIMEOUT_MS);
          return `${result.timedOut ? 'timed out' : `exit code ${result.exitCode}`}\n${result.output}`;
        }, 'run'),
      }),
      ask_user: tool({
        description: interaction
          ? 'Ask the person a clarifying question and wait for the answer, which this tool returns.'
          : 'Ask the person a clarifying question; the run ends and their reply continues the task.',
        inputSchema: z.object({ question: z.string().min(1) }),
        execute: traced('ask_user', async ({ question }: { question: string }) => {
          if (interaction) return askAndWait(interaction, question);
          await emit({ kind: 'question', data: { question } });
          end({ status: 'question', question });
          return 'The question was sent; stop here.';
        }),
      }),
      finish: tool({
        description: 'End the run with the final answer or summary.',
        inputSchema: z.object({ summary: z.string().min(1) }),
        execute: traced('finish', async ({ summary }: { summary: string }) => {
          await emit({ kind: 'final', data: { answer: summary } });
          end({ status: 'completed', answer: summary });
          return 'Done.';
        }),
      }),
    };
    if (mode === 'plan') {
      set.submit_plan = tool({
        description: 'Submit the implementation plan for approval; the run ends.',
        inputSchema: z.object({ plan: z.string().min(1) }),
        execute: traced('submit_plan', async ({ plan }: { plan: string }) => {
          await emit({ kind: 'plan', data: { plan } });
          end({ status: 'plan', plan });
          return 'The plan was submitted for approval; stop here.';
        }),
      });
    }
    if (!readOnly) {
      set.write_file = tool({
        description: 'Create or overwrite a file with the given content.',
        inputSchema: z.object({ path: Path, content: z.string() }),
        execute: traced('write_file', async ({ path, content }: { path: string; content: string }) => {
          await workspace.writeFile(path, content);
          return `wrote ${Buffer.byteLength(content)} bytes to ${path}`;
        }, 'write'),
      });
      set.edit_file = tool({
        description: 'Replace one exact occurrence of `old` with `new` in a file.',
        inputSchema: z.object({ path: Path, old: z.string().min(1), new: z.string() }),
        execute: traced('edit_file', async ({ path, old, new: replacement }: { path: string; old: string; new: string }) => {
          const text = await workspace.readFile(path);
          const count = text.split(old).length - 1;
          if (count !== 1) throw new Error(`\`old\` occurs ${count} times in ${path}; it must occur exactly once`);
          await workspace.writeFile(path, text.replace(old, () => replacement));
          return `edited ${path}`;
        }, 'write'),
      });
    }
    return set;
  }
}

/** `ask_user` with someone to answer: one free-text question, and its answer is the tool's result. */
async function askAndWait(interaction: Interaction, question: string): Promise<string> {
  const answer = await interaction.request({
    requestId: randomUUID(),
    kind: 'question',
    questions: [{ id: 'answer', question, options: [], multiple: false, allowCustom: true }],
  });
  if (answer.decision !== 'allow') return 'The person skipped the question; go on without their answer.';
  const text = answer.answers?.find((entry) => entry.questionId === 'answer')?.values.join('\n') ?? '';
  return text.trim() ? text : 'The person gave no answer; go on without it.';
}
