/** Connecting repositories: the code host's bare copy, the environment's working copy and its config. */
import { cpSync, existsSync, mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { addRepository, ENVIRONMENT_REPOSITORY, fullNameFromUrl, setupEnvironment, workspaceRepositories } from '../src/engine/repositories.js';
import { parseEnvironmentConfig } from '../src/sandbox/environment.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { gitIn, sampleRepository } from './support/repos.js';
import { runSvc } from './support/processes.js';

describe('repository names and the environment config', () => {
  it('derives owner/repo from git URLs only', () => {
    expect(fullNameFromUrl('https://git.example.com/acme/web.git')).toBe('acme/web');
    expect(fullNameFromUrl('https://git.example.com/group/sub/acme/web')).toBe('acme/web');
    expect(fullNameFromUrl('git@git.example.com:acme/api.git')).toBe('acme/api');
    expect(fullNameFromUrl('ssh://git@host:22/acme/api.git')).toBe('acme/api');
    expect(fullNameFromUrl('/srv/repos/web')).toBeNull();
    expect(fullNameFromUrl('web')).toBeNull();
  });

  it('refuses a broken config with a message naming the problem', () => {
    expect(() => parseEnvironmentConfig('{')).toThrow(/\.svc\/environment\.json is not valid JSON/);
    expect(() => parseEnvironmentConfig('{"repositories":[{"name":"x","dir":"x"}]}')).toThrow(/repositories\.0\.name must be owner\/repo/);
    expect(() => parseEnvironmentConfig('{"repositories":[{"name":"a/b","dir":"../x"}]}')).toThrow(/repositories\.0\.dir/);
    const twice = '{"repositories":[{"name":"a/b","dir":"x"},{"name":"a/c","dir":"x"}]}';
    expect(() => parseEnvironmentConfig(twice)).toThrow(/two repositories use the directory x/);
    expect(parseEnvironmentConfig(null)).toEqual({ network: false, repositories: [] });
  });
});

describe.each(testDrivers)('svc admin repo add on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  /** Runs a command over the environment's current version, in a read-only sandbox. */
  const inEnvironment = async (...argv: string[]) => {
    const store = api.environments.store(tenant.workspace.id);
    const result = await store.run(store.current()!, argv);
    expect(result.exitCode, result.stderr).toBe(0);
    return result.stdout;
  };
  const configNow = () => parseEnvironmentConfig(api.environments.current(tenant.workspace.id)!.record.config);

  it('connects a repository: bare copy on the code host, working copy and config entry in the environment', async () => {
    const db = api.db.database.db;
    const source = sampleRepository('site');
    const { repository, spec } = await addRepository(db, api.environments, { workspace: tenant.workspace.name, source, setup: false });
    expect(repository).toMatchObject({ fullName: 'local/site', dir: 'site', defaultBranch: 'main', source });
    // No dependencies, so nothing to install (and no lock file written into the working copy).
    expect(spec).toEqual({ name: 'local/site', dir: 'site', setup: [], checks: [{ name: 'test', command: 'npm test', timeoutSeconds: 600 }], devServers: [] });

    const bare = join(api.dataDir, 'codehost', tenant.workspace.id, 'local/site.git');
    expect(gitIn(bare, 'rev-parse', '--is-bare-repository').trim()).toBe('true');
    expect(await api.environments.readFile(tenant.workspace.id, 'site/greeting.txt')).toBe('hi\n');
    expect(await inEnvironment('git', '-C', 'site', 'log', '--format=%s')).toBe('initial\n');
    expect(configNow().repositories).toEqual([spec]);
    // The version knows what each repository has checked out.
    expect(api.environments.current(tenant.workspace.id)!.record.heads.site).toBe(gitIn(bare, 'rev-parse', 'main').trim());

    // The environment is a repository too: it tracks its config and ignores the working copies, and the
    // code host has the commit that connected the repository.
    expect(await inEnvironment('git', 'status', '--porcelain')).toBe('');
    expect(await inEnvironment('git', 'log', '--format=%s')).toContain('Connect local/site');
    expect(await api.environments.readFile(tenant.workspace.id, '.gitignore')).toContain('/site/');
    const environmentBare = join(api.dataDir, 'codehost', tenant.workspace.id, `${ENVIRONMENT_REPOSITORY}.git`);
    expect(gitIn(environmentBare, 'log', '--format=%s', 'main')).toContain('Connect local/site');
    const names = (await workspaceRepositories(db, tenant.workspace.name)).map((row) => row.fullName);
    expect(names).toEqual([ENVIRONMENT_REPOSITORY, 'local/site']);

    // The same name again is a conflict, and it leaves the first one whole.
    await expect(addRepository(db, api.environments, { workspace: tenant.workspace.name, source, setup: false })).rejects.toThrow(/already connected/);
    expect(existsSync(bare)).toBe(true);
    // Another owner with the same repository name gets its own directory.
    const other = await addRepository(db, api.environments, { workspace: tenant.workspace.name, source, fullName: 'acme/site', setup: false });
    expect(other.repository.dir).toBe('acme-site');
  });

  it('runs setup commands in a sandboxed change of the environment, stopping at a failure', async () => {
    const db = api.db.database.db;
    const { repository } = await addRepository(db, api.environments, { workspace: tenant.workspace.name, source: sampleRepository('deps'), fullName: 'acme/deps', setup: false });
    const before = api.environments.current(tenant.workspace.id)!;
    const setup = ['mkdir -p node_modules/dep && echo installed > node_modules/dep/index.txt', `ls ${api.dataDir}`, 'echo never'];
    const config = configNow();
    const edited = { ...config, repositories: config.repositories.map((spec) => (spec.dir === repository.dir ? { ...spec, setup } : spec)) };
    // A repository connected without setup is left to the operator: editing the config runs nothing yet.
    expect((await api.environments.setConfig(tenant.workspace, JSON.stringify(edited))).setup).toEqual([]);
    const results = await setupEnvironment(db, api.environments, tenant.workspace.name);
    const ours = results.filter((result) => result.repository === 'acme/deps');
    expect(ours.map((result) => [result.command, result.passed])).toEqual([
      [setup[0], true],
      [setup[1], false],
    ]);
    expect(ours[1]!.outputTail).toMatch(/No such file or directory/);
    // What it installed is in the environment's new version, where every later fork starts from; the
    // version before it is unchanged (a fork of it would never see the install appear).
    expect(await api.environments.readFile(tenant.workspace.id, 'deps/node_modules/dep/index.txt')).toBe('installed\n');
    expect(await api.environments.store(tenant.workspace.id).readFile(before, 'deps/node_modules/dep/index.txt')).toBeNull();
    const after = api.environments.current(tenant.workspace.id)!;
    expect(after.version).toBeGreaterThan(before.version);
    expect(after.record.setups.deps).toMatchObject({ commands: setup, passed: false, head: after.record.heads.deps });

    // The config edit went through svc/environment like any change, and a changed setup command is now due
    // (it ran before), as is nothing else.
    expect(await inEnvironment('git', 'log', '-1', '--format=%s')).toBe('Edit the environment config\n');
    const fixed = { ...edited, repositories: edited.repositories.map((spec) => (spec.dir === repository.dir ? { ...spec, setup: [setup[0]!] } : spec)) };
    const rerun = await api.environments.setConfig(tenant.workspace, JSON.stringify(fixed));
    expect(rerun.setup.map((result) => [result.command, result.passed])).toEqual([[setup[0], true]]);
    expect(api.environments.current(tenant.workspace.id)!.record.setups.deps).toMatchObject({ passed: true });
    await expect(api.environments.setConfig(tenant.workspace, '{"repositories": 3}')).rejects.toThrow(/repositories/);
  });

  it('refuses bad sources and names without leaving anything behind', async () => {
    const db = api.db.database.db;
    const input = { workspace: tenant.workspace.name, setup: false };
    const refusal = (field: string, message: RegExp) => ({ details: { issues: [{ field, message: expect.stringMatching(message) }] } });
    await expect(addRepository(db, api.environments, { ...input, source: '/no/such/path' })).rejects.toMatchObject(refusal('source', /neither a git URL nor an existing path/));
    await expect(addRepository(db, api.environments, { ...input, source: mkdtempSync(join(tmpdir(), 'svc-not-git-')), fullName: 'acme/empty' })).rejects.toMatchObject(refusal('source', /could not be cloned with git/));
    expect(existsSync(join(api.dataDir, 'codehost', tenant.workspace.id, 'acme/empty.git'))).toBe(false);
    await expect(addRepository(db, api.environments, { ...input, source: sampleRepository('x'), fullName: '../evil' })).rejects.toMatchObject(refusal('name', /owner\/repo/));
    await expect(addRepository(db, api.environments, { ...input, source: sampleRepository('x'), fullName: ENVIRONMENT_REPOSITORY })).rejects.toMatchObject(refusal('name', /environment/));
    await expect(addRepository(db, api.environments, { ...input, workspace: 'nope', source: sampleRepository('x') })).rejects.toThrow(/workspace "nope" does not exist/);
  });
});

