import { describe, expect, it } from 'vitest';
import { parseEnvironmentConfig } from '../sandbox/environment.js';
import { environmentNotes } from './job-run.js';

describe('environmentNotes', () => {
  const servers = {
    servers: [
      { name: 'web', port: 4100, url: 'http://127.0.0.1:4100', healthy: true },
      { name: 'api', port: 4101, url: 'http://127.0.0.1:4101', healthy: false, error: 'exited 1' },
    ],
    env: () => ({}),
    stop: async () => {},
  };
  const config = (network: boolean) => parseEnvironmentConfig(JSON.stringify({ network, repositories: [] }));

  it("gives a dev server's URL to every agent that can reach it", () => {
    for (const [network, provider] of [[false, 'claude-code'], [false, 'openai'], [true, 'openai'], [true, 'anthropic']] as const) {
      expect(environmentNotes(config(network), servers, { provider, model: 'm' }), `${provider}, network ${network}`).toBe(
        'Dev server web is running at http://127.0.0.1:4100.\nDev server api did not start: exited 1.',
      );
    }
  });

  it('gives an agent CLI in a fork with network access no URL it cannot open', () => {
    for (const provider of ['claude-code', 'codex'] as const) {
      expect(environmentNotes(config(true), servers, { provider, model: 'm' })).toBe(
        'Dev server web is running for the checks; your sandbox cannot reach it.\nDev server api did not start: exited 1.',
      );
    }
  });
});
