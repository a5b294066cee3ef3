import { describe, expect, it } from 'vitest';
import { grantCredits } from '../src/engine/admin.js';
import { parseAgentId, type AgentId } from '../src/domain/agents.js';
import { creditBalance, jobUsage, recordUsage } from '../src/store/credits.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

describe.each(testDrivers)('credits on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const db = () => api.db.database.db;

  it("starts a workspace with its plan's allowance", async () => {
    expect(await creditBalance(db(), tenant.workspace.id)).toBe(5_000_000);
    const pro = await api.newTenant({ plan: 'pro' });
    expect(await creditBalance(db(), pro.workspace.id)).toBe(100_000_000);
  });

  it('charges model usage to the job and its workspace, exactly', async () => {
    const owner = await api.newTenant();
    const { job } = (await owner.request('POST', '/api/v1/tasks', { command: 'metered' })).json();
    const agent = parseAgentId('anthropic/claude-sonnet-4-5') as AgentId;
    const call = { workspaceId: owner.workspace.id, jobId: job.id, agentId: 'anthropic/claude-sonnet-4-5', agent };
    await recordUsage(db(), { ...call, inputTokens: 1000, outputTokens: 2000 });
    await recordUsage(db(), { ...call, inputTokens: 10, outputTokens: 0 });
    expect(await jobUsage(db(), job.id)).toEqual({ costMicro: 33_030, inputTokens: 1010, outputTokens: 2000 });
    expect(await creditBalance(db(), owner.workspace.id)).toBe(5_000_000 - 33_030);
  });

  it('lets operators grant credits and refuses bad amounts', async () => {
    const owner = await api.newTenant();
    expect(await grantCredits(db(), owner.workspace.name, '2.5')).toEqual({ grantedMicro: 2_500_000, balanceMicro: 7_500_000 });
    await expect(grantCredits(db(), owner.workspace.name, '-3')).rejects.toMatchObject({
      code: 'validation_error',
      details: { issues: [{ field: 'amount', message: expect.stringMatching(/positive number/) }] },
    });
    await expect(grantCredits(db(), 'no-such-workspace', '1')).rejects.toThrow(/does not exist/);
    expect(await creditBalance(db(), owner.workspace.id)).toBe(7_500_000);
  });
});
