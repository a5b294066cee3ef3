import { execFileSync } from 'node:child_process';
import { chmodSync, copyFileSync, mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { BuiltinHarness } from '../src/agents/builtin.js';
import { ClaudeCodeHarness } from '../src/agents/claude-code.js';
import { CodexHarness } from '../src/agents/codex.js';
import { forkWorkspace } from '../src/agents/fork-workspace.js';
import { ModelConfigError } from '../src/agents/models.js';
import { harnessFor } from '../src/agents/registry.js';
import type { AgentEvent, RunManifest } from '../src/agents/types.js';
import { parseAgentId, type AgentId } from '../src/domain/agents.js';
import { ForkManager, type Fork } from '../src/sandbox/fork.js';

const fixtures = join(import.meta.dirname, 'fixtures', 'agents');
const root = mkdtempSync(join(tmpdir(), 'svc-cli-'));
const environment = join(root, 'environments', 'acme');
const forks = new ForkManager(join(root, 'forks'), { hiddenPaths: [join(root, 'environments'), join(root, 'forks')], allowUnsandboxed: false });
const claude = parseAgentId('claude-code/claude-sonnet-4-5') as AgentId;
const codex = parseAgentId('codex/gpt-5-codex') as AgentId;
const env = {
  ANTHROPIC_API_KEY: 'sk-ant-test',
  OPENAI_API_KEY: 'sk-openai-test',
  SVC_CLAUDE_CODE_COMMAND: '/workspace/.bin/claude',
  SVC_CODEX_COMMAND: '/workspace/.bin/codex',
};
let forkCount = 0;

// A stand-in for both CLIs inside the sandbox: it records how it was called, replays the stream the test
// put next to it, and can fail on stderr, exit with a code, or hang (to be stopped).
const FAKE_CLI = `#!/bin/sh
mkdir -p /workspace/.calls
printf '%s\\0' "$@" > /workspace/.calls/argv
env | sort > /workspace/.calls/env
cat > /workspace/.calls/stdin
cat /workspace/.bin/stream.jsonl
if [ -f /workspace/.bin/stderr ]; then cat /workspace/.bin/stderr >&2; fi
if [ -f /workspace/.bin/hang ]; then sleep 61.7; fi
exit "$(cat /workspace/.bin/exit-code 2>/dev/null || echo 0)"
`;

beforeAll(() => {
  mkdirSync(join(environment, 'app'), { recursive: true });
  mkdirSync(join(environment, '.bin'));
  writeFileSync(join(environment, 'app', 'greeting.txt'), 'hello\n');
  for (const name of ['claude', 'codex']) {
    writeFileSync(join(environment, '.bin', name), FAKE_CLI);
    chmodSync(join(environment, '.bin', name), 0o755);
  }
});

interface Scenario {
  fixture: string;
  agent?: AgentId;
  harnessEnv?: NodeJS.ProcessEnv;
  files?: Record<string, string>;
  abortAfterMs?: number;
  manifest?: Partial<RunManifest>;
}

async function run({ fixture, agent = claude, harnessEnv = env, files = {}, abortAfterMs, manifest = {} }: Scenario) {
  const fork: Fork = await forks.create(`cli-${++forkCount}`, environment);
  mkdirSync(join(fork.changesDir, '.bin'), { recursive: true });
  copyFileSync(join(fixtures, fixture), join(fork.changesDir, '.bin', 'stream.jsonl'));
  for (const [name, content] of Object.entries(files)) writeFileSync(join(fork.changesDir, '.bin', name), content);
  const controller = new AbortController();
  const workspace = forkWorkspace(fork, { network: false, signal: controller.signal });
  const events: AgentEvent[] = [];
  if (abortAfterMs !== undefined) setTimeout(() => controller.abort(), abortAfterMs);
  const outcome = await harnessFor(agent, harnessEnv).run(
    { input: 'Change the greeting', history: [], mode: 'agent', agent, effort: 'low', instructions: null, workspace, signal: controller.signal, ...manifest },
    async (event) => {
      events.push(event);
    },
  );
  const call = (name: string) => readFileSync(join(fork.changesDir, '.calls', name), 'utf8');
  const argv = () => call('argv').split('\0').slice(0, -1);
  return { outcome, events, kinds: events.map((event) => event.kind), call, argv };
}

const ofKind = <K extends AgentEvent['kind']>(events: AgentEvent[], kind: K) =>
  events.filter((event) => event.kind === kind).map((event) => event.data as Extract<AgentEvent, { kind: K }>['data']);

describe('the Claude Code adapter over recorded streams', () => {
  it('turns a successful run into messages, tool calls with their results, usage and the final answer', async () => {
    const { outcome, events, kinds, call, argv: argvOf } = await run({ fixture: 'claude-code/success.jsonl' });
    expect(outcome).toEqual({ status: 'completed', answer: 'Greeting changed; cat shows it.' });
    expect(kinds).toEqual(['message', 'tool_call', 'tool_result', 'tool_call', 'tool_result', 'tool_call', 'tool_result', 'message', 'usage', 'final']);
    expect(ofKind(events, 'tool_call')[0]).toEqual({ id: 'toolu_01Read', name: 'Read', input: { file_path: '/workspace/app/greeting.txt' } });
    expect(ofKind(events, 'tool_result').map((result) => [result.name, result.isError])).toEqual([
      ['Read', false],
      ['Edit', false],
      ['Bash', true],
    ]);
    expect(ofKind(events, 'tool_result')[2]!.output).toBe('hello, world\nError: Exit code 1');
    // The result's total, cache reads and writes counted as input.
    expect(ofKind(events, 'usage')).toEqual([{ inputTokens: 24 + 5200 + 3016, outputTokens: 167 }]);

    const argv = argvOf();
    expect(argv.slice(0, 8)).toEqual(['-p', '--output-format', 'stream-json', '--verbose', '--model', 'claude-sonnet-4-5', '--max-turns', '10']);
    expect(argv).toEqual(expect.arrayContaining(['--permission-mode', 'bypassPermissions', '--disallowedTools', 'AskUserQuestion']));
    expect(call('stdin')).toBe('Change the greeting');
    const sandboxEnv = call('env');
    expect(sandboxEnv).toContain('ANTHROPIC_API_KEY=sk-ant-test\n');
    expect(sandboxEnv).toContain('IS_SANDBOX=1\n');
    // Only the CLI's own key reaches the sandbox.
    expect(sandboxEnv).not.toContain('OPENAI_API_KEY');
  });

  it('runs read-only in plan mode and takes the plan from ExitPlanMode; passes instructions and history', async () => {
    const plan = '1. Edit app/greeting.txt to say "hello, world".\n2. Run `cat app/greeting.txt` to check it.';
    const { outcome, events, call, argv: argvOf } = await run({
      fixture: 'claude-code/plan.jsonl',
      manifest: {
        mode: 'plan',
        effort: 'high',
        instructions: 'Keep plans short.',
        history: [
          { role: 'user', content: 'What does the greeting say?' },
          { role: 'assistant', content: 'It says hello.' },
        ],
      },
    });
    expect(outcome).toEqual({ status: 'plan', plan });
    expect(ofKind(events, 'plan')).toEqual([{ plan }]);
    const argv = argvOf();
    expect(argv).toEqual(expect.arrayContaining(['--permission-mode', 'plan', '--max-turns', '50']));
    const system = argv[argv.indexOf('--append-system-prompt') + 1];
    expect(system).toMatch(/^Research the request without changing files[\s\S]*QUESTION:[\s\S]*\n\nKeep plans short\.$/);
    expect(call('stdin')).toMatch(/What does the greeting say\?[\s\S]*It says hello\.[\s\S]*Change the greeting$/);
    expect(call('env')).not.toContain('IS_SANDBOX');
  });

  it('fails with the error of an error result, and names the turn budget when it ran out', async () => {
    const failed = await run({ fixture: 'claude-code/error.jsonl' });
    expect(failed.outcome).toEqual({ status: 'failed', error: expect.stringMatching(/^Claude Code failed \(error_during_execution\): API Error: 529/) });
    expect(failed.kinds).toEqual(['tool_call', 'tool_result', 'usage', 'error']);

    const exhausted = await run({ fixture: 'claude-code/max-turns.jsonl' });
    expect(exhausted.outcome).toEqual({ status: 'failed', error: 'Claude Code stopped after 11 turns without finishing (effort low allows 10)' });
  });

  it('reports a stream cut off mid-line as a failure, with the usage it saw and the CLI stderr', async () => {
    const { outcome, events, kinds } = await run({ fixture: 'claude-code/cut-off.jsonl', files: { stderr: 'Killed\n', 'exit-code': '137' } });
    expect(outcome).toEqual({ status: 'failed', error: 'Claude Code ended without a result (exit code 137, 1 unreadable output line): Killed' });
    expect(kinds).toEqual(['message', 'tool_call', 'tool_result', 'tool_call', 'usage', 'error']);
    expect(ofKind(events, 'usage')).toEqual([{ inputTokens: 1830 + 1900, outputTokens: 25 + 60 }]);
  });

  it('skips lines that are not stream messages', async () => {
    const { outcome, kinds } = await run({ fixture: 'claude-code/garbage.jsonl', manifest: { mode: 'ask' } });
    expect(outcome).toEqual({ status: 'completed', answer: 'The greeting file says hello.' });
    expect(kinds).toEqual(['message', 'usage', 'final']);
  });
});

describe('the Codex adapter over recorded streams', () => {
  it('turns items into tool calls and results, and the last agent message into the answer', async () => {
    const { outcome, events, kinds, call, argv: argvOf } = await run({ fixture: 'codex/success.jsonl', agent: codex, manifest: { effort: 'high', instructions: 'Use British spelling.' } });
    expect(outcome).toEqual({ status: 'completed', answer: 'Greeting changed to "hello, world"; `cat app/greeting.txt` shows it.' });
    expect(kinds).toEqual(['tool_call', 'tool_result', 'tool_call', 'tool_result', 'tool_call', 'tool_result', 'tool_call', 'tool_result', 'message', 'usage', 'final']);
    expect(ofKind(events, 'tool_call').map((call) => [call.id, call.name, call.input])).toEqual([
      ['item_1', 'command_execution', { command: "bash -lc 'cat app/greeting.txt'" }],
      ['item_2', 'file_change', { changes: [{ path: '/workspace/app/greeting.txt', kind: 'update' }] }],
      ['item_3', 'command_execution', { command: "bash -lc 'npm test'" }],
      ['item_4', 'docs.search', { query: 'greeting style' }],
    ]);
    expect(ofKind(events, 'tool_result').map((result) => [result.output, result.isError])).toEqual([
      ['exit code 0\nhello\n', false],
      ['update /workspace/app/greeting.txt', false],
      ['exit code 1\nnpm ERR! Missing script: "test"\n', true],
      ['Greetings end without punctuation.', false],
    ]);
    expect(ofKind(events, 'usage')).toEqual([{ inputTokens: 24763, outputTokens: 122 }]);

    expect(argvOf()).toEqual(['exec', '--json', '--model', 'gpt-5-codex', '--skip-git-repo-check', '--dangerously-bypass-approvals-and-sandbox', '-c', 'model_reasoning_effort=high', '-']);
    expect(call('stdin')).toMatch(/^Implement the requested change[\s\S]*Use British spelling\.\n\nChange the greeting$/);
    const sandboxEnv = call('env');
    expect(sandboxEnv).toContain('OPENAI_API_KEY=sk-openai-test\n');
    expect(sandboxEnv).toContain('CODEX_API_KEY=sk-openai-test\n');
    expect(sandboxEnv).not.toContain('ANTHROPIC_API_KEY');
  });

  it('uses the read-only sandbox for ask and plan, and ends with a question when the agent asks one', async () => {
    const { outcome, events, argv } = await run({ fixture: 'codex/question.jsonl', agent: codex, manifest: { mode: 'ask' } });
    expect(outcome).toEqual({ status: 'question', question: 'Should the greeting be "hello, world" or "Hello, World!"?' });
    expect(ofKind(events, 'question')).toHaveLength(1);
    expect(argv()).toEqual(expect.arrayContaining(['--sandbox', 'read-only', 'model_reasoning_effort=low']));
  });

  it('fails with the message of a failed turn', async () => {
    const { outcome, kinds } = await run({ fixture: 'codex/error.jsonl', agent: codex });
    expect(outcome).toEqual({ status: 'failed', error: expect.stringMatching(/^Codex failed: unexpected status 401 Unauthorized/) });
    expect(kinds).toEqual(['error']);
  });

  it('reports a stream cut off mid-line, and skips garbage lines', async () => {
    const cut = await run({ fixture: 'codex/cut-off.jsonl', agent: codex, files: { 'exit-code': '1' } });
    expect(cut.outcome).toEqual({ status: 'failed', error: 'Codex ended without a result (exit code 1, 1 unreadable output line)' });
    expect(cut.kinds).toEqual(['tool_call', 'tool_result', 'tool_call', 'error']);

    const garbage = await run({ fixture: 'codex/garbage.jsonl', agent: codex });
    expect(garbage.outcome).toEqual({ status: 'completed', answer: 'The greeting file says hello.' });
    expect(garbage.kinds).toEqual(['message', 'usage', 'final']);
  });
});

describe('running agent CLIs', () => {
  it('needs the CLI key, naming the variable; model APIs keep going through the built-in loop', () => {
    expect(() => harnessFor(claude, {})).toThrow(new ModelConfigError('ANTHROPIC_API_KEY is not set: the agent claude-code/claude-sonnet-4-5 needs it'));
    expect(() => harnessFor(codex, { ANTHROPIC_API_KEY: 'x' })).toThrow(/^OPENAI_API_KEY is not set: the agent codex\/gpt-5-codex needs it$/);
    expect(() => harnessFor(parseAgentId('openai/gpt-5') as AgentId, {})).toThrow(ModelConfigError);
    expect(harnessFor(claude, env)).toBeInstanceOf(ClaudeCodeHarness);
    expect(harnessFor(codex, env)).toBeInstanceOf(CodexHarness);
    expect(harnessFor(parseAgentId('anthropic/claude-sonnet-4-5') as AgentId, env)).toBeInstanceOf(BuiltinHarness);
  });

  it('says which CLI is missing and how to install it', async () => {
    const claudeMissing = await run({ fixture: 'claude-code/success.jsonl', harnessEnv: { ...env, SVC_CLAUDE_CODE_COMMAND: 'claude-not-installed' } });
    expect(claudeMissing.outcome).toEqual({ status: 'failed', error: expect.stringMatching(/^the Claude Code CLI is not installed: "claude-not-installed" was not found/) });
    expect(claudeMissing.outcome).toMatchObject({ error: expect.stringMatching(/npm install -g @anthropic-ai\/claude-code.*SVC_CLAUDE_CODE_COMMAND/) });
    expect(claudeMissing.kinds).toEqual(['error']);

    const codexMissing = await run({ fixture: 'codex/success.jsonl', agent: codex, harnessEnv: { ...env, SVC_CODEX_COMMAND: '/workspace/.bin/nope' } });
    expect(codexMissing.outcome).toMatchObject({ status: 'failed', error: expect.stringMatching(/Codex CLI is not installed.*@openai\/codex.*SVC_CODEX_COMMAND/) });
  });

  it('stops reporting when the journal refuses an event, and rejects with its error', async () => {
    const fork = await forks.create(`cli-${++forkCount}`, environment);
    mkdirSync(join(fork.changesDir, '.bin'), { recursive: true });
    copyFileSync(join(fixtures, 'codex/success.jsonl'), join(fork.changesDir, '.bin', 'stream.jsonl'));
    const seen: AgentEvent[] = [];
    const running = harnessFor(codex, env).run(
      { input: 'Change the greeting', history: [], mode: 'agent', agent: codex, effort: 'low', instructions: null, workspace: forkWorkspace(fork, { network: false }) },
      async (event) => {
        seen.push(event);
        if (seen.length === 2) throw new Error('journal refused the event: stale generation');
      },
    );
    await expect(running).rejects.toThrow('stale generation');
    expect(seen).toHaveLength(2);
  });

  it('stops the CLI when the run is aborted', async () => {
    const { outcome, kinds } = await run({ fixture: 'claude-code/cut-off.jsonl', files: { hang: '' }, abortAfterMs: 1_500 });
    expect(outcome).toEqual({ status: 'failed', error: 'Claude Code was stopped: the run was cancelled' });
    // What arrived before the abort was reported; nothing closes the run after it.
    expect(kinds).toEqual(['message', 'tool_call', 'tool_result', 'tool_call']);
    // The run ended with its process group: the CLI's sleep is gone (had it not been stopped, the run would still wait for it).
    expect(execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' })).not.toContain('sleep 61.7');
  });
});
