import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeAll, describe, expect, it } from 'vitest';
import { BuiltinHarness } from '../src/agents/builtin.js';
import { forkWorkspace, workspacePath } from '../src/agents/fork-workspace.js';
import { ModelConfigError, resolveModel } from '../src/agents/models.js';
import type { AgentEvent, RunManifest } from '../src/agents/types.js';
import { parseAgentId, type AgentId } from '../src/domain/agents.js';
import { ForkManager } from '../src/sandbox/fork.js';
import { startFakeModel, type FakeModel, type ScriptedAnswer } from './support/fake-model.js';

const root = mkdtempSync(join(tmpdir(), 'svc-agent-'));
const environment = join(root, 'environments', 'acme');
const forks = new ForkManager(join(root, 'forks'), { hiddenPaths: [join(root, 'environments'), join(root, 'forks')], allowUnsandboxed: false });
const agent = parseAgentId('openai-compatible/fake-coder') as AgentId;
let model: FakeModel | null = null;
let forkCount = 0;

beforeAll(() => {
  mkdirSync(join(environment, 'app'), { recursive: true });
  writeFileSync(join(environment, 'app', 'greeting.txt'), 'hello\n');
});
afterEach(async () => {
  await model?.close();
  model = null;
});

async function run(script: ScriptedAnswer[], overrides: Partial<RunManifest> = {}) {
  model = await startFakeModel(script);
  const fork = await forks.create(`run-${++forkCount}`, environment);
  const env = { OPENAI_COMPATIBLE_BASE_URL: model.baseUrl, OPENAI_COMPATIBLE_API_KEY: 'test' };
  const harness = new BuiltinHarness({ model: (manifest) => resolveModel(manifest.agent, env), maxRetries: 0 });
  const events: AgentEvent[] = [];
  const outcome = await harness.run(
    { input: 'Change the greeting', history: [], mode: 'agent', agent, effort: 'low', instructions: null, workspace: forkWorkspace(fork, { network: false }), ...overrides },
    async (event) => {
      events.push(event);
    },
  );
  return { outcome, events, fork, requests: model.requests };
}

describe('the built-in agent loop against a fake model over HTTP', () => {
  it('edits files and runs commands in the fork, reporting every step', async () => {
    const { outcome, events, fork, requests } = await run([
      { toolCalls: [{ name: 'read_file', arguments: { path: 'app/greeting.txt' } }] },
      { toolCalls: [{ name: 'edit_file', arguments: { path: 'app/greeting.txt', old: 'hello', new: 'hello, world' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cat app/greeting.txt && ls /' } }], usage: { input: 300, output: 40 } },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Greeting changed; cat shows it.' } }] },
    ]);
    expect(outcome).toEqual({ status: 'completed', answer: 'Greeting changed; cat shows it.' });
    expect(readFileSync(join(fork.changesDir, 'app', 'greeting.txt'), 'utf8')).toBe('hello, world\n');
    expect(readFileSync(join(environment, 'app', 'greeting.txt'), 'utf8')).toBe('hello\n');
    const results = events.filter((event) => event.kind === 'tool_result').map((event) => event.data);
    expect(results.map((result) => [result.name, result.isError])).toEqual([
      ['read_file', false],
      ['edit_file', false],
      ['run_command', false],
      ['finish', false],
    ]);
    expect(results[0]!.output).toBe('hello\n');
    expect(results[2]!.output).toMatch(/^exit code 0\nhello, world\n/);
    // The model saw each tool's output in its next request.
    expect(JSON.stringify(requests[1]!.messages)).toContain('hello\\n');
    expect(requests[0]!.tools!.map((entry) => entry.function.name).sort()).toEqual(
      ['ask_user', 'edit_file', 'finish', 'list_files', 'read_file', 'run_command', 'search', 'write_file'],
    );
    const usage = events.filter((event) => event.kind === 'usage').map((event) => event.data);
    expect(usage).toHaveLength(4);
    expect(usage[2]).toEqual({ inputTokens: 300, outputTokens: 40 });
    expect(events.filter((event) => event.kind === 'final')).toEqual([{ kind: 'final', data: { answer: 'Greeting changed; cat shows it.' } }]);
    // Each step's usage closes the step: the last event is the usage of the step that called finish.
    expect(events.at(-1)?.kind).toBe('usage');
  });

  it('ends with a question, or with a plan in plan mode (which has no write tools)', async () => {
    const asked = await run([{ toolCalls: [{ name: 'ask_user', arguments: { question: 'Which greeting?' } }] }]);
    expect(asked.outcome).toEqual({ status: 'question', question: 'Which greeting?' });
    expect(asked.events.some((event) => event.kind === 'question')).toBe(true);
    await model?.close();

    const planned = await run([{ toolCalls: [{ name: 'submit_plan', arguments: { plan: '1. Edit greeting.txt' } }] }], { mode: 'plan' });
    expect(planned.outcome).toEqual({ status: 'plan', plan: '1. Edit greeting.txt' });
    const offered = planned.requests[0]!.tools!.map((entry) => entry.function.name);
    expect(offered).toContain('submit_plan');
    expect(offered).not.toContain('write_file');
    expect(offered).not.toContain('edit_file');
  });

  it('tells the model about invalid tool arguments and unknown tools, and goes on', async () => {
    const { outcome, requests } = await run([
      { toolCalls: [{ name: 'write_file', arguments: { path: 'x.txt' } }] },
      { toolCalls: [{ name: 'launch_rockets', arguments: {} }] },
      { toolCalls: [{ name: 'read_file', arguments: { path: '../../etc/shadow' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'recovered' } }] },
    ]);
    expect(outcome).toEqual({ status: 'completed', answer: 'recovered' });
    const told = requests.slice(1).map((request) => request.messages.at(-1));
    expect(told.map((message) => message?.role)).toEqual(['tool', 'tool', 'tool']);
    expect(String(told[0]!.content)).toMatch(/^Invalid input for tool write_file[\s\S]*"content"/);
    expect(String(told[1]!.content)).toMatch(/unavailable tool 'launch_rockets'/);
    expect(String(told[2]!.content)).toBe('error: path ../../etc/shadow is outside /workspace');
  });

  it('fails with a clear error when the model answers garbage or the endpoint fails', async () => {
    const garbage = await run([{ raw: '{"choices": [' }]);
    expect(garbage.outcome.status).toBe('failed');
    await model?.close();
    const broken = await run([{ status: 503 }]);
    expect(broken.outcome).toMatchObject({ status: 'failed', error: expect.stringMatching(/^model call failed/) });
    await model?.close();
    const endless = await run(Array.from({ length: 12 }, () => ({ toolCalls: [{ name: 'list_files', arguments: { path: '.' } }] })));
    expect(endless.outcome).toMatchObject({ status: 'failed', error: expect.stringMatching(/stopped after 10 steps/) });
  });

  it('says which key is missing, and keeps paths inside the workspace', () => {
    expect(() => resolveModel(parseAgentId('openai/gpt-5') as AgentId, {})).toThrow(new ModelConfigError('OPENAI_API_KEY is not set: the agent openai/gpt-5 needs it'));
    expect(() => resolveModel(parseAgentId('anthropic/claude-sonnet-4-5') as AgentId, {})).toThrow(/ANTHROPIC_API_KEY/);
    expect(() => resolveModel(parseAgentId('claude-code/opus') as AgentId, {})).toThrow(/CLI harness/);
    expect(workspacePath('./a/../b.txt')).toBe('b.txt');
    expect(() => workspacePath('/etc/passwd')).toThrow(/outside/);
    expect(() => workspacePath('a/../../x')).toThrow(/outside/);
  });
});
