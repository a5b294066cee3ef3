/**
 * End to end through the real agent loop (a scripted model over HTTP), the sandboxed fork, the checks
 * and the built-in code host: tasks become verified pull requests, and people merge them.
 */
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { parseEnvironmentConfig } from '../src/sandbox/environment.js';
import { testDrivers } from './support/db.js';
import { journal, useTestEngine, type TestEngine } from './support/engine.js';
import { gitIn, sampleRepository } from './support/repos.js';

describe.each(testDrivers)('delivery on %s', (driver) => {
  let engine: TestEngine;
  useTestEngine(driver, (ready) => (engine = ready));

  const create = (body: Record<string, unknown>) => engine.create(body);
  const get = async (url: string) => {
    const response = await engine.tenant.request('GET', url);
    expect(response.statusCode, response.body).toBe(200);
    return response.json();
  };

  it('opens one pull request with proof in each of two repositories, and a merge completes the task', async () => {
    await engine.connect(sampleRepository('web'), 'acme/web');
    await engine.connect(sampleRepository('api'), 'acme/api');
    expect((await get('/api/v1/repos')).repositories.map((repo: { fullName: string }) => repo.fullName)).toEqual(['svc/environment', 'acme/web', 'acme/api']);

    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: 'web/greeting.txt', content: 'hello\n' } }] },
      { toolCalls: [{ name: 'edit_file', arguments: { path: 'api/greeting.txt', old: 'hi', new: 'hello' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Both services now say hello.' } }] },
    );
    const task = await create({ command: 'Make both services say hello' });
    const done = await engine.settled(task.id);
    expect(done.task.status, JSON.stringify(done.latestJob)).toBe('IN_REVIEW');
    expect(done.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Both services now say hello.' });
    const prs = done.task.prs as Array<{ repoFullName: string; prNumber: number; state: string; prUrl: string }>;
    expect(prs.map((pr) => [pr.repoFullName, pr.prNumber, pr.state]).sort()).toEqual([
      ['acme/api', 1, 'open'],
      ['acme/web', 1, 'open'],
    ]);
    expect(prs[0]!.prUrl).toMatch(/^http:\/\/svc\.test\/repos\/acme\/(web|api)\/pulls\/1$/);

    const { pullRequest, diff } = await get('/api/v1/repos/acme/web/pulls/1');
    expect(pullRequest).toMatchObject({ state: 'open', headBranch: `svc/${task.slug}`, baseBranch: 'main', taskId: task.id });
    expect(pullRequest.checks).toEqual([expect.objectContaining({ name: 'test', command: 'npm test', passed: true, exitCode: 0 })]);
    expect(pullRequest.checks[0].outputTail).toContain('greeting ok');
    expect(pullRequest.body).toContain('## Proof');
    expect(pullRequest.body).toContain('| test | `npm test` | passed |');
    expect(pullRequest.body).toContain('`greeting.txt` (+1 −1)');
    expect(diff).toContain('-hi');
    expect(diff).toContain('+hello');
    // The environment repository was not touched, so it has no pull request.
    expect((await get('/api/v1/pulls')).pullRequests).toHaveLength(2);

    // The journal holds each check and each pushed pull request.
    const logs = (await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    expect(logs).toContain('"kind":"check"');
    expect(logs.match(/"kind":"pull_request"/g)).toHaveLength(2);

    // Nothing is merged automatically: main is as it was until a person merges.
    const bare = join(engine.api.dataDir, 'codehost', engine.tenant.workspace.id, 'acme/web.git');
    expect(gitIn(bare, 'show', 'main:greeting.txt')).toBe('hi\n');
    const merged = await engine.tenant.request('POST', '/api/v1/repos/acme/web/pulls/1/merge');
    expect(merged.statusCode, merged.body).toBe(200);
    expect(merged.json().pullRequest).toMatchObject({ state: 'merged', mergedAt: expect.any(String) });
    expect(gitIn(bare, 'show', 'main:greeting.txt')).toBe('hello\n');
    expect((await get(`/api/v1/tasks/${task.id}`)).task.status).toBe('COMPLETED');
    // The environment follows with a new version, so the next fork starts from the merged code.
    expect(await engine.api.environments.readFile(engine.tenant.workspace.id, 'web/greeting.txt')).toBe('hello\n');
    expect(engine.api.environments.current(engine.tenant.workspace.id)!.record.reason).toBe('Update acme/web');

    const again = await engine.tenant.request('POST', '/api/v1/repos/acme/web/pulls/1/merge');
    expect(again.statusCode).toBe(409);
    expect(again.json().error).toMatchObject({ code: 'conflict', message: 'Pull request is merged' });
    const closed = await engine.tenant.request('POST', '/api/v1/repos/acme/api/pulls/1/close');
    expect(closed.json().pullRequest).toMatchObject({ state: 'closed', closedAt: expect.any(String) });
    expect((await engine.tenant.request('GET', '/api/v1/repos/acme/api/pulls/7')).statusCode).toBe(404);
    // Another workspace sees none of it.
    const other = await engine.api.newTenant();
    expect((await other.request('GET', '/api/v1/repos/acme/web/pulls/1')).statusCode).toBe(404);
    expect((await other.request('POST', '/api/v1/repos/acme/web/pulls/1/merge')).statusCode).toBe(404);
    expect((await other.request('GET', '/api/v1/pulls')).json().pullRequests).toEqual([]);
  });

  it("fails the delivery of a repository git cannot read, naming it and git's error, and still delivers the others", async () => {
    await engine.connect(sampleRepository('readable'), 'acme/readable');
    await engine.connect(sampleRepository('broken'), 'acme/broken');
    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: 'readable/greeting.txt', content: 'hello\n' } }] },
      { toolCalls: [{ name: 'edit_file', arguments: { path: 'broken/greeting.txt', old: 'hi', new: 'hello' } }] },
      // After the edit, the repository's index breaks: `git status` fails there.
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo garbage > broken/.git/index' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Both say hello.' } }] },
    );
    const task = await create({ command: 'Make both say hello' });
    const done = await engine.settled(task.id);
    expect(done.latestJob.status, JSON.stringify(done.latestJob)).toBe('FAILED');
    expect(done.latestJob.error).toMatch(/^acme\/broken has a working tree that could not be read in the fork, so nothing of it was delivered \(git: .*index file smaller than expected.*\); the pull requests of the other repositories \(1\) were pushed$/);
    const prs = done.task.prs as Array<{ repoFullName: string; state: string }>;
    expect(prs.map((pr) => [pr.repoFullName, pr.state])).toEqual([['acme/readable', 'open']]);
    expect((await get('/api/v1/repos/acme/readable/pulls/1')).diff).toContain('+hello');
    const notes = journal((await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body)
      .filter((event) => event.kind === 'message')
      .map((event) => String(event.data.text));
    expect(notes).toContainEqual(expect.stringMatching(/^acme\/broken has a working tree that could not be read in the fork, so nothing of it was delivered \(git: .*index/));
  });

  it('plans, waits for approval, then implements the approved plan into a pull request', async () => {
    await engine.connect(sampleRepository('shop'), 'acme/shop');
    engine.script.push(
      { toolCalls: [{ name: 'read_file', arguments: { path: 'shop/greeting.txt' } }] },
      { toolCalls: [{ name: 'submit_plan', arguments: { plan: '1. Change shop/greeting.txt to hello' } }] },
    );
    const task = await create({ command: 'Greet customers properly', userIntent: 'PLAN' });
    const planned = await engine.settled(task.id);
    expect(planned.task.status).toBe('AWAITING_APPROVAL');
    expect(planned.latestJob).toMatchObject({ type: 'PLAN', plan: '1. Change shop/greeting.txt to hello', planOutcome: 'READY' });
    expect(planned.task.prs).toEqual([]);
    // The plan's run changed nothing and its fork is gone.
    const requests = engine.model.requests.length;
    // submit_plan is offered only in plan mode, write tools only outside it.
    const tools = engine.model.requests.at(-1)!.tools!.map((tool) => tool.function.name);
    expect(tools).toContain('submit_plan');
    expect(tools).not.toContain('write_file');

    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: 'shop/greeting.txt', content: 'hello\n' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Done as planned.' } }] },
    );
    const approved = await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/approve-plan`);
    expect(approved.statusCode, approved.body).toBe(201);
    const implemented = await engine.settled(task.id);
    expect(implemented.task.status).toBe('IN_REVIEW');
    expect(implemented.latestJob).toMatchObject({ type: 'IMPLEMENT_PLAN', status: 'COMPLETED' });
    expect(JSON.stringify(engine.model.requests[requests]!.messages)).toContain('1. Change shop/greeting.txt to hello');
    expect(implemented.task.prs).toEqual([expect.objectContaining({ repoFullName: 'acme/shop', state: 'open' })]);
  });

  it('answers an ask task from a read-only run: no branch, no pull request', async () => {
    await engine.connect(sampleRepository('docs'), 'acme/docs');
    engine.script.push(
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cat docs/greeting.txt && echo changed > docs/greeting.txt' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'It says hi.' } }] },
    );
    const task = await create({ command: 'What does the docs greeting say?', userIntent: 'ASK' });
    const done = await engine.settled(task.id);
    expect(done.task.status, JSON.stringify(done.latestJob)).toBe('COMPLETED');
    expect(done.latestJob).toMatchObject({ type: 'ASK', finalAnswer: 'It says hi.' });
    expect(done.task.prs).toEqual([]);
    const bare = join(engine.api.dataDir, 'codehost', engine.tenant.workspace.id, 'acme/docs.git');
    expect(gitIn(bare, 'branch', '--list')).not.toContain(task.slug);
    // The command saw the file and could not change it: the fork is read-only.
    const logs = (await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    expect(logs).toContain('hi');
    expect(logs).toMatch(/Read-only file system/);
  });

  it('iterates on a goal until its check holds, keeping each iteration\'s evidence', async () => {
    await engine.connect(sampleRepository('goal', { expected: 'hello' }), 'acme/goal');
    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: 'goal/greeting.txt', content: 'hullo\n' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'First try.' } }] },
      { toolCalls: [{ name: 'write_file', arguments: { path: 'goal/greeting.txt', content: 'hello\n' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Second try.' } }] },
    );
    const task = await create({ command: 'Make the greeting test pass\ncheck: cd goal && node test.js', userIntent: 'GOAL' });
    const done = await engine.settled(task.id);
    expect(done.latestJob).toMatchObject({ type: 'GOAL', status: 'COMPLETED', finalAnswer: 'Second try.' });
    expect(done.task.status).toBe('IN_REVIEW');
    const logs = (await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body;
    const checks = journal(logs).filter((event) => event.kind === 'check').map((event) => event.data as { round: number; passed: boolean });
    expect(checks.map((check) => [check.round, check.passed])).toEqual([
      [1, false],
      [2, true],
    ]);
    // The second round was told why the first failed.
    expect(JSON.stringify(engine.model.requests.at(-2)!.messages)).toContain('expected hello, got hullo');
    const { pullRequest } = await get('/api/v1/repos/acme/goal/pulls/1');
    expect(pullRequest.checks).toEqual([expect.objectContaining({ name: 'goal', passed: true })]);
  });

  it('asks a clarifying question, continues on the reply, and a follow-up updates the same pull request', async () => {
    await engine.connect(sampleRepository('chat'), 'acme/chat');
    engine.script.push({ toolCalls: [{ name: 'ask_user', arguments: { question: 'Hello or hi there?' } }] });
    const task = await create({ command: 'Change the chat greeting' });
    const asked = await engine.settled(task.id);
    expect(asked.task.status).toBe('AWAITING_INPUT');
    expect(asked.latestJob).toMatchObject({ finalAnswer: 'Hello or hi there?' });

    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: 'chat/greeting.txt', content: 'hello\n' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Says hello.' } }] },
    );
    await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Hello, please.' });
    const first = await engine.settled(task.id);
    expect(first.task.status).toBe('IN_REVIEW');
    const seen = JSON.stringify(engine.model.requests.at(-2)!.messages);
    expect(seen).toContain('Hello or hi there?');
    expect(seen).toContain('Hello, please.');
    const { pullRequest: opened } = await get('/api/v1/repos/acme/chat/pulls/1');

    engine.script.push(
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cat chat/greeting.txt && echo "# chat" > chat/README.md' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Added a readme.' } }] },
    );
    await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Add a readme too' });
    const second = await engine.settled(task.id);
    expect(second.task.status).toBe('IN_REVIEW');
    // The follow-up continued in the task's files (it saw "hello") and pushed to the same pull request.
    expect((await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body).toContain('hello');
    expect(second.task.prs).toEqual([expect.objectContaining({ repoFullName: 'acme/chat', prNumber: 1, state: 'open' })]);
    const { pullRequest: updated, diff } = await get('/api/v1/repos/acme/chat/pulls/1');
    expect(updated.headSha).not.toBe(opened.headSha);
    expect(diff).toContain('+# chat');
    expect(diff).toContain('+hello');
  });

  it("keeps the agent's edits to the environment config out of its own verification, and delivers commits it made before a question", async () => {
    await engine.connect(sampleRepository('tamper'), 'acme/tamper');
    const config = JSON.stringify({ network: true, repositories: [{ name: 'acme/tamper', dir: 'tamper', checks: [{ name: 'test', command: 'true' }] }] });
    engine.script.push(
      { toolCalls: [{ name: 'write_file', arguments: { path: '.svc/environment.json', content: config } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cd tamper && echo hullo > greeting.txt && git -c user.name=a -c user.email=a@a commit -qam wip' } }] },
      { toolCalls: [{ name: 'ask_user', arguments: { question: 'Is hullo fine?' } }] },
    );
    const task = await create({ command: 'Change the greeting' });
    expect((await engine.settled(task.id)).task.status).toBe('AWAITING_INPUT');

    // A read-only question in between sees the work and leaves the task's fork as it is.
    engine.script.push({ toolCalls: [{ name: 'read_file', arguments: { path: 'tamper/greeting.txt' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'It says hullo.' } }] });
    await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'What does it say now?', userIntent: 'ASK' });
    expect((await engine.settled(task.id)).latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'It says hullo.' });

    for (let i = 0; i < 3; i++) engine.script.push({ toolCalls: [{ name: 'finish', arguments: { summary: 'Done.' } }] });
    await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Yes, ship it' });
    const done = await engine.settled(task.id);
    expect(done.task.status).toBe('IN_REVIEW');
    // The proof is the environment's own check (npm test, which fails on hullo), not the agent's `true`.
    const { pullRequest, diff } = await get('/api/v1/repos/acme/tamper/pulls/1');
    expect(pullRequest.checks).toEqual([expect.objectContaining({ command: 'npm test', passed: false })]);
    expect(pullRequest.body).toContain('| test | `npm test` | failed (exit 1) |');
    // The commit made before the question, never pushed until now, is in the pull request.
    expect(diff).toContain('+hullo');
    // The config change itself is up for review on the environment's repository, not applied.
    const environmentPr = await get('/api/v1/repos/svc/environment/pulls/1');
    expect(environmentPr.diff).toContain('"command":"true"');
    const { repositories } = parseEnvironmentConfig(engine.api.environments.current(engine.tenant.workspace.id)!.record.config);
    expect(repositories.find((repository) => repository.dir === 'tamper')!.checks).toEqual([{ name: 'test', command: 'npm test', timeoutSeconds: 600 }]);
  });

  it("keeps a task's fork on its environment version while it holds work no pull request has", async () => {
    await engine.connect(sampleRepository('drift'), 'acme/drift');
    // Task A commits in its fork and stops to ask.
    engine.script.push({ toolCalls: [{ name: 'run_command', arguments: { command: 'cd drift && echo a > a.txt && git add -A && git -c user.name=a -c user.email=a@a commit -qm a' } }] }, { toolCalls: [{ name: 'ask_user', arguments: { question: 'Go on?' } }] });
    const a = await create({ command: 'Task A' });
    expect((await engine.settled(a.id)).task.status).toBe('AWAITING_INPUT');
    // Task B changes the greeting, and a person merges it: the environment moves on to a new version.
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'drift/greeting.txt', content: 'hello\n' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'B done.' } }] });
    const b = await create({ command: 'Task B' });
    const settledB = await engine.settled(b.id);
    expect(settledB.task.status, JSON.stringify(settledB.latestJob)).toBe('IN_REVIEW');
    expect((await engine.tenant.request('POST', '/api/v1/repos/acme/drift/pulls/1/merge')).statusCode).toBe(200);

    // A's follow-up goes on in its own fork, whose files never changed under it (a fresh fork would lose
    // commit a), and the journal says so; its pull request holds its own work, all of it.
    engine.script.push(
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cat drift/greeting.txt; echo a2 > drift/a2.txt' } }] },
      // Its check fails on the old greeting: each round goes back to the agent, which finishes again.
      ...Array.from({ length: 3 }, () => ({ toolCalls: [{ name: 'finish', arguments: { summary: 'A done.' } }] })),
    );
    await engine.tenant.request('POST', `/api/v1/tasks/${a.id}/messages`, { message: 'Yes' });
    const settledA = await engine.settled(a.id);
    expect(settledA.task.status, JSON.stringify(settledA.latestJob)).toBe('IN_REVIEW');
    const events = journal((await engine.tenant.request('GET', `/api/v1/tasks/${a.id}/logs`)).body);
    const results = events.filter((event) => event.kind === 'tool_result' && event.data.name === 'run_command');
    const greeting = String(results.at(-1)!.data.output);
    expect(greeting).toContain('hi\n');
    expect(greeting).not.toContain('hello');
    expect(events.filter((event) => event.kind === 'message').map((event) => event.data.text)).toContainEqual(
      expect.stringMatching(/^The environment changed since this task's fork was made .* \(acme\/drift\)/),
    );
    const { diff } = await get('/api/v1/repos/acme/drift/pulls/2');
    expect(diff).toContain('+a\n');
    expect(diff).toContain('+a2');
    expect(diff).not.toContain('greeting.txt');
  });

  it("moves a task whose work is all in its pull requests to the environment's new version", async () => {
    // Their checks hold whatever the greeting says: each run ends in one round.
    await engine.connect(sampleRepository('moving', { expected: 'hi' }), 'acme/moving');
    await engine.connect(sampleRepository('beside', { expected: 'hello' }), 'acme/beside');
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'moving/c.txt', content: 'c\n' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'C done.' } }] });
    const c = await create({ command: 'Task C' });
    expect((await engine.settled(c.id)).task.status).toBe('IN_REVIEW');
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'beside/greeting.txt', content: 'hello\n' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'D done.' } }] });
    const d = await create({ command: 'Task D' });
    expect((await engine.settled(d.id)).task.status).toBe('IN_REVIEW');
    expect((await engine.tenant.request('POST', '/api/v1/repos/acme/beside/pulls/1/merge')).statusCode).toBe(200);

    // C's follow-up starts from a fresh fork of the merged environment, with its own branch brought back.
    engine.script.push(
      { toolCalls: [{ name: 'run_command', arguments: { command: 'cat beside/greeting.txt moving/c.txt; echo c2 >> moving/c.txt' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'C again.' } }] },
    );
    await engine.tenant.request('POST', `/api/v1/tasks/${c.id}/messages`, { message: 'More' });
    expect((await engine.settled(c.id)).task.status).toBe('IN_REVIEW');
    const results = journal((await engine.tenant.request('GET', `/api/v1/tasks/${c.id}/logs`)).body).filter((event) => event.kind === 'tool_result' && event.data.name === 'run_command');
    expect(String(results.at(-1)!.data.output)).toContain('hello\nc\n');
    const { diff } = await get('/api/v1/repos/acme/moving/pulls/1');
    expect(diff).toContain('+c2');
    expect(diff).not.toContain('greeting.txt');
  });

  it("sets a closed pull request's work aside, so that the task's next pull request does not carry it again", async () => {
    await engine.connect(sampleRepository('turned', { expected: 'hi' }), 'acme/turned');
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'turned/first.txt', content: 'first\n' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'First try.' } }] });
    const task = await create({ command: 'Try something' });
    expect((await engine.settled(task.id)).task.status).toBe('IN_REVIEW');
    expect((await engine.tenant.request('POST', '/api/v1/repos/acme/turned/pulls/1/close')).statusCode).toBe(200);

    engine.script.push(
      { toolCalls: [{ name: 'run_command', arguments: { command: 'ls turned; git -C turned branch --list "svc-closed/*"; echo second > turned/second.txt' } }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Second try.' } }] },
    );
    await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Not like that; try another way' });
    const done = await engine.settled(task.id);
    expect(done.task.status).toBe('IN_REVIEW');
    const events = journal((await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/logs`)).body);
    expect(events.filter((event) => event.kind === 'message').map((event) => event.data.text)).toContainEqual(expect.stringMatching(/^Pull request #1 of acme\/turned was closed without being merged, so its work was set aside on the branch svc-closed\/1/));
    const listing = String(events.filter((event) => event.kind === 'tool_result' && event.data.name === 'run_command').at(-1)!.data.output);
    expect(listing).not.toContain('first.txt');
    expect(listing).toContain('svc-closed/1');
    const { pullRequest, diff } = await get('/api/v1/repos/acme/turned/pulls/2');
    expect(pullRequest.state).toBe('open');
    expect(diff).toContain('+second');
    expect(diff).not.toContain('first');
  });
});
