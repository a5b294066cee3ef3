/**
 * The built-in loop with an `interaction` (a desktop runner's owner answering while the run goes on),
 * in a local workspace, against the fake model over HTTP: which tools ask in which permission mode, a
 * denial reaches the model and the run goes on, and `ask_user` waits for its answer. Without an
 * interaction the cloud's behaviour stays as test/agent-loop.test.ts pins it.
 */
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { BuiltinHarness, DENIED_BY_USER } from '../src/agents/builtin.js';
import { confinedPath, localWorkspace } from '../src/agents/local-workspace.js';
import { resolveModel } from '../src/agents/models.js';
import type { AgentEvent, InteractionAnswer, InteractionRequest, RunManifest } from '../src/agents/types.js';
import { parseAgentId, type AgentId } from '../src/domain/agents.js';
import type { PermissionMode } from '../src/protocol/runner.js';
import { RunnerHome } from '../src/runner/home.js';
import { reviewAnswer } from '../src/runner/review.js';
import { startFakeModel, type FakeModel, type ScriptedAnswer } from './support/fake-model.js';

const agent = parseAgentId('openai-compatible/fake-coder') as AgentId;
let model: FakeModel | null = null;
afterEach(async () => {
  await model?.close();
  model = null;
});

function folder(): string {
  const dir = mkdtempSync(join(tmpdir(), 'svc-local-'));
  writeFileSync(join(dir, 'greeting.txt'), 'hello\n');
  return dir;
}

/** Runs the loop; `answer` decides each request the way the runner's owner would. */
async function run(script: ScriptedAnswer[], permissionMode: PermissionMode | null, answer: (ask: InteractionRequest) => InteractionAnswer = () => ({ decision: 'allow' }), overrides: Partial<RunManifest> = {}) {
  // The fake model consumes its script: each run gets its own copy.
  model = await startFakeModel(structuredClone(script));
  const dir = folder();
  const env = { OPENAI_COMPATIBLE_BASE_URL: model.baseUrl, OPENAI_COMPATIBLE_API_KEY: 'test' };
  const harness = new BuiltinHarness({ model: (manifest) => resolveModel(manifest.agent, env), maxRetries: 0 });
  const asked: InteractionRequest[] = [];
  const events: AgentEvent[] = [];
  const outcome = await harness.run(
    {
      input: 'Change the greeting',
      history: [],
      mode: 'agent',
      agent,
      effort: 'low',
      instructions: null,
      workspace: localWorkspace(dir, { env: { PATH: process.env.PATH ?? '/usr/bin:/bin' } }),
      ...(permissionMode
        ? {
            interaction: {
              permissionMode,
              request: async (ask: InteractionRequest) => {
                asked.push(ask);
                return answer(ask);
              },
            },
          }
        : {}),
      ...overrides,
    },
    async (event) => {
      events.push(event);
    },
  );
  return { outcome, events, asked, dir, requests: model.requests };
}

const WRITE_AND_RUN: ScriptedAnswer[] = [
  { toolCalls: [{ name: 'write_file', arguments: { path: 'greeting.txt', content: 'hello, world\n' } }] },
  { toolCalls: [{ name: 'run_command', arguments: { command: 'cat greeting.txt > seen.txt' } }] },
  { toolCalls: [{ name: 'finish', arguments: { summary: 'done' } }] },
];

describe('the built-in loop with someone to answer', () => {
  it('asks before every write and command in ask mode; a denial reaches the model and the run goes on', async () => {
    const { outcome, asked, dir, requests, events } = await run(WRITE_AND_RUN, 'ask', (ask) => ({ decision: ask.tool === 'run_command' ? 'deny' : 'allow' }));
    expect(outcome).toEqual({ status: 'completed', answer: 'done' });
    expect(asked.map((ask) => [ask.tool, ask.input])).toEqual([
      ['write_file', { path: 'greeting.txt', content: 'hello, world\n' }],
      ['run_command', { command: 'cat greeting.txt > seen.txt' }],
    ]);
    expect(new Set(asked.map((ask) => ask.requestId)).size).toBe(2);
    expect(readFileSync(join(dir, 'greeting.txt'), 'utf8')).toBe('hello, world\n');
    // The denied command never ran, and the model was told so.
    expect(existsSync(join(dir, 'seen.txt'))).toBe(false);
    const told = requests[2]!.messages.at(-1)!;
    expect([told.role, told.content]).toEqual(['tool', DENIED_BY_USER]);
    expect(events.filter((event) => event.kind === 'tool_result').map((event) => [event.data.name, event.data.isError])).toEqual([
      ['write_file', false],
      ['run_command', true],
      ['finish', false],
    ]);
  });

  it('asks only before commands in auto mode, and never in full mode', async () => {
    const auto = await run(WRITE_AND_RUN, 'auto');
    expect(auto.asked.map((ask) => ask.tool)).toEqual(['run_command']);
    expect(readFileSync(join(auto.dir, 'seen.txt'), 'utf8')).toBe('hello, world\n');
    await model?.close();
    const full = await run(WRITE_AND_RUN, 'full');
    expect(full.asked).toEqual([]);
    expect(readFileSync(join(full.dir, 'seen.txt'), 'utf8')).toBe('hello, world\n');
  });

  it('lets reading tools run without asking', async () => {
    const { asked, outcome } = await run(
      [
        { toolCalls: [{ name: 'read_file', arguments: { path: 'greeting.txt' } }] },
        { toolCalls: [{ name: 'list_files', arguments: { path: '.' } }] },
        { toolCalls: [{ name: 'search', arguments: { pattern: 'hello', path: '.' } }] },
        { toolCalls: [{ name: 'finish', arguments: { summary: 'read' } }] },
      ],
      'ask',
    );
    expect(outcome).toEqual({ status: 'completed', answer: 'read' });
    expect(asked).toEqual([]);
  });

  it('makes ask_user a blocking question whose answer is the tool result, and the run continues', async () => {
    const { outcome, asked, requests, events } = await run(
      [
        { toolCalls: [{ name: 'ask_user', arguments: { question: 'Which greeting?' } }] },
        { toolCalls: [{ name: 'finish', arguments: { summary: 'used the answer' } }] },
      ],
      'ask',
      () => ({ decision: 'allow', answers: [{ questionId: 'answer', values: ['Bonjour'] }] }),
    );
    expect(asked).toEqual([
      { requestId: expect.any(String), kind: 'question', questions: [{ id: 'answer', question: 'Which greeting?', options: [], multiple: false, allowCustom: true }] },
    ]);
    expect(requests).toHaveLength(2);
    expect(requests[1]!.messages.at(-1)).toMatchObject({ role: 'tool', content: 'Bonjour' });
    expect(outcome).toEqual({ status: 'completed', answer: 'used the answer' });
    expect(events.some((event) => event.kind === 'question')).toBe(false);
  });

  it('without an interaction, asks nothing and ends the run with the question (the cloud)', async () => {
    const { outcome, requests, events } = await run(
      [
        { toolCalls: [{ name: 'ask_user', arguments: { question: 'Which greeting?' } }] },
        { toolCalls: [{ name: 'finish', arguments: { summary: 'never reached' } }] },
      ],
      null,
    );
    expect(outcome).toEqual({ status: 'question', question: 'Which greeting?' });
    expect(requests).toHaveLength(1);
    expect(events.filter((event) => event.kind === 'question')).toEqual([{ kind: 'question', data: { question: 'Which greeting?' } }]);
  });
});

