/**
 * `npm run demo`: the whole path from a prompt to a verified pull request, offline and without a key.
 * It starts the service on a fresh embedded database in a temporary directory, connects a small sample
 * repository, and runs one task with the real agent loop against a scripted model (the same fake
 * OpenAI-compatible server the tests use), printing the live log, then the pull request with its proof.
 */
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { loadConfig } from '../src/config.js';
import { admin, startService } from '../src/main.js';
import { startFakeModel, type ScriptedAnswer } from '../test/support/fake-model.js';

const AGENT = 'openai-compatible/scripted-demo';

function sampleRepository(root: string): string {
  const dir = join(root, 'greeter');
  mkdirSync(dir);
  writeFileSync(join(dir, 'greet.js'), "module.exports = (name) => 'hi ' + name;\n");
  writeFileSync(
    join(dir, 'test.js'),
    "const greet = require('./greet');\nconst got = greet('Ada');\nif (got !== 'Hello, Ada!') { console.error(`expected \"Hello, Ada!\", got \"${got}\"`); process.exit(1); }\nconsole.log('1 test passed');\n",
  );
  writeFileSync(join(dir, 'package.json'), `${JSON.stringify({ name: 'greeter', version: '1.0.0', private: true, scripts: { test: 'node test.js' } }, null, 2)}\n`);
  const env = { ...process.env, GIT_AUTHOR_NAME: 'demo', GIT_AUTHOR_EMAIL: 'demo@example.com', GIT_COMMITTER_NAME: 'demo', GIT_COMMITTER_EMAIL: 'demo@example.com' };
  for (const args of [['init', '--quiet', '--initial-branch=main'], ['add', '-A'], ['commit', '--quiet', '-m', 'A greeter with a failing test']]) {
    execFileSync('git', args, { cwd: dir, env });
  }
  return dir;
}

/** What the scripted model does, one answer per model call: look, fix, verify, finish. */
const SCRIPT: ScriptedAnswer[] = [
  { toolCalls: [{ name: 'list_files', arguments: { path: 'greeter' } }] },
  { toolCalls: [{ name: 'read_file', arguments: { path: 'greeter/greet.js' } }] },
  { toolCalls: [{ name: 'write_file', arguments: { path: 'greeter/greet.js', content: "module.exports = (name) => `Hello, ${name}!`;\n" } }] },
  { toolCalls: [{ name: 'run_command', arguments: { command: 'cd greeter && npm test' } }] },
  { toolCalls: [{ name: 'finish', arguments: { summary: 'The greeter now says "Hello, <name>!"; `npm test` passes.' } }] },
];

function describeEvent(kind: string, data: Record<string, unknown>): string | null {
  switch (kind) {
    case 'tool_call':
      return `→ ${String(data.name)} ${JSON.stringify(data.input)}`;
    case 'tool_result':
      return `  ${String(data.output).trim().split('\n').slice(0, 4).join('\n  ')}`;
    case 'check':
      return `✓ check ${String(data.name)} (${String(data.command)}): ${data.passed ? 'passed' : 'failed'} in ${String(data.durationMs)} ms`;
    case 'pull_request':
      return `⇒ pull request ${String(data.repository)}#${String(data.number)} ${data.opened ? 'opened' : 'updated'}: ${String(data.url)}`;
    case 'final':
      return `■ ${String(data.answer)}`;
    case 'usage':
      return null;
    default:
      return `${kind}: ${JSON.stringify(data)}`;
  }
}

async function main(): Promise<void> {
  const root = mkdtempSync(join(tmpdir(), 'svc-demo-'));
  const model = await startFakeModel([...SCRIPT]);
  process.env.OPENAI_COMPATIBLE_BASE_URL = model.baseUrl;
  // Always the embedded database in its own directory, whatever DATABASE_URL says around it.
  const config = loadConfig({ dataDir: join(root, 'data'), port: 0, logLevel: 'warn', defaultAgent: AGENT }, { ...process.env, DATABASE_URL: undefined });
  const service = await startService(config, pino({ level: 'warn' }));
  try {
    const key = service.bootstrapKey!;
    const { repository } = await admin.addRepository(service.database.db, service.environments, { workspace: 'default', source: sampleRepository(root), fullName: 'demo/greeter', setup: false });
    console.log(`svc is running at ${service.url} on a fresh database in ${root}`);
    console.log(`Connected ${repository.fullName}; its check is \`npm test\` (it fails: the greeting is wrong).\n`);

    const api = `${service.url}/api/v1`;
    const headers = { authorization: `Bearer ${key}`, 'content-type': 'application/json' };
    const command = 'The greeter should say "Hello, <name>!"; make its test pass.';
    console.log(`$ curl -X POST ${api}/tasks -d '{"command": ${JSON.stringify(command)}}'`);
    const created = (await (await fetch(`${api}/tasks`, { method: 'POST', headers, body: JSON.stringify({ command }) })).json()) as { task: { id: string; slug: string } };
    console.log(`Task ${created.task.slug} queued. Live log (GET /tasks/${created.task.slug}/logs?follow=true):\n`);

    const stream = await fetch(`${api}/tasks/${created.task.id}/logs?follow=true`, { headers: { authorization: headers.authorization } });
    const decoder = new TextDecoder();
    let buffer = '';
    for await (const chunk of stream.body!) {
      buffer += decoder.decode(chunk as Uint8Array, { stream: true });
      const frames = buffer.split('\n\n');
      buffer = frames.pop() ?? '';
      for (const frame of frames) {
        const data = /^data: (.*)$/m.exec(frame)?.[1];
        if (!data || /^event: end$/m.test(frame)) continue;
        const event = JSON.parse(data) as { kind: string; data: Record<string, unknown> };
        const line = describeEvent(event.kind, event.data);
        if (line) console.log(line);
      }
    }

    const task = (await (await fetch(`${api}/tasks/${created.task.id}`, { headers })).json()) as { task: { status: string; prs: Array<{ repoFullName: string; prNumber: number }> } };
    console.log(`\nTask status: ${task.task.status}`);
    for (const pr of task.task.prs) {
      const detail = (await (await fetch(`${api}/repos/${pr.repoFullName}/pulls/${pr.prNumber}`, { headers })).json()) as { pullRequest: { title: string; body: string }; diff: string };
      console.log(`\n=== ${pr.repoFullName}#${pr.prNumber}: ${detail.pullRequest.title} ===\n\n${detail.pullRequest.body}\n${detail.diff}`);
    }
    console.log('Nothing was merged: POST /api/v1/repos/demo/greeter/pulls/1/merge would, once a person decides to.');
  } finally {
    await service.close();
    await model.close();
    await rm(root, { recursive: true, force: true });
  }
}

main().catch((error: unknown) => {
  console.error(`demo failed: ${error instanceof Error ? error.message : String(error)}`);
  process.exit(1);
});
