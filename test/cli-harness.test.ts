import { execFileSync } from 'node:child_process';
import { chmodSync, copyFileSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { createServer, request as httpRequest, type IncomingHttpHeaders } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { BuiltinHarness } from '../src/agents/builtin.js';
import { ClaudeCodeHarness } from '../src/agents/claude-code.js';
import { CodexHarness } from '../src/agents/codex.js';
import { CredentialProxy } from '../src/agents/credential-proxy.js';
import { forkWorkspace } from '../src/agents/fork-workspace.js';
import { ModelConfigError } from '../src/agents/models.js';
import { harnessFor, type HarnessOptions } from '../src/agents/registry.js';
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
const proxy = new CredentialProxy();
afterAll(() => proxy.close());

// A stand-in for both CLIs inside the sandbox: it records how it was called, replays the stream the test
// put next to it, and can fail on stderr, exit with a code, or hang (to be stopped).
const FAKE_CLI = `#!/bin/sh
mkdir -p /workspace/.calls
printf '%s\\0' "$@" > /workspace/.calls/argv
env | sort > /workspace/.calls/env
cat > /workspace/.calls/stdin
cat /workspace/.bin/stream.jsonl
if [ -f /workspace/.bin/call-provider ]; then sh /workspace/.bin/call-provider; fi
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
  harnessOptions?: HarnessOptions;
  files?: Record<string, string>;
  abortAfterMs?: number;
  manifest?: Partial<RunManifest>;
}

async function run({ fixture, agent = claude, harnessEnv = env, harnessOptions = { credentialProxy: proxy }, files = {}, abortAfterMs, manifest = {} }: Scenario) {
  const fork: Fork = await forks.create(`cli-${++forkCount}`, environment);
  mkdirSync(join(fork.changesDir, '.bin'), { recursive: true });
  copyFileSync(join(fixtures, fixture), join(fork.changesDir, '.bin', 'stream.jsonl'));
  for (const [name, content] of Object.entries(files)) writeFileSync(join(fork.changesDir, '.bin', name), content);
  const controller = new AbortController();
  const workspace = forkWorkspace(fork, { network: false, signal: controller.signal });
  const events: AgentEvent[] = [];
  if (abortAfterMs !== undefined) setTimeout(() => controller.abort(), abortAfterMs);
  const outcome = await harnessFor(agent, harnessEnv, harnessOptions).run(
    { input: 'Change the greeting', history: [], mode: 'agent', agent, effort: 'low', instructions: null, workspace, signal: controller.signal, ...manifest },
    async (event) => {
      events.push(event);
    },
  );
  const call = (name: string) => readFileSync(join(fork.changesDir, '.calls', name), 'utf8');
  const argv = () => call('argv').split('\0').slice(0, -1);
  return { outcome, events, kinds: events.map((event) => event.kind), call, argv, fork };
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
    // A lease of the credential proxy, never the key itself (see 'provider credentials' below).
    expect(sandboxEnv).toMatch(/^ANTHROPIC_API_KEY=[A-Za-z0-9_-]{43}$/m);
    expect(sandboxEnv).toMatch(/^ANTHROPIC_BASE_URL=http:\/\/127\.0\.0\.1:\d+\/[A-Za-z0-9_-]{43}$/m);
    expect(sandboxEnv).not.toContain('sk-ant-test');
    expect(sandboxEnv).toContain('IS_SANDBOX=1\n');
    // Only the CLI's own provider is leased.
    expect(sandboxEnv).not.toContain('OPENAI');
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
    const token = /^OPENAI_API_KEY=([A-Za-z0-9_-]{43})$/m.exec(sandboxEnv)?.[1];
    expect(token).toBeDefined();
    expect(sandboxEnv).toContain(`CODEX_API_KEY=${token}\n`);
    expect(sandboxEnv).toMatch(new RegExp(`^OPENAI_BASE_URL=http://127\\.0\\.0\\.1:\\d+/${token}$`, 'm'));
    expect(sandboxEnv).not.toContain('sk-openai-test');
    expect(sandboxEnv).not.toContain('ANTHROPIC');
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
    const options = { credentialProxy: proxy };
    expect(() => harnessFor(claude, {}, options)).toThrow(new ModelConfigError('ANTHROPIC_API_KEY is not set: the agent claude-code/claude-sonnet-4-5 needs it'));
    expect(() => harnessFor(codex, { ANTHROPIC_API_KEY: 'x' }, options)).toThrow(/^OPENAI_API_KEY is not set: the agent codex\/gpt-5-codex needs it$/);
    expect(() => harnessFor(claude, { ...env, ANTHROPIC_BASE_URL: 'not a url' }, options)).toThrow(ModelConfigError);
    expect(() => harnessFor(parseAgentId('openai/gpt-5') as AgentId, {})).toThrow(ModelConfigError);
    expect(harnessFor(claude, env, options)).toBeInstanceOf(ClaudeCodeHarness);
    expect(harnessFor(codex, env, options)).toBeInstanceOf(CodexHarness);
    expect(harnessFor(parseAgentId('anthropic/claude-sonnet-4-5') as AgentId, env)).toBeInstanceOf(BuiltinHarness);
  });

  it('runs a CLI only with a credential proxy or, explicitly, with its own login', () => {
    expect(() => harnessFor(claude, env)).toThrow(/claude-code\/claude-sonnet-4-5 runs a CLI in the sandbox, which needs a credential proxy/);
    expect(() => harnessFor(codex, env, { credentialProxy: proxy, cliOwnLogin: true })).toThrow(/choose one/);
    // Its own login needs no key in the service's environment.
    expect(harnessFor(codex, {}, { cliOwnLogin: true })).toBeInstanceOf(CodexHarness);
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
    const running = harnessFor(codex, env, { credentialProxy: proxy }).run(
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

describe('provider credentials', () => {
  // A stand-in for the provider, reached through the proxy: it records what each request carried.
  const received: Array<{ method: string; url: string; headers: IncomingHttpHeaders; body: string }> = [];
  const provider = createServer((req, res) => {
    let body = '';
    req.setEncoding('utf8');
    req.on('data', (chunk: string) => (body += chunk));
    req.on('end', () => {
      received.push({ method: req.method ?? '', url: req.url ?? '', headers: req.headers, body });
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end('{"id":"msg_1","type":"message"}');
    });
  });
  let providerUrl = '';
  beforeAll(async () => {
    await new Promise<void>((resolve) => provider.listen(0, '127.0.0.1', resolve));
    providerUrl = `http://127.0.0.1:${(provider.address() as AddressInfo).port}`;
  });
  afterAll(() => new Promise((resolve) => provider.close(resolve)));

  // Run by the fake CLI inside the sandbox: it keeps every process's environment and command line the
  // sandbox can see, then calls the provider the way each CLI does, with the key and base URL it was given.
  const CALL_PROVIDER = `
cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' > /workspace/.calls/processes
if [ -n "$ANTHROPIC_BASE_URL" ]; then
  curl -sS -o /workspace/.calls/response -w '%{http_code}' -H "x-api-key: $ANTHROPIC_API_KEY" -H 'content-type: application/json' \\
    -d '{"model":"claude-sonnet-4-5","max_tokens":1}' "$ANTHROPIC_BASE_URL/v1/messages?beta=true" > /workspace/.calls/status 2>&1
else
  curl -sS -o /workspace/.calls/response -w '%{http_code}' -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \\
    -d '{"model":"gpt-5-codex","stream":true}' "$OPENAI_BASE_URL/responses" > /workspace/.calls/status 2>&1
fi
`;

  /** Every file the sandboxed run could write (the fork's own files), as one text. */
  const forkText = (dir: string): string =>
    readdirSync(dir, { recursive: true, withFileTypes: true })
      .filter((entry) => entry.isFile())
      .map((entry) => readFileSync(join(entry.parentPath, entry.name), 'utf8'))
      .join('\n');

  it('gives Claude Code a lease of the proxy: the sandbox never sees the key, the provider gets it', async () => {
    const realKey = 'sk-ant-real-4f0c2a9e7d1b';
    // The service's ANTHROPIC_BASE_URL ends in /v1 (the built-in loop's convention); Claude Code appends /v1/messages.
    const harnessEnv = { ...env, ANTHROPIC_API_KEY: realKey, ANTHROPIC_BASE_URL: `${providerUrl}/v1` };
    received.length = 0;
    const { outcome, call, fork } = await run({ fixture: 'claude-code/success.jsonl', harnessEnv, files: { 'call-provider': CALL_PROVIDER } });
    expect(outcome.status).toBe('completed');
    expect(call('status')).toBe('200');
    expect(call('response')).toBe('{"id":"msg_1","type":"message"}');

    const token = /^ANTHROPIC_API_KEY=(.+)$/m.exec(call('env'))?.[1] ?? '';
    expect(token).toMatch(/^[A-Za-z0-9_-]{43}$/);
    expect(call('processes')).toContain(`ANTHROPIC_API_KEY=${token}`);
    for (const seen of [call('env'), call('processes'), call('argv'), call('stdin'), forkText(fork.changesDir)]) {
      expect(seen).not.toContain(realKey);
      expect(seen).not.toContain(providerUrl);
    }

    expect(received).toHaveLength(1);
    expect(received[0]).toMatchObject({ method: 'POST', url: '/v1/messages?beta=true', body: '{"model":"claude-sonnet-4-5","max_tokens":1}' });
    expect(received[0]!.headers['x-api-key']).toBe(realKey);
    expect(JSON.stringify(received[0]!.headers)).not.toContain(token);

    // The lease died with the run: its token opens nothing any more (asked at the proxy's socket, since
    // the base URL's forwarder lived in the sandbox's own network and is gone with it).
    const baseUrl = /^ANTHROPIC_BASE_URL=(.+)$/m.exec(call('env'))?.[1] ?? '';
    expect(new URL(baseUrl).pathname).toBe(`/${token}`);
    expect(await viaProxySocket('POST', `/${token}/v1/messages`)).toBe(403);
    expect(received).toHaveLength(1);
  });

  it('runs the CLI in a private network: the host is out of reach, and the proxy takes only the provider calls', async () => {
    // The fake CLI tries the provider (a server on the host's loopback) directly, then through its base
    // URL a call of the provider's API that Claude Code never makes.
    const port = new URL(providerUrl).port;
    const probe = `
curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:${port}/v1/messages" > /workspace/.calls/direct 2>/dev/null
curl -sS -o /workspace/.calls/files -w '%{http_code}' -H "x-api-key: $ANTHROPIC_API_KEY" "$ANTHROPIC_BASE_URL/v1/files" > /workspace/.calls/files-status 2>&1
curl -sS -o /dev/null -w '%{http_code}' -H "x-api-key: $ANTHROPIC_API_KEY" -d '{}' "$ANTHROPIC_BASE_URL/v1/messages/count_tokens" > /workspace/.calls/count-status 2>&1
`;
    received.length = 0;
    const { outcome, call } = await run({ fixture: 'claude-code/success.jsonl', harnessEnv: { ...env, ANTHROPIC_BASE_URL: providerUrl }, files: { 'call-provider': probe } });
    expect(outcome.status).toBe('completed');
    expect(call('direct')).toBe('000');
    expect(call('files-status')).toBe('403');
    expect(JSON.parse(call('files')).error.code).toBe('path_not_allowed');
    expect(call('count-status')).toBe('200');
    expect(received.map((request) => request.url)).toEqual(['/v1/messages/count_tokens']);
  });

  it('gives Codex a lease of the proxy under OPENAI_BASE_URL, with a bearer key upstream', async () => {
    const realKey = 'sk-proj-real-8b3e61c0a5f2';
    const harnessEnv = { ...env, OPENAI_API_KEY: realKey, OPENAI_BASE_URL: `${providerUrl}/v1` };
    received.length = 0;
    const { outcome, call, fork } = await run({ fixture: 'codex/success.jsonl', agent: codex, harnessEnv, files: { 'call-provider': CALL_PROVIDER } });
    expect(outcome.status).toBe('completed');
    expect(call('status')).toBe('200');
    for (const seen of [call('env'), call('processes'), call('argv'), call('stdin'), forkText(fork.changesDir)]) expect(seen).not.toContain(realKey);

    expect(received).toHaveLength(1);
    expect(received[0]).toMatchObject({ method: 'POST', url: '/v1/responses' });
    expect(received[0]!.headers.authorization).toBe(`Bearer ${realKey}`);
  });

  /** The status of a request sent straight to the credential proxy's socket on the host. */
  async function viaProxySocket(method: string, path: string): Promise<number> {
    const { socketPath } = await proxy.lease({ upstreamBaseUrl: providerUrl, headers: {}, paths: [] });
    return new Promise((resolve, reject) => {
      httpRequest({ socketPath, path, method }, (response) => {
        response.resume();
        resolve(response.statusCode ?? 0);
      })
        .on('error', reject)
        .end();
    });
  }

  it('passes no key at all when the CLI runs with its own login (a desktop runner)', async () => {
    const { outcome, call } = await run({ fixture: 'claude-code/success.jsonl', harnessEnv: { ...env, ANTHROPIC_BASE_URL: providerUrl }, harnessOptions: { cliOwnLogin: true } });
    expect(outcome.status).toBe('completed');
    const sandboxEnv = call('env');
    expect(sandboxEnv).not.toContain('ANTHROPIC');
    expect(sandboxEnv).not.toContain('sk-ant-test');
  });
});
