/** Connecting repositories: the code host's bare copy, the environment's working copy and its config. */
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { addRepository, ENVIRONMENT_REPOSITORY, fullNameFromUrl, setupEnvironment, workspaceRepositories } from '../src/engine/repositories.js';
import { environmentDir, readEnvironmentConfig, parseEnvironmentConfig, writeEnvironmentConfig } from '../src/sandbox/environment.js';
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

  it('connects a repository: bare copy on the code host, working copy and config entry in the environment', async () => {
    const db = api.db.database.db;
    const source = sampleRepository('site');
    const { repository, spec } = await addRepository(db, { dataDir: api.dataDir, workspace: tenant.workspace.name, source });
    expect(repository).toMatchObject({ fullName: 'local/site', dir: 'site', defaultBranch: 'main', source });
    // No dependencies, so nothing to install (and no lock file written into the working copy).
    expect(spec).toEqual({ name: 'local/site', dir: 'site', setup: [], checks: [{ name: 'test', command: 'npm test', timeoutSeconds: 600 }], devServers: [] });

    const environment = environmentDir(api.dataDir, tenant.workspace.id);
    const bare = join(api.dataDir, 'codehost', tenant.workspace.id, 'local/site.git');
    expect(gitIn(bare, 'rev-parse', '--is-bare-repository').trim()).toBe('true');
    expect(gitIn(join(environment, 'site'), 'remote', 'get-url', 'origin').trim()).toBe(bare);
    expect(readFileSync(join(environment, 'site', 'greeting.txt'), 'utf8')).toBe('hi\n');
    expect((await readEnvironmentConfig(environment)).repositories).toEqual([spec]);

    // The environment is a repository too: it tracks its config and ignores the working copies.
    expect(gitIn(environment, 'status', '--porcelain')).toBe('');
    expect(gitIn(environment, 'log', '--format=%s')).toContain('Connect local/site');
    expect(readFileSync(join(environment, '.gitignore'), 'utf8')).toContain('/site/');
    const names = (await workspaceRepositories(db, tenant.workspace.name)).map((row) => row.fullName);
    expect(names).toEqual([ENVIRONMENT_REPOSITORY, 'local/site']);

    // The same name again is a conflict, and it leaves the first one whole.
    await expect(addRepository(db, { dataDir: api.dataDir, workspace: tenant.workspace.name, source })).rejects.toThrow(/already connected/);
    expect(existsSync(bare)).toBe(true);
    // Another owner with the same repository name gets its own directory.
    const other = await addRepository(db, { dataDir: api.dataDir, workspace: tenant.workspace.name, source, fullName: 'acme/site' });
    expect(other.repository.dir).toBe('acme-site');
  });

  it('runs setup commands in the environment itself, sandboxed, stopping at a failure', async () => {
    const db = api.db.database.db;
    const { repository } = await addRepository(db, { dataDir: api.dataDir, workspace: tenant.workspace.name, source: sampleRepository('deps'), fullName: 'acme/deps' });
    const environment = environmentDir(api.dataDir, tenant.workspace.id);
    const config = await readEnvironmentConfig(environment);
    const setup = ['mkdir -p node_modules/dep && echo installed > node_modules/dep/index.txt', `ls ${api.dataDir}`, 'echo never'];
    await writeEnvironmentConfig(environment, { ...config, repositories: config.repositories.map((spec) => (spec.dir === repository.dir ? { ...spec, setup } : spec)) });
    const results = await setupEnvironment(db, api.dataDir, tenant.workspace.name, { hiddenPaths: [api.dataDir], allowUnsandboxed: false });
    const ours = results.filter((result) => result.repository === 'acme/deps');
    expect(ours.map((result) => [result.command, result.passed])).toEqual([
      [setup[0], true],
      [setup[1], false],
    ]);
    expect(ours[1]!.outputTail).toMatch(/No such file or directory/);
    // What it installed is in the environment, where every later fork starts from.
    expect(readFileSync(join(environment, 'deps', 'node_modules', 'dep', 'index.txt'), 'utf8')).toBe('installed\n');
  });

  it('refuses bad sources and names without leaving anything behind', async () => {
    const db = api.db.database.db;
    const input = { dataDir: api.dataDir, workspace: tenant.workspace.name };
    const refusal = (field: string, message: RegExp) => ({ details: { issues: [{ field, message: expect.stringMatching(message) }] } });
    await expect(addRepository(db, { ...input, source: '/no/such/path' })).rejects.toMatchObject(refusal('source', /neither a git URL nor an existing path/));
    await expect(addRepository(db, { ...input, source: mkdtempSync(join(tmpdir(), 'svc-not-git-')), fullName: 'acme/empty' })).rejects.toThrow(/git/);
    expect(existsSync(join(api.dataDir, 'codehost', tenant.workspace.id, 'acme/empty.git'))).toBe(false);
    await expect(addRepository(db, { ...input, source: sampleRepository('x'), fullName: '../evil' })).rejects.toMatchObject(refusal('name', /owner\/repo/));
    await expect(addRepository(db, { ...input, source: sampleRepository('x'), fullName: ENVIRONMENT_REPOSITORY })).rejects.toMatchObject(refusal('name', /environment/));
    await expect(addRepository(db, { ...input, workspace: 'nope', source: sampleRepository('x') })).rejects.toThrow(/workspace "nope" does not exist/);
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
