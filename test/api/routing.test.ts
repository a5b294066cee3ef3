/**
 * Routing configs on both databases: the /api/v1/routing-configs CRUD (the undeletable `default`, name,
 * agent and effort rules) and how a leading `/trigger` on POST /tasks selects a config and is stripped.
 */
import { eq } from 'drizzle-orm';
import type { LightMyRequestResponse } from 'fastify';
import { describe, expect, it } from 'vitest';
import type { RoutingConfig, TaskAndJob } from '../../src/protocol/rest.js';
import { jobs } from '../../src/store/schema.js';
import { listMessages } from '../../src/store/tasks.js';
import { DEFAULT_AGENT, useTestApi, type Tenant, type TestApi } from '../support/api.js';
import { testDrivers } from '../support/db.js';

const ISO = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/;
const RESEARCH = { mode: 'plan', agent: 'openai/gpt-5', effort: 'high', instructions: 'Cite files.' };

function issueFields(response: LightMyRequestResponse): string[] {
  expect(response.statusCode, response.body).toBe(400);
  const { error } = response.json() as { error: { code: string; message: string; details: { issues: Array<{ field: string }> } } };
  expect(error).toMatchObject({ code: 'validation_error', message: 'Invalid request body' });
  return error.details.issues.map((issue) => issue.field).sort();
}

