/**
 * `claude-code/<model>`: the Claude Code CLI in print mode (`claude -p --output-format stream-json
 * --verbose`), inside the fork. Its stream: a `system` init line, `assistant` messages whose content holds
 * `text` and `tool_use` blocks, `user` messages holding the `tool_result` blocks, and one closing `result`
 * (subtype `success`, `error_max_turns`, `error_during_execution`…, `is_error`, `usage`, `total_cost_usd`).
 *
 * Modes: ask and plan run in Claude Code's read-only `plan` permission mode; the others bypass its
 * permission prompts (nobody could answer them) because the fork's bubblewrap sandbox is the isolation.
 * In plan mode the plan is the input of the `ExitPlanMode` call, which print mode denies, so the run ends.
 * `AskUserQuestion` is disallowed: print mode would deny it anyway; questions follow cli-harness.ts.
 *
 * Credentials (cli-harness.ts): Claude Code reads ANTHROPIC_BASE_URL and sends ANTHROPIC_API_KEY as
 * `x-api-key`; the Anthropic SDK inside it appends `/v1/messages` (and `/v1/messages/count_tokens`,
 * `/v1/models`) to the base URL. Those are the only calls its credential lease allows.
 */
import { isReadOnlyMode, type AgentId } from '../domain/agents.js';
import { clip } from './builtin.js';
import {
  cliAccess,
  cliInstructions,
  cliPrompt,
  field,
  isRecord,
  outcomeOfFinalText,
  runCli,
  type CliAccess,
  type CliCredentials,
  type ProviderRoute,
  type StreamTranslator,
} from './cli-harness.js';
import { EFFORT } from './effort.js';
import type { AgentEvent, Harness, RunManifest, RunOutcome } from './types.js';

const ANTHROPIC: ProviderRoute = {
  keyVariable: 'ANTHROPIC_API_KEY',
  baseUrlVariable: 'ANTHROPIC_BASE_URL',
  defaultUpstream: 'https://api.anthropic.com',
  // The service's ANTHROPIC_BASE_URL follows the AI SDK (built-in loop), which ends it in /v1 and appends
  // /messages; Claude Code's own paths start with /v1 already, so either spelling reaches the same endpoint.
  upstreamOf: (configured) => configured.replace(/\/+$/, '').replace(/\/v1$/, ''),
  credentialHeaders: (key) => ({ 'x-api-key': key }),
  // The Messages API, its token counting, and the model list: nothing else of the provider's.
  paths: ['POST /v1/messages', 'POST /v1/messages/count_tokens', 'GET /v1/models'],
};

export class ClaudeCodeHarness implements Harness {
  private readonly command: string;
  private readonly access: CliAccess;

  /** With a credential proxy, throws ModelConfigError when ANTHROPIC_API_KEY is missing. */
  constructor(agent: AgentId, env: NodeJS.ProcessEnv, credentials: CliCredentials) {
    this.command = env.SVC_CLAUDE_CODE_COMMAND || 'claude';
    this.access = cliAccess(env, `${agent.provider}/${agent.model}`, ANTHROPIC, credentials);
  }

  run(manifest: RunManifest, emit: (event: AgentEvent) => Promise<void>): Promise<RunOutcome> {
    const budget = EFFORT[manifest.effort];
    const readOnly = isReadOnlyMode(manifest.mode);
    const argv = [
      '-p',
      '--output-format', 'stream-json',
      '--verbose',
      '--model', manifest.agent.model,
      '--max-turns', String(budget.steps),
      '--permission-mode', readOnly ? 'plan' : 'bypassPermissions',
      '--disallowedTools', 'AskUserQuestion',
      '--append-system-prompt', cliInstructions(manifest),
    ];
    // Claude Code refuses to bypass permissions as root unless told it is in a sandbox, which it is.
    const env = { MAX_THINKING_TOKENS: String(budget.thinkingTokens), ...(readOnly ? {} : { IS_SANDBOX: '1' }) };
    return runCli(
      {
        label: 'Claude Code',
        command: this.command,
        commandVariable: 'SVC_CLAUDE_CODE_COMMAND',
        install: '`npm install -g @anthropic-ai/claude-code`',
        argv,
        env,
        access: this.access,
        stdin: cliPrompt(manifest),
        translator: new ClaudeStream(manifest, budget.steps),
      },
      manifest,
      emit,
    );
  }
}

interface Tokens {
  inputTokens: number;
  outputTokens: number;
}