describe.each(testDrivers)('POST /api/v1/repos on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  const allowed = mkdtempSync(join(tmpdir(), 'svc-allowed-'));
  useTestApi(driver, (ready) => ({ api, tenant } = ready), { repoPaths: [allowed] });

  const sampleUnder = (root: string, name: string) => {
    const dir = join(root, name);
    cpSync(sampleRepository(name), dir, { recursive: true });
    return dir;
  };

  it('connects a repository from a path under an allowed root, with its setup, for the caller\'s workspace only', async () => {
    const source = sampleUnder(allowed, 'served');
    const created = await tenant.request('POST', '/api/v1/repos', { source, name: 'acme/served' });
    expect(created.statusCode, created.body).toBe(201);
    expect(created.json()).toEqual({ repository: { fullName: 'acme/served', dir: 'served', defaultBranch: 'main', createdAt: expect.any(String) }, setup: [] });
    expect(await api.environments.readFile(tenant.workspace.id, 'served/greeting.txt')).toBe('hi\n');
    const listed = (await tenant.request('GET', '/api/v1/repos')).json().repositories.map((repository: { fullName: string }) => repository.fullName);
    expect(listed).toEqual([ENVIRONMENT_REPOSITORY, 'acme/served']);
    const again = await tenant.request('POST', '/api/v1/repos', { source, name: 'acme/served' });
    expect(again.statusCode).toBe(409);
    expect(again.json().error.code).toBe('conflict');
    const other = await api.newTenant();
    expect((await other.request('GET', '/api/v1/repos')).json().repositories).toEqual([]);
  });

  it("refuses paths outside the allowed roots, relative paths and local git transports: a key must not read the server's files", async () => {
    const outside = sampleRepository('outside');
    for (const source of [outside, `${allowed}/../${outside.split('/').slice(-2).join('/')}`, 'relative/path', `file://${outside}`, `file://localhost${outside}`, 'ext::sh -c touch% /tmp/pwned']) {
      const refused = await tenant.request('POST', '/api/v1/repos', { source });
      expect(refused.statusCode, source).toBe(400);
      expect(refused.json().error).toMatchObject({ code: 'validation_error', details: { issues: [{ field: 'source' }] } });
    }
    // A link inside an allowed root that leads out of it is outside too, and so is a repository whose
    // git directory is elsewhere (a `.git` link or a `gitdir:` file).
    symlinkSync(outside, join(allowed, 'sneaky'));
    expect((await tenant.request('POST', '/api/v1/repos', { source: join(allowed, 'sneaky') })).statusCode).toBe(400);
    mkdirSync(join(allowed, 'linked-git'));
    symlinkSync(join(outside, '.git'), join(allowed, 'linked-git', '.git'));
    mkdirSync(join(allowed, 'pointed-git'));
    writeFileSync(join(allowed, 'pointed-git', '.git'), `gitdir: ${join(outside, '.git')}\n`);
    for (const source of [join(allowed, 'linked-git'), join(allowed, 'pointed-git')]) {
      const refused = await tenant.request('POST', '/api/v1/repos', { source, name: 'acme/linked' });
      expect(refused.statusCode, source).toBe(400);
    }
    expect((await tenant.request('POST', '/api/v1/repos', {})).json().error.details.issues).toEqual([{ field: 'source', message: expect.any(String) }]);
    expect((await tenant.request('GET', '/api/v1/repos')).json().repositories.map((repository: { fullName: string }) => repository.fullName)).not.toContain('local/outside');
  });

  it('takes a URL-shaped source for a URL only: never a path in disguise, a local transport or an option', async () => {
    const outside = sampleRepository('hidden');
    // Another workspace's bare copy on the code host, which no key of this workspace may read.
    const other = await api.newTenant();
    await addRepository(api.db.database.db, api.environments, { workspace: other.workspace.name, source: sampleRepository('theirs'), fullName: 'them/theirs', setup: false });
    const theirs = join(api.dataDir, 'codehost', other.workspace.id, 'them/theirs.git');
    const climbs = '/..'.repeat(12);
    for (const source of [
      `x@y:${climbs}${outside}//`,
      `https://h${climbs}${outside}//`,
      `https://h${climbs}${theirs}//`,
      `ssh://git@h${climbs}${theirs}`,
      `https://h/a/%2e%2e/%2E%2E${outside}//`,
      'ext::sh -c touch% /tmp/pwned',
      `fd::0`,
      '--upload-pack=touch /tmp/pwned',
      '-u x@y:a/b',
      'a@-oProxyCommand=x:acme/web',
      'ssh://-oProxyCommand=x/acme/web',
    ]) {
      const refused = await tenant.request('POST', '/api/v1/repos', { source, name: 'acme/leak' });
      expect(refused.statusCode, source).toBe(400);
      expect(refused.json().error, source).toMatchObject({ code: 'validation_error', details: { issues: [{ field: 'source' }] } });
    }
    // A URL whose owner/repo cannot be read off it needs a name; it never falls back to a path.
    const unnamed = await tenant.request('POST', '/api/v1/repos', { source: `https://h/${outside.split('/').at(-1)}` });
    expect(unnamed.statusCode).toBe(400);
    expect(unnamed.json().error.details.issues).toEqual([{ field: 'name', message: expect.stringMatching(/owner\/repo/) }]);
    // A URL git cannot fetch is the caller's mistake, answered in the error envelope.
    const unreachable = await tenant.request('POST', '/api/v1/repos', { source: 'https://127.0.0.1:1/acme/gone.git' });
    expect(unreachable.statusCode, unreachable.body).toBe(400);
    expect(unreachable.json().error.details.issues).toEqual([{ field: 'source', message: expect.stringMatching(/could not be cloned/) }]);
    const names = (await tenant.request('GET', '/api/v1/repos')).json().repositories.map((repository: { fullName: string }) => repository.fullName);
    expect(names).not.toContain('acme/leak');
    expect(names).not.toContain('acme/gone');
  });

  it('refuses a path with ".." segments, even one that leads back under an allowed root', async () => {
    sampleUnder(allowed, 'climbed');
    for (const source of [`${allowed}/climbed/../climbed`, `${allowed}/../${allowed.split('/').at(-1)}/climbed`]) {
      const refused = await tenant.request('POST', '/api/v1/repos', { source, name: 'acme/climbed' });
      expect(refused.statusCode, source).toBe(400);
      expect(refused.json().error.details.issues, source).toEqual([{ field: 'source', message: 'must not contain ".." path segments' }]);
    }
    expect((await tenant.request('POST', '/api/v1/repos', { source: `${allowed}/climbed`, name: 'acme/climbed' })).statusCode).toBe(201);
  });

  it('clones the checked real path through git (no hardlinked objects)', async () => {
    const source = sampleUnder(allowed, 'copied');
    const created = await tenant.request('POST', '/api/v1/repos', { source: `${source}/`, name: 'acme/copied' });
    expect(created.statusCode, created.body).toBe(201);
    const bare = join(api.dataDir, 'codehost', tenant.workspace.id, 'acme/copied.git');
    // A local clone would hardlink the source's loose objects; through the transport they arrive packed.
    expect(gitIn(bare, 'count-objects', '-v')).toMatch(/^count: 0$/m);
  });
});

