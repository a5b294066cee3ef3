import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { hashApiKey } from '../src/domain/api-keys.js';
import { createTestSchema, dropTestSchema, postgresUrl } from './support/db.js';
import { killAll, runSvc, startSvcServer, urlWithSchema } from './support/processes.js';

afterEach(() => killAll());

/** Each `svc` process opens its store (PGlite: ~3 s); under a loaded CI machine a flow of them takes a while. */
const SPAWN_TIMEOUT_MS = 240_000;

type Store = { name: string; args: () => string[]; env: () => NodeJS.ProcessEnv };

const stores: Store[] = [];
let dataDir = '';
let schema = '';
stores.push({ name: 'the embedded database', args: () => ['--data-dir', dataDir], env: () => ({ DATABASE_URL: undefined }) });
if (process.env.DATABASE_URL) {
  stores.push({ name: 'PostgreSQL', args: () => [], env: () => ({ DATABASE_URL: urlWithSchema(postgresUrl(), schema) }) });
}

beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), 'svc-cli-'));
  if (process.env.DATABASE_URL) schema = await createTestSchema();
});
afterAll(async () => {
  if (schema) await dropTestSchema(schema);
});

describe.each(stores)('svc admin on $name', (store) => {
  const svc = (...args: string[]) => runSvc([...args, ...store.args()], store.env());

  it('manages workspaces and API keys end to end', async () => {
    const created = await svc('admin', 'workspace', 'create', 'acme', '--plan', 'pro');
    expect(created.code, created.stderr).toBe(0);
    expect(created.stdout).toMatch(/Created workspace "acme" \(plan pro/);

    const duplicate = await svc('admin', 'workspace', 'create', 'acme');
    expect(duplicate.code).toBe(1);
    expect(duplicate.stderr).toBe('svc: workspace "acme" already exists\n');
    const badPlan = await svc('admin', 'workspace', 'create', 'other', '--plan', 'gold');
    expect(badPlan.code).toBe(1);
    expect(badPlan.stderr).toMatch(/^svc: plan must be one of free, pro, max\n$/);

    const granted = await svc('admin', 'credits', 'grant', '2.5', '--workspace', 'acme');
    expect(granted.code, granted.stderr).toBe(0);
    expect(granted.stdout).toBe('Granted 2.500000 credits to "acme"; balance 102.500000\n');
    const badGrant = await svc('admin', 'credits', 'grant', 'lots', '--workspace', 'acme');
    expect(badGrant.code).toBe(1);
    expect(badGrant.stderr).toMatch(/^svc: amount must be a positive number/);

    const key = await svc('admin', 'api-key', 'create', '--workspace', 'acme', '--name', 'ci', '--expires-in', '7d');
    expect(key.code, key.stderr).toBe(0);
    const lines = key.stdout.trimEnd().split('\n');
    const secret = lines[lines.length - 1]!;
    expect(secret).toMatch(/^service_[A-Za-z0-9_-]{43}$/);
    expect(key.stdout).toContain('expires');

    const listed = await svc('admin', 'api-key', 'list', '--workspace', 'acme', '--json');
    expect(listed.code).toBe(0);
    const keys = JSON.parse(listed.stdout);
    expect(keys).toHaveLength(1);
    expect(keys[0]).toMatchObject({ name: 'ci', prefix: secret.slice(0, 14), revokedAt: null });
    expect(listed.stdout).not.toContain(secret);
    expect(listed.stdout).not.toContain(hashApiKey(secret));
    expect(JSON.stringify(keys)).not.toMatch(/hash/i);
    const table = await svc('admin', 'api-key', 'list', '--workspace', 'acme');
    expect(table.stdout).toMatch(/PREFIX .*STATUS/);
    expect(table.stdout).toContain('active');
    expect(table.stdout).not.toContain(secret);
    expect(table.stdout).not.toContain(hashApiKey(secret));

    // The key works against a server on the same store, until it is revoked.
    const server = await startSvcServer(store.args(), store.env());
    const before = await fetch(`${server.url}/api/v1/tasks`, { headers: { authorization: `Bearer ${secret}` } });
    expect(before.status).toBe(200);
    expect(await server.stop()).toBe(0);

    const revoked = await svc('admin', 'api-key', 'revoke', secret.slice(0, 14), '--workspace', 'acme');
    expect(revoked.code, revoked.stderr).toBe(0);
    expect(revoked.stdout).toMatch(/^Revoked API key/);
    const after = await startSvcServer(store.args(), store.env());
    const refused = await fetch(`${after.url}/api/v1/tasks`, { headers: { authorization: `Bearer ${secret}` } });
    expect(refused.status).toBe(401);
    expect(await after.stop()).toBe(0);
    const status = await svc('admin', 'api-key', 'list', '--workspace', 'acme');
    expect(status.stdout).toContain('revoked');
  }, SPAWN_TIMEOUT_MS);

  it('creates a user whose one-time sign-in link, printed last, signs in once', async () => {
    expect((await svc('admin', 'workspace', 'create', 'team')).code).toBe(0);
    const created = await svc('admin', 'user', 'create', '--email', 'ada@example.com', '--workspace', 'team', '--name', 'Ada', '--role', 'admin', '--public-url', 'https://svc.example.com/');
    expect(created.code, created.stderr).toBe(0);
    expect(created.stdout).toMatch(/^Created user ada@example\.com \(id [0-9a-f-]{36}\) with a personal workspace; added to "team" as admin\.\n/);
    const first = created.stdout.trimEnd().split('\n').at(-1)!;
    expect(first).toMatch(/^https:\/\/svc\.example\.com\/auth\/sign-in\/[A-Za-z0-9_-]{43}$/);
    // A fresh link replaces it; without --public-url the link points where `svc server` listens by default.
    const defaults = { ...store.env(), SVC_HOST: undefined, SVC_PORT: undefined, SVC_PUBLIC_URL: undefined };
    const fresh = await runSvc(['admin', 'user', 'sign-in-link', '--email', 'ADA@example.com', ...store.args()], defaults);
    expect(fresh.code, fresh.stderr).toBe(0);
    const second = fresh.stdout.trimEnd().split('\n').at(-1)!;
    expect(second).toMatch(/^http:\/\/127\.0\.0\.1:8080\/auth\/sign-in\/[A-Za-z0-9_-]{43}$/);

    const listed = await svc('admin', 'user', 'list', '--json');
    expect(listed.code, listed.stderr).toBe(0);
    expect(JSON.parse(listed.stdout)).toEqual([
      expect.objectContaining({
        email: 'ada@example.com',
        name: 'Ada',
        hasPassword: false,
        workspaces: [expect.objectContaining({ role: 'owner', personal: true, name: expect.stringMatching(/^personal-[0-9a-f]{12}$/) }), expect.objectContaining({ name: 'team', role: 'admin', personal: false })],
      }),
    ]);
    expect(listed.stdout).not.toMatch(/hash|sign-in\//i);

    // While the server holds the embedded database, svc admin cannot open it: these come first.
    const key = await svc('admin', 'api-key', 'create', '--workspace', 'team');
    expect(key.code, key.stderr).toBe(0);
    expect((await svc('admin', 'workspace', 'create', 'other')).code).toBe(0);
    const server = await startSvcServer(store.args(), store.env());
    // Opening a link shows its button; the button's POST signs in.
    const open = (link: string, method = 'POST') => fetch(`${server.url}${new URL(link).pathname}`, { method, redirect: 'manual' });
    expect((await open(first, 'GET')).status).toBe(410);
    expect((await open(first)).status).toBe(410);
    const shown = await open(second, 'GET');
    expect(shown.status).toBe(200);
    expect(await shown.text()).toContain('ada@example.com');
    const opened = await open(second);
    expect(opened.status).toBe(303);
    expect(opened.headers.get('location')).toBe('/');
    const cookie = opened.headers.get('set-cookie')!.split(';')[0]!;
    const session = await fetch(`${server.url}/api/v1/auth/session`, { headers: { cookie } });
    expect(session.status).toBe(200);
    expect(((await session.json()) as { user: unknown }).user).toMatchObject({ email: 'ada@example.com', name: 'Ada' });
    expect((await open(second)).status).toBe(410);

    // An account another workspace made through the API joins this one only when the operator confirms it.
    const made = await fetch(`${server.url}/api/v1/members`, {
      method: 'POST',
      headers: { authorization: `Bearer ${key.stdout.trimEnd().split('\n').at(-1)!}`, 'content-type': 'application/json' },
      body: JSON.stringify({ email: 'lin@example.com' }),
    });
    expect(made.status).toBe(201);
    expect(await server.stop()).toBe(0);
    const refused = await svc('admin', 'user', 'create', '--email', 'lin@example.com', '--workspace', 'other');
    expect(refused.code).toBe(1);
    expect(refused.stderr).toBe(
      'svc: the account of lin@example.com was made by another workspace and no operator has confirmed it; check that it belongs to that person, then add --confirm\n',
    );
    const confirmed = await svc('admin', 'user', 'create', '--email', 'lin@example.com', '--workspace', 'other', '--confirm');
    expect(confirmed.code, confirmed.stderr).toBe(0);
    expect(confirmed.stdout).toMatch(/^User lin@example\.com \(id [0-9a-f-]{36}\) already exists; added to "other" as member\.\n/);
  }, SPAWN_TIMEOUT_MS);

  it('answers bad input with one line and a non-zero exit', async () => {
    const cases: Array<[string[], number, RegExp]> = [
      [['admin', 'api-key', 'create', '--workspace', 'nope'], 1, /^svc: workspace "nope" does not exist\n$/],
      [['admin', 'api-key', 'create', '--workspace', 'nope', '--expires-in', '7x'], 1, /^svc: expires-in must be/],
      [['admin', 'api-key', 'revoke', 'service_zzzzzz', '--workspace', 'nope'], 1, /^svc: workspace "nope" does not exist\n$/],
      [['admin', 'workspace', 'create', 'bad name!'], 1, /^svc: name must be/],
    ];
    for (const [args, code, stderr] of cases) {
      const result = await svc(...args);
      expect(result.code, args.join(' ')).toBe(code);
      expect(result.stderr).toMatch(stderr);
      expect(result.stderr.trim().split('\n')).toHaveLength(1);
    }
  }, SPAWN_TIMEOUT_MS);
});

describe('svc usage errors', () => {
  it('exits 2 on an unknown command or a missing option', async () => {
    const unknown = await runSvc(['admin', 'bogus']);
    expect(unknown.code).toBe(2);
    expect(unknown.stderr).toMatch(/unknown command 'bogus'/);
    const missing = await runSvc(['admin', 'api-key', 'create']);
    expect(missing.code).toBe(2);
    expect(missing.stderr).toMatch(/--workspace/);
  });

  it('refuses an invalid configuration in one line', async () => {
    const result = await runSvc(['server', '--port', 'eighty']);
    expect(result.code).toBe(1);
    expect(result.stderr).toMatch(/^svc: invalid configuration: port \(--port or SVC_PORT\)/);
  });
});