describe.each(testDrivers)('routing configs on %s', (driver) => {
  let api: TestApi;
  const db = () => api.db.database.db;
  useTestApi(driver, (ready) => ({ api } = ready));

  const configs = async (tenant: Tenant) =>
    ((await tenant.request('GET', '/api/v1/routing-configs')).json() as { routingConfigs: RoutingConfig[] }).routingConfigs;
  async function put(tenant: Tenant, name: string, body: Record<string, unknown>): Promise<RoutingConfig> {
    const response = await tenant.request('PUT', `/api/v1/routing-configs/${name}`, body);
    expect(response.statusCode, response.body).toBe(200);
    return (response.json() as { routingConfig: RoutingConfig }).routingConfig;
  }
  async function create(tenant: Tenant, body: Record<string, unknown>): Promise<TaskAndJob> {
    const response = await tenant.request('POST', '/api/v1/tasks', body);
    expect(response.statusCode, response.body).toBe(201);
    return response.json() as TaskAndJob;
  }
  const storedInstructions = async (jobId: string) => (await db().select().from(jobs).where(eq(jobs.id, jobId)))[0]?.instructions;

  describe('CRUD', () => {
    it('starts every workspace with only `default`: agent mode, medium effort, no trigger', async () => {
      const t = await api.newTenant();
      const response = await t.request('GET', '/api/v1/routing-configs');
      expect(response.statusCode).toBe(200);
      expect(response.json()).toEqual({
        routingConfigs: [
          {
            name: 'default',
            trigger: null,
            mode: 'agent',
            agent: DEFAULT_AGENT,
            effort: 'medium',
            instructions: null,
            createdAt: expect.stringMatching(ISO),
            updatedAt: expect.stringMatching(ISO),
          },
        ],
      });
    });

    it('creates and replaces a trigger config, keeping its createdAt', async () => {
      const t = await api.newTenant();
      const created = await put(t, 'fix', { mode: 'goal', agent: 'codex/gpt-5-codex', effort: 'xhigh', instructions: 'Run tests.' });
      expect(created).toEqual({
        name: 'fix',
        trigger: '/fix',
        mode: 'goal',
        agent: 'codex/gpt-5-codex',
        effort: 'xhigh',
        instructions: 'Run tests.',
        createdAt: expect.stringMatching(ISO),
        updatedAt: expect.stringMatching(ISO),
      });
      const replaced = await put(t, 'fix', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low', instructions: '   ' });
      expect(replaced).toMatchObject({ name: 'fix', mode: 'ask', agent: 'openai/gpt-5', effort: 'low', instructions: null, createdAt: created.createdAt });
      await put(t, 'a-first', { mode: 'agent', agent: 'claude-code/opus', effort: 'ultracode' });
      expect((await configs(t)).map((config) => [config.name, config.trigger])).toEqual([
        ['a-first', '/a-first'],
        ['default', null],
        ['fix', '/fix'],
      ]);
      expect((await configs(t)).find((config) => config.name === 'fix')).toEqual(replaced);
    });

    it('edits `default`, which new tasks then use, but never deletes it', async () => {
      const t = await api.newTenant();
      const edited = await put(t, 'default', { mode: 'plan', agent: 'openai/gpt-5', effort: 'high', instructions: 'Be brief.' });
      expect(edited).toMatchObject({ name: 'default', trigger: null, mode: 'plan' });
      const { task, job } = await create(t, { command: 'uses default' });
      expect(task).toMatchObject({ mode: 'plan', agent: 'openai/gpt-5', effort: 'high' });
      expect(job).toMatchObject({ type: 'PLAN', agentProvider: 'openai' });
      expect(await storedInstructions(job.id)).toBe('Be brief.');

      const refused = await t.request('DELETE', '/api/v1/routing-configs/default');
      expect(refused.statusCode).toBe(409);
      expect(refused.json()).toEqual({ error: { code: 'conflict', message: 'The default routing config cannot be deleted' } });
      expect((await configs(t)).map((config) => config.name)).toEqual(['default']);
    });

    it('deletes a trigger config (204, then 404); its trigger stops matching', async () => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const deleted = await t.request('DELETE', '/api/v1/routing-configs/research');
      expect(deleted.statusCode).toBe(204);
      expect(deleted.body).toBe('');
      for (const name of ['research', 'never-was', 'Bad%20Name']) {
        const missing = await t.request('DELETE', `/api/v1/routing-configs/${name}`);
        expect(missing.statusCode, name).toBe(404);
        expect(missing.json()).toEqual({ error: { code: 'not_found', message: 'Routing config not found' } });
      }
      expect((await configs(t)).map((config) => config.name)).toEqual(['default']);
      const { task, job } = await create(t, { command: '/research how?' });
      expect(task.mode).toBe('agent');
      expect(job.input).toBe('/research how?');
    });

    it.each([
      ['Bad%20Name', 'name'],
      ['UPPER', 'name'],
      ['-dash', 'name'],
      ['_under', 'name'],
      ['a.b', 'name'],
      ['x'.repeat(41), 'name'],
    ])('refuses the config name %s', async (name, field) => {
      const t = await api.newTenant();
      expect(issueFields(await t.request('PUT', `/api/v1/routing-configs/${name}`, { mode: 'agent', agent: 'openai/gpt-5', effort: 'low' }))).toEqual([field]);
      expect((await configs(t)).map((config) => config.name)).toEqual(['default']);
    });

    it('accepts a 40-character name with digits, `-` and `_`', async () => {
      const t = await api.newTenant();
      const name = `0a_${'b-'.repeat(18)}z`;
      expect(name).toHaveLength(40);
      expect((await put(t, name, { mode: 'ask', agent: 'openai/gpt-5', effort: 'low' })).trigger).toBe(`/${name}`);
    });

    it.each([
      [{ mode: 'agent', agent: 'openai', effort: 'low' }, ['agent']],
      [{ mode: 'agent', agent: 'nosuch/model', effort: 'low' }, ['agent']],
      [{ mode: 'agent', agent: 'openai/', effort: 'low' }, ['agent']],
      [{ mode: 'dev_env', agent: 'openai/gpt-5', effort: 'low' }, ['mode']],
      [{ mode: 'agent', agent: 'openai/gpt-5', effort: 'ultracode' }, ['effort']],
      [{ mode: 'agent', agent: 'openai/gpt-5' }, ['effort']],
      [{ agent: 'openai/gpt-5', effort: 'low' }, ['mode']],
      [{ mode: 'agent', agent: 'openai/gpt-5', effort: 'low', instructions: 'x'.repeat(20_001) }, ['instructions']],
    ])('refuses the config body %j', async (body, fields) => {
      const t = await api.newTenant();
      expect(issueFields(await t.request('PUT', '/api/v1/routing-configs/ok', body))).toEqual(fields);
      expect((await configs(t)).map((config) => config.name)).toEqual(['default']);
    });

    it('refuses an agent change on `default` that is not a complete id, leaving it as it was', async () => {
      const t = await api.newTenant();
      const before = await configs(t);
      expect(issueFields(await t.request('PUT', '/api/v1/routing-configs/default', { mode: 'agent', agent: 'anthropic', effort: 'low' }))).toEqual(['agent']);
      expect(await configs(t)).toEqual(before);
    });
  });

  describe('a leading /trigger on POST /tasks', () => {
    it('selects the config: mode, agent, effort and instructions, with the trigger stripped', async () => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const { task, job } = await create(t, { command: '/research   how does auth work?\nDetails follow.' });
      expect(task).toMatchObject({ mode: 'plan', agent: 'openai/gpt-5', effort: 'high', title: 'how does auth work?' });
      expect(job).toMatchObject({ type: 'PLAN', agent: 'openai/gpt-5', agentProvider: 'openai', input: 'how does auth work?\nDetails follow.' });
      expect(await storedInstructions(job.id)).toBe('Cite files.');
      // The thread keeps what the user wrote.
      expect((await listMessages(db(), task.id))[0]?.body).toBe('/research   how does auth work?\nDetails follow.');
    });

    it.each([
      ['upper case', '/RESEARCH go', 'go'],
      ['leading whitespace', '  /research go', 'go'],
      ['a newline after it', '/research\ngo on', 'go on'],
    ])('matches with %s', async (_label, command, input) => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const { task, job } = await create(t, { command });
      expect(task.mode).toBe('plan');
      expect(job.input).toBe(input);
    });

    it.each([
      ['an unknown /word', '/deploy now please'],
      ['a path', '/usr/bin/env is missing'],
      ['a longer word', '/researcher go'],
      ['a trigger glued to punctuation', '/research: go'],
      ['the `default` name', '/default go'],
      ['a trigger not at the start', 'please /research go'],
    ])('leaves %s as written and uses `default`', async (_label, command) => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const { task, job } = await create(t, { command });
      expect(task).toMatchObject({ mode: 'agent', agent: DEFAULT_AGENT, effort: 'medium' });
      expect(job).toMatchObject({ type: 'SWE', input: command });
      expect(await storedInstructions(job.id)).toBeNull();
    });

    it('refuses a trigger with nothing after it', async () => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      expect(issueFields(await t.request('POST', '/api/v1/tasks', { command: '/research  \n ' }))).toEqual(['command']);
      // Without a config of that name the text is an ordinary command.
      expect((await create(t, { command: '/unknown' })).job.input).toBe('/unknown');
    });

    it('lets userIntent override the mode, and agent and effort override theirs', async () => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const intent = await create(t, { command: '/research go', userIntent: 'ASK' });
      expect(intent.task).toMatchObject({ mode: 'ask', agent: 'openai/gpt-5', effort: 'high' });
      expect(intent.job).toMatchObject({ type: 'ASK', input: 'go' });
      const pinned = await create(t, { command: '/research go', agent: 'anthropic/claude-opus-4', effort: 'low' });
      expect(pinned.task).toMatchObject({ mode: 'plan', agent: 'anthropic/claude-opus-4', effort: 'low' });
      expect(pinned.job).toMatchObject({ type: 'PLAN', agentProvider: 'anthropic', input: 'go' });
      expect(await storedInstructions(pinned.job.id)).toBe('Cite files.');
    });

    it("refuses a pinned agent that cannot take the config's ultracode effort", async () => {
      const t = await api.newTenant();
      await put(t, 'deep', { mode: 'agent', agent: 'claude-code/opus', effort: 'ultracode' });
      expect((await create(t, { command: '/deep go' })).task).toMatchObject({ agent: 'claude-code/opus', effort: 'ultracode' });
      expect(issueFields(await t.request('POST', '/api/v1/tasks', { command: '/deep go', agent: 'openai/gpt-5' }))).toEqual(['agent']);
      expect((await create(t, { command: '/deep go', agent: 'openai/gpt-5', effort: 'high' })).task.effort).toBe('high');
    });

    it('applies to the first message only: follow-ups keep the text and the task agent and mode', async () => {
      const t = await api.newTenant();
      await put(t, 'research', RESEARCH);
      const { task } = await create(t, { command: 'plain start' });
      const followUp = await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: '/research more' });
      expect(followUp.statusCode).toBe(201);
      expect((followUp.json() as TaskAndJob).job).toMatchObject({ type: 'SWE', agent: DEFAULT_AGENT, input: '/research more' });

      await put(t, 'default', { mode: 'ask', agent: 'openai/gpt-5', effort: 'low' });
      const later = (await t.request('POST', `/api/v1/tasks/${task.id}/messages`, { message: 'after the default changed' })).json() as TaskAndJob;
      expect(later.job).toMatchObject({ type: 'SWE', agent: DEFAULT_AGENT });
      expect(later.task).toMatchObject({ mode: 'agent', agent: DEFAULT_AGENT, effort: 'medium' });
    });
  });
});