describe('svc admin repo (the command)', () => {
  it('adds and lists, and answers bad input with one line and a non-zero exit', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'svc-repo-cli-'));
    expect((await runSvc(['admin', 'workspace', 'create', 'acme', '--data-dir', dataDir])).code).toBe(0);
    const added = await runSvc(['admin', 'repo', 'add', sampleRepository('cli'), '--workspace', 'acme', '--name', 'acme/cli', '--data-dir', dataDir]);
    expect(added.code, added.stderr).toBe(0);
    expect(added.stdout).toMatch(/^Connected acme\/cli to "acme" \(branch main, directory cli\/; checks: test\)\.$/m);
    const listed = await runSvc(['admin', 'repo', 'list', '--workspace', 'acme', '--json', '--data-dir', dataDir]);
    expect((JSON.parse(listed.stdout) as Array<{ fullName: string }>).map((row) => row.fullName)).toEqual([ENVIRONMENT_REPOSITORY, 'acme/cli']);
    const bad = await runSvc(['admin', 'repo', 'add', '/no/such/path', '--workspace', 'acme', '--data-dir', dataDir]);
    expect(bad.code).not.toBe(0);
    expect(bad.stderr).toMatch(/^svc: source \/no\/such\/path is neither a git URL nor an existing path\n$/);
  }, 120_000);
});
