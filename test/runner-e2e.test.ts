/**
 * `svc runner` against the real svc server over real HTTP (the API on a port of 127.0.0.1; PGlite, and
 * PostgreSQL too when DATABASE_URL is set): pairing through the signed-in owner's pairing code,
 * registration of a project from a real git repository, a local task executed by the daemon with the
 * built-in loop against the fake model, its permissions answered by the owner, its journal delivered (a
 * large event in parts), its run completed and a file of it shown to a browser; revocation and
 * reconnection; a run left by a stopped runner reported failed; a cancelled run reported cancelled.
 */
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { RunnerClient } from '../src/runner/client.js';
import { RunnerDaemon, STOPPED_WHILE_EXECUTING } from '../src/runner/daemon.js';
import { RunnerHome } from '../src/runner/home.js';
import { addProject } from '../src/runner/projects.js';
import { startTestApi, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { startFakeModel, type FakeModel } from './support/fake-model.js';
import { pairFor as pairWith, pendingRequests, runnerEnv, taskView, waitFor, widgetsRepository } from './support/runner-e2e.js';
import { signedInUser, type SignedIn } from './support/runners.js';

const BIG = 'x'.repeat(300 * 1024);
let api: TestApi;
let baseUrl = '';
let model: FakeModel | undefined;

const pairFor = (owner: SignedIn, home: RunnerHome, env: NodeJS.ProcessEnv) => pairWith(owner, home, env, baseUrl);

describe.each(testDrivers)('svc runner against the svc server on %s', (driver) => {
  beforeAll(async () => {
    api = await startTestApi(driver);
    await api.app.listen({ port: 0, host: '127.0.0.1' });
    baseUrl = `http://127.0.0.1:${(api.app.server.address() as AddressInfo).port}/api/v1`;
  });
  afterAll(async () => {
    await model?.close();
    await api?.close();
  });

  it('pairs, registers its project, executes a local task asking its owner, delivers the journal (parts too), completes the run, and reconnects after a revocation', async () => {
    model = await startFakeModel(
      [
        { toolCalls: [{ name: 'write_file', arguments: { path: 'widgets/greeting.txt', content: 'hello, world\n' } }] },
        // Its tool_call event is over 240 KiB: it travels in parts.
        { toolCalls: [{ name: 'write_file', arguments: { path: 'widgets/big.txt', content: BIG } }] },
        { toolCalls: [{ name: 'finish', arguments: { summary: 'Greeting changed.' } }] },
      ],
      { models: ['fake-coder'] },
    );
    const owner = await signedInUser(api);
    const home = new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-e2e-home-'))).ensure();
    const repository = widgetsRepository();
    const project = await addProject(home, repository);
    const env = runnerEnv(model.baseUrl);

    // The owner opens the link while signed in; the page's pairing code comes back to the runner.
    const paired = await pairFor(owner, home, env);
    const runnerId = paired.receipt.runnerId;
    const listed = (await owner.request('GET', '/api/v1/runners')).json().runners as Array<{ id: string; projects: Array<{ id: string; repositories: unknown[] }>; capabilities: { models: Record<string, unknown> } }>;
    const registered = listed.find((runner) => runner.id === runnerId)!;
    expect(registered.projects).toEqual([expect.objectContaining({ id: project.id, repositories: [{ name: 'acme/widgets', remoteUrl: 'https://github.com/acme/widgets.git', defaultBranch: 'main' }] })]);
    expect(registered.capabilities.models).toEqual({ 'openai-compatible': [{ id: 'fake-coder', name: 'fake-coder' }] });

    const logs: string[] = [];
    const daemon = new RunnerDaemon({ home, env, log: (line) => logs.push(line) });
    const running = daemon.run();
    try {
      const created = await owner.request('POST', '/api/v1/tasks', {
        command: 'Change the greeting',
        agent: 'openai-compatible/fake-coder',
        local: { runnerId, projectId: project.id, permissionMode: 'ask' },
      });
      expect(created.statusCode, created.body).toBe(201);
      const taskId = created.json().task.id as string;

      // The owner allows each write as it is asked for, until the task is done.
      const allowed: Array<string | null> = [];
      const task = await waitFor('the task to finish', async () => {
        for (const request of await pendingRequests(owner, taskId)) {
          const answered = await owner.request('POST', `/api/v1/tasks/${taskId}/permissions/${request.requestId}`, { decision: 'allow' });
          expect(answered.statusCode, answered.body).toBe(200);
          allowed.push(request.tool);
        }
        const view = await taskView(owner, taskId);
        return view.task.status !== 'PENDING' && view.task.status !== 'IN_PROGRESS' ? view : null;
      });
      expect(allowed).toEqual(['write_file', 'write_file']);
      const journal = (await owner.request('GET', `/api/v1/tasks/${taskId}/logs`)).body;
      expect(journal).toContain('"kind":"permission"');
      expect(journal).toContain('"kind":"final"');
      expect([task.task.status, task.latestJob.status, task.latestJob.finalAnswer], logs.join('\n')).toEqual(['COMPLETED', 'COMPLETED', 'Greeting changed.']);
      const folder = home.taskDir(taskId);
      expect(readFileSync(join(folder, 'widgets', 'greeting.txt'), 'utf8')).toBe('hello, world\n');
      expect(readFileSync(join(folder, 'widgets', 'big.txt'), 'utf8')).toBe(BIG);
      // The large event was stored whole.
      expect(journal).toContain(BIG);

      // A browser that cannot reach the computer asks for a file of the task; the runner answers it.
      const asked = await owner.request('POST', `/api/v1/tasks/${taskId}/review-requests`, { path: 'widgets/greeting.txt' });
      expect(asked.statusCode, asked.body).toBe(201);
      const reviewId = asked.json().reviewRequest.id as string;
      const review = await waitFor('the review answer', async () => {
        const seen = (await owner.request('GET', `/api/v1/tasks/${taskId}/review-requests/${reviewId}`)).json().reviewRequest as { status: string; content: string | null };
        return seen.status === 'pending' ? null : seen;
      });
      expect(review).toMatchObject({ status: 'answered', content: Buffer.from('hello, world\n').toString('base64') });
      expect(readFileSync(join(repository, 'greeting.txt'), 'utf8')).toBe('hello\n');

      // The owner revokes the connection: the daemon stops and says to pair again, which reconnects it.
      const oldCredential = home.readConnection()!.credential;
      const revoked = await owner.request('POST', `/api/v1/runners/${runnerId}/revoke`);
      expect(revoked.statusCode, revoked.body).toBe(200);
      await expect(running).rejects.toThrow(/revoked.*svc runner pair/);
      const again = await pairFor(owner, home, env);
      expect([again.reconnected, again.receipt.runnerId, again.receipt.reconnected]).toEqual([true, runnerId, true]);
      expect(home.readConnection()!.credential).not.toBe(oldCredential);
    } finally {
      daemon.stop();
      await running.catch(() => undefined);
    }
  });

  it('reports a run left executing by a stopped runner as failed, without running it again, and a cancelled one as cancelled', async () => {
    const script = [
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo first' } }] },
      { toolCalls: [{ name: 'run_command', arguments: { command: 'echo second' } }] },
    ];
    const second = await startFakeModel(script, { models: ['fake-coder'] });
    try {
      const owner = await signedInUser(api);
      const home = new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-e2e-home-'))).ensure();
      const project = await addProject(home, widgetsRepository());
      const env = runnerEnv(second.baseUrl);
      const { receipt } = await pairFor(owner, home, env);
      const start = async (command: string) => {
        const created = await owner.request('POST', '/api/v1/tasks', { command, agent: 'openai-compatible/fake-coder', local: { runnerId: receipt.runnerId, projectId: project.id, permissionMode: 'ask' } });
        expect(created.statusCode, created.body).toBe(201);
        return created.json().task.id as string;
      };

      const stopped = await start('Run something');
      const first = new RunnerDaemon({ home, env, log: () => undefined });
      const firstRunning = first.run();
      await waitFor('the first permission', async () => (await pendingRequests(owner, stopped)).length > 0);
      first.stop();
      await firstRunning;
      const modelCalls = second.requests.length;

      const daemon = new RunnerDaemon({ home, env, log: () => undefined });
      const running = daemon.run();
      try {
        const failed = await waitFor('the stopped run to be reported', async () => {
          const view = await taskView(owner, stopped);
          return view.latestJob.status === 'FAILED' ? view : null;
        });
        expect(failed.latestJob.error).toBe(STOPPED_WHILE_EXECUTING);
        expect(second.requests.length).toBe(modelCalls);
        expect((await owner.request('GET', `/api/v1/tasks/${stopped}/logs`)).body).toContain(STOPPED_WHILE_EXECUTING);

        const cancelled = await start('Run something else');
        await waitFor('the second permission', async () => (await pendingRequests(owner, cancelled)).length > 0);
        const cancel = await owner.request('POST', `/api/v1/tasks/${cancelled}/cancel`);
        expect(cancel.statusCode, cancel.body).toBe(200);
        const runId = (await taskView(owner, cancelled)).latestJob.id;
        await waitFor('the cancelled run to be settled', async () => !existsSync(home.runDir(runId)));
        expect((await taskView(owner, cancelled)).latestJob.status).toBe('CANCELLED');
        // The server lists a cancelled run until its receipt arrives: the receipt did.
        const runner = new RunnerClient({ baseUrl, credential: home.readConnection()!.credential, maxAttempts: 1 });
        expect((await runner.listRuns()).runs.map((run) => run.runId)).not.toContain(runId);
      } finally {
        daemon.stop();
        await running;
      }
    } finally {
      await second.close();
    }
  });
});