describe("the local workspace and the task's folder", () => {
  it('keeps paths inside the folder: no absolute paths, no .., no link that leads out', () => {
    const dir = folder();
    const outside = mkdtempSync(join(tmpdir(), 'svc-outside-'));
    writeFileSync(join(outside, 'secret.txt'), 'secret\n');
    symlinkSync(outside, join(dir, 'escape'));
    mkdirSync(join(dir, 'inner'));
    symlinkSync(join(dir, 'inner'), join(dir, 'fine'));
    symlinkSync(join(outside, 'created-through-a-dangling-link'), join(dir, 'dangling'));
    expect(confinedPath(dir, './inner/../greeting.txt')).toMatch(/greeting\.txt$/);
    expect(confinedPath(dir, 'fine/new.txt')).toMatch(/fine\/new\.txt$/);
    for (const path of ['/etc/passwd', '../x', 'inner/../../x', 'escape/secret.txt', 'escape/new/file.txt', 'dangling']) {
      expect(() => confinedPath(dir, path), path).toThrow(/outside the task's folder/);
    }
  });

  it('runs commands in the folder as process groups, and forgets their records once they are gone', async () => {
    const dir = folder();
    const groups = mkdtempSync(join(tmpdir(), 'svc-groups-'));
    const workspace = localWorkspace(dir, { env: { PATH: process.env.PATH ?? '/usr/bin:/bin' }, groupsDir: groups });
    const result = await workspace.runCommand('pwd; (sleep 60 >/dev/null 2>&1 &); echo started', 10_000);
    expect([result.exitCode, result.timedOut]).toEqual([0, false]);
    expect(result.output.split('\n')[0]).toBe(dir);
    expect(readdirSync(groups)).toEqual([]);
    await expect(workspace.readFile('../etc/passwd')).rejects.toThrow(/outside/);
    // The root the agents' instructions name is the folder.
    await expect(workspace.readFile('/workspace/greeting.txt')).resolves.toBe('hello\n');
    await expect(workspace.readFile('/etc/hostname')).rejects.toThrow(/outside/);
  });

  it("answers review requests with a file of the task's folder, and refuses paths leaving it", () => {
    const home = new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-home-'))).ensure();
    const taskId = '7a1c2d0e-0000-4000-8000-000000000001';
    mkdirSync(join(home.taskDir(taskId), 'app'), { recursive: true });
    writeFileSync(join(home.taskDir(taskId), 'app', 'notes.md'), '# notes\n');
    symlinkSync('/etc', join(home.taskDir(taskId), 'etc'));
    expect(reviewAnswer(home, { taskId, path: 'app/notes.md' })).toEqual({ status: 'ok', content: Buffer.from('# notes\n').toString('base64') });
    expect(reviewAnswer(home, { taskId, path: '../../connection.json' })).toEqual({ status: 'error', message: "path ../../connection.json is outside the task's folder" });
    expect(reviewAnswer(home, { taskId, path: 'etc/hostname' })).toMatchObject({ status: 'error', message: expect.stringMatching(/outside/) });
    expect(reviewAnswer(home, { taskId, path: 'app' })).toEqual({ status: 'error', message: 'app is not a file' });
    expect(reviewAnswer(home, { taskId: '7a1c2d0e-0000-4000-8000-000000000002', path: 'x' })).toMatchObject({ status: 'error' });
  });
});