/** Cache writes and reads are input the model processed, so they count as input tokens. */
function tokensOf(usage: Record<string, unknown> | undefined): Tokens {
  const count = (key: string) => field.number(usage, key) ?? 0;
  return {
    inputTokens: count('input_tokens') + count('cache_creation_input_tokens') + count('cache_read_input_tokens'),
    outputTokens: count('output_tokens'),
  };
}

export class ClaudeStream implements StreamTranslator {
  private readonly toolNames = new Map<string, string>();
  private plan: string | null = null;
  private result: Record<string, unknown> | null = null;
  /** Per API message (one message may arrive as several lines), used only when no `result` arrives. */
  private readonly messageUsage = new Map<string, Tokens>();

  constructor(
    private readonly manifest: RunManifest,
    private readonly maxTurns: number,
  ) {}

  translate(message: Record<string, unknown>): AgentEvent[] {
    switch (message.type) {
      case 'assistant':
        return this.assistant(field.record(message, 'message'));
      case 'user':
        return this.toolResults(field.record(message, 'message'));
      case 'result':
        this.result = message;
        // The result's usage is the run's total; per-message usage repeats across a message's lines.
        return [{ kind: 'usage', data: tokensOf(field.record(message, 'usage')) }];
      default:
        return [];
    }
  }

  end(): { events: AgentEvent[]; outcome: RunOutcome | null } {
    if (this.result) return { events: [], outcome: this.outcome(this.result) };
    const total = [...this.messageUsage.values()].reduce((sum, tokens) => ({
      inputTokens: sum.inputTokens + tokens.inputTokens,
      outputTokens: sum.outputTokens + tokens.outputTokens,
    }), { inputTokens: 0, outputTokens: 0 });
    const events: AgentEvent[] = total.inputTokens || total.outputTokens ? [{ kind: 'usage', data: total }] : [];
    return { events, outcome: null };
  }

  private assistant(message: Record<string, unknown> | undefined): AgentEvent[] {
    const id = field.string(message, 'id');
    if (id) this.messageUsage.set(id, tokensOf(field.record(message, 'usage')));
    const events: AgentEvent[] = [];
    for (const block of field.array(message, 'content')) {
      const type = field.string(block, 'type');
      if (type === 'text') {
        const text = field.string(block, 'text') ?? '';
        if (text.trim()) events.push({ kind: 'message', data: { text } });
      } else if (type === 'tool_use') {
        const toolId = field.string(block, 'id') ?? '';
        const name = field.string(block, 'name') ?? 'unknown';
        const input = isRecord(block) ? (block.input ?? {}) : {};
        this.toolNames.set(toolId, name);
        const plan = field.string(input, 'plan');
        if (name === 'ExitPlanMode' && plan) this.plan = plan;
        events.push({ kind: 'tool_call', data: { id: toolId, name, input } });
      }
    }
    return events;
  }

  private toolResults(message: Record<string, unknown> | undefined): AgentEvent[] {
    return field
      .array(message, 'content')
      .filter((block) => field.string(block, 'type') === 'tool_result')
      .map((block): AgentEvent => {
        const id = field.string(block, 'tool_use_id') ?? '';
        const isError = isRecord(block) && block.is_error === true;
        return { kind: 'tool_result', data: { id, name: this.toolNames.get(id) ?? 'unknown', output: clip(resultText(block)), isError } };
      });
  }

  private outcome(result: Record<string, unknown>): RunOutcome {
    const subtype = field.string(result, 'subtype');
    const text = field.string(result, 'result') ?? '';
    if (subtype === 'success' && result.is_error !== true) return outcomeOfFinalText(this.manifest.mode, text, this.plan);
    if (subtype === 'error_max_turns') {
      const turns = field.number(result, 'num_turns') ?? this.maxTurns;
      return { status: 'failed', error: `Claude Code stopped after ${turns} turns without finishing (effort ${this.manifest.effort} allows ${this.maxTurns})` };
    }
    const errors = field.array(result, 'errors').filter((error): error is string => typeof error === 'string');
    return { status: 'failed', error: `Claude Code failed (${subtype ?? 'no subtype'}): ${errors.join('; ') || text || 'no details'}` };
  }
}

/** A tool result's content: a string, or blocks of which the text ones matter. */
function resultText(block: unknown): string {
  const content = isRecord(block) ? block.content : undefined;
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content.map((part) => field.string(part, 'text') ?? `[${field.string(part, 'type') ?? 'content'}]`).join('\n');
}
