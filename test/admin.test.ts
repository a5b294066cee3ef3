import { describe, expect, it } from 'vitest';
import { addWorkspace, removeApiKey } from '../src/engine/admin.js';
import { createApiKey, listApiKeys } from '../src/store/api-keys.js';
import { DEFAULT_AGENT, useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';

describe.each(testDrivers)('operator actions on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));
  const db = () => api.db.database.db;

  it('revokes a key only by its id or its whole listed prefix', async () => {
    const { record } = await createApiKey(db(), { workspaceId: tenant.workspace.id, name: 'second' });
    for (const slip of ['', 'service_', record.prefix.slice(0, 12)]) {
      await expect(removeApiKey(db(), tenant.workspace.name, slip)).rejects.toMatchObject({ code: 'validation_error' });
    }
    // Shaped like an id but not one: looked up as a prefix (no database error), found nowhere.
    await expect(removeApiKey(db(), tenant.workspace.name, '00000000-0000-0000-0000-00000000000z')).rejects.toMatchObject({ code: 'not_found' });
    expect((await listApiKeys(db(), tenant.workspace.id)).every((key) => key.revokedAt === null)).toBe(true);
    const revoked = await removeApiKey(db(), tenant.workspace.name, record.prefix);
    expect(revoked.id).toBe(record.id);
    await expect(removeApiKey(db(), tenant.workspace.name, '00000000-0000-4000-8000-000000000000')).rejects.toMatchObject({ code: 'not_found' });
  });

  it('refuses a workspace whose default agent is not a complete id', async () => {
    await expect(addWorkspace(db(), 'half-agent', 'free', 'anthropic')).rejects.toMatchObject({
      code: 'validation_error',
      details: { issues: [{ field: 'default-agent' }] },
    });
    expect((await addWorkspace(db(), 'whole-agent', 'pro', DEFAULT_AGENT)).plan).toBe('pro');
  });
});
