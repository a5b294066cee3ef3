/**
 * `codex/<model>`: the Codex CLI (`codex exec --json`), inside the fork. Its stream (codex-rs
 * exec_events.rs): `thread.started`, `turn.started`, `item.started` / `item.updated` / `item.completed`
 * with items `agent_message`, `reasoning`, `command_execution`, `file_change`, `mcp_tool_call`,
 * `web_search`, `todo_list`, `plan`, `error`; then `turn.completed` (usage) or `turn.failed`; and `error`
 * for stream errors, which Codex may retry, so they fail the run only when no turn completed.
 *
 * Modes: ask and plan use Codex's own read-only sandbox; the others bypass its approvals and sandbox,
 * because the fork's bubblewrap sandbox is the isolation. Codex has no system-prompt flag, so the
 * instructions head the prompt (read from stdin). Reasoning summaries are not journaled: the event
 * vocabulary has no place for them. A `request_user_input` event, or a final `QUESTION:` message (see
 * cli-harness.ts), ends the run with a question.
 *
 * Credentials (cli-harness.ts): Codex's built-in `openai` provider reads OPENAI_BASE_URL (default
 * https://api.openai.com/v1, the same convention as the AI SDK's) and appends `/responses` (and `/models`
 * for its model list, the only other call its credential lease allows); it sends its key as
 * `Authorization: Bearer`.
 */
import { isReadOnlyMode, type AgentId } from '../domain/agents.js';
import { clip } from './builtin.js';
import {
  cliAccess,
  cliInstructions,
  cliPrompt,
  field,
  outcomeOfFinalText,
  runCli,
  type CliAccess,
  type CliCredentials,
  type ProviderRoute,
  type StreamTranslator,
} from './cli-harness.js';
import { EFFORT } from './effort.js';
import type { AgentEvent, Harness, RunManifest, RunOutcome } from './types.js';

const OPENAI: ProviderRoute = {
  keyVariable: 'OPENAI_API_KEY',
  // `codex exec` documents CODEX_API_KEY as its API-key login; older releases read OPENAI_API_KEY.
  alsoKeyVariables: ['CODEX_API_KEY'],
  baseUrlVariable: 'OPENAI_BASE_URL',
  defaultUpstream: 'https://api.openai.com/v1',
  credentialHeaders: (key) => ({ authorization: `Bearer ${key}` }),
  // The Responses API and the model list (`/models?client_version=…`): nothing else of the provider's.
  paths: ['POST /responses', 'GET /models'],
};

export class CodexHarness implements Harness {
  private readonly command: string;
  private readonly access: CliAccess;

  /** With a credential proxy, throws ModelConfigError when OPENAI_API_KEY is missing. */
  constructor(agent: AgentId, env: NodeJS.ProcessEnv, credentials: CliCredentials) {
    this.command = env.SVC_CODEX_COMMAND || 'codex';
    this.access = cliAccess(env, `${agent.provider}/${agent.model}`, OPENAI, credentials);
  }

  run(manifest: RunManifest, emit: (event: AgentEvent) => Promise<void>): Promise<RunOutcome> {
    const argv = [
      'exec',
      '--json',
      '--model', manifest.agent.model,
      // /workspace holds the repositories; it is not one itself.
      '--skip-git-repo-check',
      ...(isReadOnlyMode(manifest.mode) ? ['--sandbox', 'read-only'] : ['--dangerously-bypass-approvals-and-sandbox']),
      '-c', `model_reasoning_effort=${EFFORT[manifest.effort].reasoning}`,
      '-',
    ];
    return runCli(
      {
        label: 'Codex',
        command: this.command,
        commandVariable: 'SVC_CODEX_COMMAND',
        install: '`npm install -g @openai/codex`',
        argv,
        env: {},
        access: this.access,
        stdin: `${cliInstructions(manifest)}\n\n${cliPrompt(manifest)}`,
        translator: new CodexStream(manifest),
      },
      manifest,
      emit,
    );
  }
}

export class CodexStream implements StreamTranslator {
  /** Items whose call was journaled at `item.started`, so `item.completed` adds only the result. */
  private readonly called = new Set<string>();
  private lastMessage = '';
  private plan: string | null = null;
  private question: string | null = null;
  private failure: string | null = null;
  private readonly errors: string[] = [];
  private completed = false;

  constructor(private readonly manifest: RunManifest) {}

