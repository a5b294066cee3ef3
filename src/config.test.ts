import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { ConfigError, loadConfig } from './config.js';

describe('loadConfig', () => {
  it('takes defaults, then the environment, then flags', () => {
    expect(loadConfig({}, {})).toMatchObject({ port: 8080, host: '127.0.0.1', logLevel: 'info', rateLimitPerMinute: 100, rateLimitPerHour: 1000 });
    const env = { SVC_PORT: '9000', SVC_HOST: '0.0.0.0', SVC_RATE_LIMIT_PER_MINUTE: '5', SVC_DATA_DIR: 'data' };
    expect(loadConfig({}, env)).toMatchObject({ port: 9000, host: '0.0.0.0', rateLimitPerMinute: 5, dataDir: resolve('data') });
    expect(loadConfig({ port: '7000', dataDir: '/srv/svc' }, env)).toMatchObject({ port: 7000, host: '0.0.0.0', dataDir: '/srv/svc' });
  });

  it('treats an empty variable as unset', () => {
    const config = loadConfig({}, { SVC_PORT: '', DATABASE_URL: '' });
    expect(config.port).toBe(8080);
    expect(config.databaseUrl).toBeUndefined();
  });

  it('accepts postgres URLs only', () => {
    expect(loadConfig({}, { DATABASE_URL: 'postgresql://u@h/db' }).databaseUrl).toBe('postgresql://u@h/db');
    expect(() => loadConfig({}, { DATABASE_URL: 'mysql://u@h/db' })).toThrow(/databaseUrl \(--database-url or DATABASE_URL\)/);
  });

  it('names the flag and the variable of an invalid value in one line', () => {
    let caught: unknown;
    try {
      loadConfig({}, { SVC_PORT: 'eighty' });
    } catch (error) {
      caught = error;
    }
    expect(caught).toBeInstanceOf(ConfigError);
    const message = (caught as Error).message;
    expect(message).toContain('--port');
    expect(message).toContain('SVC_PORT');
    expect(message).not.toContain('\n');
    expect(() => loadConfig({ logLevel: 'loud' }, {})).toThrow(/SVC_LOG_LEVEL/);
    expect(() => loadConfig({ port: 70000 }, {})).toThrow(ConfigError);
    expect(() => loadConfig({}, { SVC_DEFAULT_AGENT: 'anthropic' })).toThrow(/defaultAgent \(--default-agent or SVC_DEFAULT_AGENT\)/);
  });

  it('reads SVC_TRUST_PROXY as none, any, a hop count or addresses, and refuses anything else', () => {
    expect(loadConfig({}, {}).trustProxy).toBe(false);
    expect(loadConfig({}, { SVC_TRUST_PROXY: 'true' }).trustProxy).toBe(true);
    expect(loadConfig({}, { SVC_TRUST_PROXY: '2' }).trustProxy).toBe(2);
    expect(loadConfig({}, { SVC_TRUST_PROXY: '10.0.0.0/8, 192.168.1.4,::1' }).trustProxy).toEqual(['10.0.0.0/8', '192.168.1.4', '::1']);
    expect(loadConfig({}, { SVC_TRUST_PROXY: 'fd00::/64,10.1.2.3/32' }).trustProxy).toEqual(['fd00::/64', '10.1.2.3/32']);
    for (const bad of ['loopback; rm', '999.1.1.1', '1.2.3.4/33', '::1/129', '10.0.0.0/8/8', '1.2.3', '10.0.0.0/']) {
      expect(() => loadConfig({}, { SVC_TRUST_PROXY: bad }), bad).toThrow(/trustProxy \(--trust-proxy or SVC_TRUST_PROXY\) must be true, false/);
    }
  });
});

