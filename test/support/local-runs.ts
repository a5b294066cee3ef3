/** Local work through the real routes: a local task of an owner on a runner, claims and event uploads. */
import { expect } from 'vitest';
import type { SignedIn, TestRunner } from './runners.js';

export const LOCAL_AGENT = 'openai-compatible/fake';

/** A local task on the runner's first project, in `ask` mode unless `extra` says otherwise. */
export async function localTask(owner: SignedIn, runner: TestRunner, extra: Record<string, unknown> = {}) {
  const created = await owner.request('POST', '/api/v1/tasks', {
    command: 'Fix the flaky test',
    agent: LOCAL_AGENT,
    local: { runnerId: runner.id, projectId: runner.projectId, permissionMode: 'ask' },
    ...extra,
  });
  expect(created.statusCode, created.body).toBe(201);
  return created.json() as { task: { id: string; slug: string; status: string }; job: { id: string } };
}

/** Claims a run; answers the generation it got. */
export async function claimRun(runner: TestRunner, runId: string): Promise<number> {
  const claimed = await runner.request('POST', `/api/v1/runners/runs/${runId}/claim`, {});
  expect(claimed.statusCode, claimed.body).toBe(200);
  return claimed.json().run.generation;
}

export const uploadEvents = (runner: TestRunner, batches: unknown[]) => runner.request('POST', '/api/v1/runners/events', { batches });

export const messageEvent = (text: string) => ({ kind: 'message', data: { text } });
