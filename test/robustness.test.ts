/**
 * What goes wrong in production, end to end: a cancel in the middle of a command, a model that answers
 * nonsense or cuts its answer off, and an agent that tries to look outside its fork.
 */
import { execFileSync } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { environmentDir } from '../src/sandbox/environment.js';
import { testDrivers } from './support/db.js';
import { journal, useTestEngine, type TestEngine } from './support/engine.js';
import { eventually } from './support/processes.js';
import { sampleRepository } from './support/repos.js';

const processesMatching = (marker: string): string[] =>
  execFileSync('ps', ['-eo', 'pid,args'], { encoding: 'utf8' })
    .split('\n')
    .filter((line) => line.includes(marker) && !line.includes('ps -eo'));

describe.each(testDrivers)('robustness on %s', (driver) => {
  let engine: TestEngine;
  useTestEngine(driver, (ready) => (engine = ready));

  const create = (body: Record<string, unknown>) => engine.create(body);
  const logsOf = async (taskId: string) => (await engine.tenant.request('GET', `/api/v1/tasks/${taskId}/logs`)).body;

  it('cancel stops a running command and its whole process group, keeps the journal, and a follow-up resumes', async () => {
    const marker = `${Math.floor(Math.random() * 1e6) + 1000}.5`;
    engine.script.push({ toolCalls: [{ name: 'run_command', arguments: { command: `(sleep ${marker} &) ; sleep ${marker}` } }] });
    const task = await create({ command: 'Run something slow' });
    await engine.until(task.id, () => processesMatching(`sleep ${marker}`).length >= 2);
    const cancelled = await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/cancel`);
    expect(cancelled.json().task.status).toBe('CANCELLED');
    // The command and the child it left in the background are both gone, well before the sleep ends.
    expect(await eventually(() => processesMatching(`sleep ${marker}`).length === 0, 10_000)).toBe(true);
    expect(await logsOf(task.id)).toContain('"name":"run_command"');

    engine.script.push({ toolCalls: [{ name: 'finish', arguments: { summary: 'Resumed and done.' } }] });
    const resumed = await engine.tenant.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'Never mind, just finish' });
    expect(resumed.statusCode).toBe(201);
    const done = await engine.settled(task.id);
    expect(done.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Resumed and done.' });
    const jobs = (await engine.tenant.request('GET', `/api/v1/tasks/${task.id}/jobs`)).json().jobs as Array<{ status: string }>;
    expect(jobs.map((job) => job.status)).toEqual(['CANCELLED', 'COMPLETED']);
    // The follow-up saw the thread, the cancelled turn included.
    expect(JSON.stringify(engine.model.requests.at(-1)!.messages)).toContain('Run something slow');
  });

  it('fails the job cleanly when the model answers nonsense, calls unknown tools or cuts its answer off', async () => {
    for (const answer of [{ raw: '{"id":"x","choices":[{"index":0,"message":{"role":"assis' }, { raw: 'not json at all' }, { status: 500 }]) {
      engine.script.push(answer, answer, answer);
      const task = await create({ command: 'Anything', userIntent: 'ASK' });
      const done = await engine.settled(task.id);
      expect(done.task.status).toBe('FAILED');
      expect(done.latestJob.error).toMatch(/^model call failed: /);
      engine.script.length = 0;
    }
    engine.script.push(
      { toolCalls: [{ name: 'teleport', arguments: {} }] },
      { toolCalls: [{ name: 'read_file', arguments: '{"path": ' }] },
      { toolCalls: [{ name: 'finish', arguments: { summary: 'Recovered.' } }] },
    );
    const task = await create({ command: 'Anything', userIntent: 'ASK' });
    const done = await engine.settled(task.id);
    // An unknown tool or bad arguments go back to the model as an error, and the run goes on.
    expect(done.latestJob).toMatchObject({ status: 'COMPLETED', finalAnswer: 'Recovered.' });
  });

  it("refuses a sandboxed command's attempt to read the server's data dir or another fork", async () => {
    await engine.connect(sampleRepository('vault'), 'acme/vault');
    const environment = environmentDir(engine.api.dataDir, engine.tenant.workspace.id);
    const forksRoot = join(engine.api.dataDir, 'forks');
    const secret = randomUUID();
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'vault/secret.txt', content: secret } }] }, { toolCalls: [{ name: 'ask_user', arguments: { question: 'Keep it?' } }] });
    const first = await create({ command: 'Keep a secret' });
    expect((await engine.settled(first.id)).task.status).toBe('AWAITING_INPUT');

    const probes = [
      `ls ${join(environment, 'layers')}`,
      `ls ${forksRoot}`,
      `ls ${engine.api.dataDir}`,
      'cat /workspace/vault/secret.txt',
      `grep -rl ${secret} ${forksRoot} ${engine.api.dataDir} /tmp /var /root /home`,
    ];
    const command = probes.map((probe, index) => `${probe}; echo "probe ${index} exit=$?"`).join('; ');
    engine.script.push({ toolCalls: [{ name: 'run_command', arguments: { command } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'Looked around.' } }] });
    const second = await create({ command: 'Look around', userIntent: 'ASK' });
    expect((await engine.settled(second.id)).latestJob).toMatchObject({ status: 'COMPLETED' });
    const output = String(journal(await logsOf(second.id)).find((event) => event.kind === 'tool_result')!.data.output);
    // Each probe failed on its own: neither the data dir nor the other task's fork is there, and the secret is nowhere.
    for (let index = 0; index < probes.length; index++) expect(output).toMatch(new RegExp(`probe ${index} exit=[1-9]`));
    expect(output).not.toContain(secret);
  });
});