  translate(message: Record<string, unknown>): AgentEvent[] {
    const item = field.record(message, 'item');
    switch (message.type) {
      case 'item.started':
        return item ? this.call(item) : [];
      case 'item.completed':
        return item ? this.completeItem(item) : [];
      case 'turn.completed': {
        this.completed = true;
        const usage = field.record(message, 'usage');
        return [{ kind: 'usage', data: { inputTokens: field.number(usage, 'input_tokens') ?? 0, outputTokens: field.number(usage, 'output_tokens') ?? 0 } }];
      }
      case 'turn.failed':
        this.failure = field.string(field.record(message, 'error'), 'message') ?? 'the turn failed';
        return [];
      case 'error':
        this.errors.push(field.string(message, 'message') ?? 'unknown error');
        return [];
      case 'request_user_input': {
        const questions = field.array(message, 'questions').map((entry) => field.string(entry, 'question')).filter(Boolean);
        this.question = questions.join('\n') || null;
        return [];
      }
      default:
        return [];
    }
  }

  end(): { events: AgentEvent[]; outcome: RunOutcome | null } {
    if (this.failure) return { events: [], outcome: { status: 'failed', error: `Codex failed: ${this.failure}` } };
    if (this.question) return { events: [], outcome: { status: 'question', question: this.question } };
    if (this.completed) return { events: [], outcome: outcomeOfFinalText(this.manifest.mode, this.lastMessage, this.plan) };
    if (this.errors.length) return { events: [], outcome: { status: 'failed', error: `Codex failed: ${this.errors.join('; ')}` } };
    return { events: [], outcome: null };
  }

  private call(item: Record<string, unknown>): AgentEvent[] {
    const id = field.string(item, 'id') ?? '';
    const tool = toolOf(item);
    if (!tool || this.called.has(id)) return [];
    this.called.add(id);
    return [{ kind: 'tool_call', data: { id, ...tool } }];
  }

  private completeItem(item: Record<string, unknown>): AgentEvent[] {
    const text = field.string(item, 'text') ?? '';
    switch (item.type) {
      case 'agent_message':
        this.lastMessage = text;
        return text.trim() ? [{ kind: 'message', data: { text } }] : [];
      case 'plan':
        this.plan = text;
        return [];
      default: {
        const tool = toolOf(item);
        if (!tool) return [];
        const id = field.string(item, 'id') ?? '';
        return [...this.call(item), { kind: 'tool_result', data: { id, name: tool.name, ...resultOf(item) } }];
      }
    }
  }
}

/** The items that are tool calls, with the name and input they are journaled under. */
function toolOf(item: Record<string, unknown>): { name: string; input: unknown } | null {
  switch (item.type) {
    case 'command_execution':
      return { name: 'command_execution', input: { command: field.string(item, 'command') ?? '' } };
    case 'file_change':
      return { name: 'file_change', input: { changes: field.array(item, 'changes') } };
    case 'mcp_tool_call':
      return { name: `${field.string(item, 'server') ?? 'mcp'}.${field.string(item, 'tool') ?? 'unknown'}`, input: item.arguments ?? {} };
    case 'web_search':
      return { name: 'web_search', input: { query: field.string(item, 'query') ?? '' } };
    default:
      return null;
  }
}

function resultOf(item: Record<string, unknown>): { output: string; isError: boolean } {
  const status = field.string(item, 'status');
  switch (item.type) {
    case 'command_execution': {
      const exitCode = field.number(item, 'exit_code');
      const output = `exit code ${exitCode ?? 'unknown'}\n${field.string(item, 'aggregated_output') ?? ''}`;
      return { output: clip(output), isError: status !== 'completed' || exitCode !== 0 };
    }
    case 'file_change': {
      const changes = field.array(item, 'changes').map((change) => `${field.string(change, 'kind') ?? 'update'} ${field.string(change, 'path') ?? ''}`);
      return { output: changes.join('\n'), isError: status === 'failed' };
    }
    case 'mcp_tool_call': {
      const error = field.string(field.record(item, 'error'), 'message');
      const content = field.array(field.record(item, 'result'), 'content').map((part) => field.string(part, 'text') ?? '');
      return { output: clip(error ?? content.join('\n')), isError: status === 'failed' || error !== undefined };
    }
    default:
      return { output: '', isError: false };
  }
}
