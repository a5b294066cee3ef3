/**
 * Environment versions: changes become new versions and never touch a version a fork uses; concurrent
 * changes both land; stacks are flattened; unused versions are collected; an environment from before
 * versions is adopted; the environment catches up with merges and runs setup when a manifest changed.
 */
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, statSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { Environments } from '../src/engine/environments.js';
import { addRepository } from '../src/engine/repositories.js';
import { parseEnvironmentConfig } from '../src/sandbox/environment.js';
import { EnvironmentStore, MAX_LAYERS, sameFiles, type EnvironmentChange } from '../src/sandbox/environment-versions.js';
import { ForkManager, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';
import { useTestApi, type Tenant, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { gitIn, sampleRepository } from './support/repos.js';

const policy = { hiddenPaths: [], allowUnsandboxed: false };

async function sh(fork: Fork, script: string): Promise<string> {
  const result = await fork.run(['sh', '-c', script], { timeoutMs: 20_000 });
  expect(result.stderr).toBe('');
  expect(result.exitCode).toBe(0);
  return result.stdout;
}

function newStore(): { store: EnvironmentStore; forks: ForkManager; root: string } {
  const root = mkdtempSync(join(tmpdir(), 'svc-env-versions-'));
  return { root, store: new EnvironmentStore(join(root, 'environment'), policy), forks: new ForkManager(join(root, 'forks'), policy) };
}

describe('environment versions (the store)', () => {
  it('publishes each change as a new version and never changes one a fork is using', async () => {
    const { store, forks } = newStore();
    const first = await store.init('first', async (dir) => {
      mkdirSync(join(dir, 'app'));
      writeFileSync(join(dir, 'app', 'a.txt'), 'one\n');
      writeFileSync(join(dir, 'app', 'gone.txt'), 'soon gone\n');
    });
    expect(first.version).toBe(1);
    // A fork of version 1, with its overlay held mounted as a dev server would hold it.
    const fork = await forks.create('task', first);
    const holder = await fork.holdMount();
    expect(await sh(fork, 'cat app/a.txt')).toBe('one\n');

    const { version: second } = await store.change('edit', async (change) => {
      await sh(change.fork, 'echo two > app/a.txt && rm app/gone.txt && echo new > app/b.txt');
    });
    expect(second.version).toBe(2);
    expect(second.layers).toHaveLength(2);
    expect(second.record.reason).toBe('edit');
    expect(await store.readFile(second, 'app/a.txt')).toBe('two\n');
    expect(await store.readFile(second, 'app/gone.txt')).toBeNull();
    // The fork still sees version 1 exactly, mounted or not.
    expect(await sh(fork, 'cat app/a.txt app/gone.txt; ls app')).toBe('one\nsoon gone\na.txt\ngone.txt\n');
    await holder?.stop(0);
    expect(await sh(fork, 'cat app/a.txt')).toBe('one\n');
    expect(await store.readFile(first, 'app/a.txt')).toBe('one\n');
    // A fork reopened later comes back on its own version, not the current one.
    expect((await forks.open('task', fork.info.mode))!.info.lower.version).toBe(1);
  });

  it('applies a change again on the newer version when another published first, and publishes nothing on failure or discard', async () => {
    const { store } = newStore();
    await store.init('first', async (dir) => writeFileSync(join(dir, 'log.txt'), 'start\n'));
    let release!: () => void;
    const held = new Promise<void>((resolve) => (release = resolve));
    let slowRuns = 0;
    const slow = store.change('slow', async (change: EnvironmentChange) => {
      slowRuns += 1;
      await sh(change.fork, 'echo slow >> log.txt');
      if (slowRuns === 1) await held;
    });
    // Let the slow change start, then another one lands first.
    while (slowRuns === 0) await new Promise((resolve) => setTimeout(resolve, 10));
    const { version: fast } = await store.change('fast', async (change) => sh(change.fork, 'echo fast >> log.txt'));
    release();
    const { version: last } = await slow;
    expect(slowRuns).toBe(2);
    expect([fast.version, last.version]).toEqual([2, 3]);
    expect(await store.readFile(last, 'log.txt')).toBe('start\nfast\nslow\n');

    await expect(store.change('broken', async (change) => {
      await sh(change.fork, 'echo broken >> log.txt');
      throw new Error('the change failed');
    })).rejects.toThrow('the change failed');
    const { version: unchanged } = await store.change('nothing', async (change) => {
      change.discard = true;
    });
    expect(unchanged.version).toBe(3);
    expect(store.current()!.version).toBe(3);
    // No change fork is left behind.
    expect(readdirSync(join(store.root, 'changes')).filter((entry) => !entry.startsWith('.'))).toEqual([]);
  });

  it('flattens a deep stack into one layer with the same files', async () => {
    const { store } = newStore();
    await store.init('first', async (dir) => writeFileSync(join(dir, 'deleted.txt'), 'x\n'));
    await store.change('delete', async (change) => sh(change.fork, 'rm deleted.txt'));
    let index = 0;
    for (; store.current()!.layers.length > 1 || index === 0; index++) {
      expect(store.current()!.layers.length).toBeLessThanOrEqual(MAX_LAYERS);
      await store.change(`change ${index}`, async (change) => sh(change.fork, `echo ${index} > n.txt`));
    }
    const current = store.current()!;
    expect(current.record.reason).toMatch(/^Flatten version \d+$/);
    expect(index).toBe(MAX_LAYERS - 1);
    expect(await store.readFile(current, 'n.txt')).toBe(`${index - 1}\n`);
    expect(await store.readFile(current, 'deleted.txt')).toBeNull();
    // It shows what the version it flattened showed: forks of that one are not behind it.
    const flattened = store.read(current.version - 1)!;
    expect(sameFiles(current, flattened.version)).toBe(true);
    expect(sameFiles(current, flattened.version - 1)).toBe(false);
    expect(sameFiles(flattened, flattened.version - 1)).toBe(false);
    // Once nothing uses the versions before, their stacked layers go, and only the copy is left.
    await store.collect(new Set(), Date.now() + 3_600_000);
    expect(readdirSync(join(store.root, 'layers')).map((entry) => join(store.root, 'layers', entry))).toEqual(current.layers);
  });

  it('collects versions nobody uses and their layers, keeping the current one and those in use', async () => {
    // Versions of whole copies: each has a layer of its own, which goes with it.
    const root = mkdtempSync(join(tmpdir(), 'svc-env-collect-'));
    const store = new EnvironmentStore(join(root, 'environment'), policy, () => undefined, { overlay: false });
    await store.init('first', async (dir) => writeFileSync(join(dir, 'a.txt'), '1\n'));
    for (let index = 2; index <= 4; index++) await store.change(`v${index}`, async (change) => sh(change.fork, `echo ${index} > a.txt`));
    const layersOf = (...versions: number[]) => versions.map((version) => store.read(version)!.layers[0]!).sort();
    const before = { all: layersOf(1, 2, 3, 4), kept: layersOf(2, 4) };
    const layersLeft = () => readdirSync(join(store.root, 'layers')).map((entry) => join(store.root, 'layers', entry)).sort();
    expect(layersLeft()).toEqual(before.all);
    // Right after the changes everything is within its grace period.
    expect(await store.collect(new Set())).toEqual({ versions: 0, layers: 0 });
    const later = Date.now() + 3_600_000;
    expect(await store.collect(new Set([2]), later)).toEqual({ versions: 2, layers: 2 });
    expect(store.read(1)).toBeNull();
    expect(store.read(3)).toBeNull();
    expect(await store.readFile(store.read(2)!, 'a.txt')).toBe('2\n');
    expect(await store.readFile(store.current()!, 'a.txt')).toBe('4\n');
    // The layers of the collected versions went; those of the versions kept are all there.
    expect(layersLeft()).toEqual(before.kept);
    expect(readdirSync(join(store.root, 'changes'))).toEqual([]);
  });

  const modes: Array<[string, boolean]> = [...(sandboxCapabilities().overlay ? [['overlay layers', true] as [string, boolean]] : []), ['whole copies', false]];

  it.each(modes)('keeps the base of a change under way, and makes a change whose version number was collected again on the current one (%s)', async (_, overlay) => {
    const root = mkdtempSync(join(tmpdir(), 'svc-env-late-'));
    const store = new EnvironmentStore(join(root, 'environment'), policy, () => undefined, { overlay });
    await store.init('first', async (dir) => writeFileSync(join(dir, 'log.txt'), 'start\n'));
    let release!: () => void;
    const held = new Promise<void>((resolve) => (release = resolve));
    let started!: () => void;
    const running = new Promise<void>((resolve) => (started = resolve));
    let slowRuns = 0;
    const slow = store.change('slow', async (change) => {
      slowRuns += 1;
      if (slowRuns === 1) {
        started();
        await held;
      }
      // A long setup goes on after the collection below: the version it is made from must be there.
      await sh(change.fork, 'echo slow >> log.txt');
    });
    await running;
    for (const name of ['fast2', 'fast3']) await store.change(name, async (change) => sh(change.fork, `echo ${name} >> log.txt`));
    // An hour later, the slow change still running: versions 1 and 2 were superseded long ago.
    await store.collect(new Set(), Date.now() + 3_600_000);
    expect(store.read(2)).toBeNull();
    expect(store.read(1)!.layers.filter((layer) => !existsSync(layer))).toEqual([]);
    release();
    const { version } = await slow;
    // Not published as version 2 (free again) behind version 3: made again on version 3.
    expect(slowRuns).toBe(2);
    expect(version.version).toBe(4);
    expect(store.current()!.version).toBe(4);
    expect(await store.readFile(version, 'log.txt')).toBe('start\nfast2\nfast3\nslow\n');
    // Its base is free to go once it is done.
    await store.collect(new Set(), Date.now() + 3_600_000);
    expect(store.read(1)).toBeNull();
  });

  it('publishes above a torn version file (a crash while it was written), sets it aside and never uses its number again', async () => {
    const root = mkdtempSync(join(tmpdir(), 'svc-env-torn-'));
    const logs: string[] = [];
    const store = new EnvironmentStore(join(root, 'environment'), policy, (message) => logs.push(message));
    const versions = join(store.root, 'versions');
    const files = (): string[] => readdirSync(versions).sort();
    await store.init('first', async (dir) => writeFileSync(join(dir, 'log.txt'), 'start\n'));
    await store.change('second', async (change) => sh(change.fork, 'echo second >> log.txt'));
    // Version 3 was linked, but its contents never reached the disk.
    writeFileSync(join(versions, '3.json'), '');
    expect(store.current()!.version).toBe(2);
    const { version: published } = await store.change('after the crash', async (change) => sh(change.fork, 'echo after >> log.txt'));
    // Published above the torn file's number: a fork may have recorded version 3 as what it was then.
    expect(published.version).toBe(4);
    expect(await store.readFile(published, 'log.txt')).toBe('start\nsecond\nafter\n');
    expect(files()).toEqual(['1.json', '2.json', '3.json.unreadable', '4.json']);
    expect(logs.filter((line) => line.includes('3.json is torn'))).toHaveLength(1);
    // A readable version above it keeps the numbers growing: the set-aside file goes.
    await store.collect(new Set([1, 2]));
    expect(files()).toEqual(['1.json', '2.json', '4.json']);

    // A collection finding a garbled newest file keeps the version below it (the current one) and sets it aside.
    writeFileSync(join(versions, '5.json'), '{"version": 5, "lay');
    await store.collect(new Set(), Date.now() + 3_600_000);
    expect(files()).toEqual(['4.json', '5.json.unreadable']);
    expect(store.current()!.version).toBe(4);
    expect(await store.readFile(store.current()!, 'log.txt')).toBe('start\nsecond\nafter\n');
    const { version: next } = await store.change('next', async (change) => sh(change.fork, 'echo next >> log.txt'));
    expect(next.version).toBe(6);
    await store.collect(new Set(), Date.now() + 3_600_000);
    expect(files()).toEqual(['6.json']);
    expect(await store.readFile(store.current()!, 'log.txt')).toBe('start\nsecond\nafter\nnext\n');
  });

  it.skipIf(!sandboxCapabilities().overlay)('stops a flattening when the process shuts down, leaving no half layer, and a later change flattens', async () => {
    const root = mkdtempSync(join(tmpdir(), 'svc-env-flatten-stop-'));
    const dir = join(root, 'environment');
    const stopping = new AbortController();
    const store = new EnvironmentStore(dir, policy, () => undefined, { signal: stopping.signal });
    await store.init('first', async (layer) => writeFileSync(join(layer, 'n.txt'), '0\n'));
    for (let index = 1; store.current()!.layers.length < MAX_LAYERS; index++) await store.change(`change ${index}`, async (change) => sh(change.fork, `echo ${index} > n.txt`));
    stopping.abort();
    // This change makes the stack too deep: it is published, and its flattening (a whole copy) is stopped.
    const { version } = await store.change('past the limit', async (change) => sh(change.fork, 'echo last > n.txt'));
    expect(version.layers).toHaveLength(MAX_LAYERS + 1);
    expect(store.current()!.version).toBe(version.version);
    expect(await store.readFile(version, 'n.txt')).toBe('last\n');
    expect(readdirSync(join(dir, 'changes'))).toEqual([]);
    expect(readdirSync(join(dir, 'layers')).map((entry) => join(dir, 'layers', entry)).sort()).toEqual([...version.layers].sort());
    // The next process's next change flattens the stack.
    const { version: next } = await new EnvironmentStore(dir, policy).change('next', async (change) => sh(change.fork, 'echo next > n.txt'));
    expect(next.record.reason).toMatch(/^Flatten version \d+$/);
    expect(next.layers).toHaveLength(1);
    expect(await store.readFile(next, 'n.txt')).toBe('next\n');
  });

  it('never collects a layer on its way to being published, however old its files are', async () => {
    const { store } = newStore();
    await store.init('first', async (dir) => writeFileSync(join(dir, 'a.txt'), '0\n'));
    const longAgo = new Date(Date.now() - 3_600_000);
    // Another process's collection starts in the middle of every publish.
    const collections: Array<Promise<unknown>> = [];
    const publish = store['publish'].bind(store);
    store['publish'] = (record) => {
      collections.push(store.collect(new Set()));
      return publish(record);
    };
    for (let index = 1; index <= MAX_LAYERS; index++) {
      await store.change(`change ${index}`, async (change) => {
        await sh(change.fork, `echo ${index} > a.txt`);
        // A long setup: the change's own directory was last written long ago.
        utimesSync(change.fork.changesDir, longAgo, longAgo);
      });
      // So are the layers (a flattened copy takes their times).
      for (const layer of store.current()!.layers) utimesSync(layer, longAgo, longAgo);
    }
    await Promise.all(collections);
    const current = store.current()!;
    expect(current.record.reason).toMatch(/^Flatten version \d+$/);
    for (let version = 2; version <= current.version; version++) {
      expect(store.read(version)!.layers.filter((layer) => !existsSync(layer))).toEqual([]);
    }
    expect(await store.readFile(current, 'a.txt')).toBe(`${MAX_LAYERS}\n`);
  });

  it('keeps the layers private to the service, also those of an environment made before', async () => {
    const { store, root } = newStore();
    await store.init('first', async (dir) => writeFileSync(join(dir, 'a.txt'), '0\n'));
    const layers = join(store.root, 'layers');
    expect(statSync(layers).mode & 0o777).toBe(0o700);
    chmodSync(layers, 0o755);
    await new EnvironmentStore(join(root, 'environment'), policy).init('again', async () => undefined);
    expect(statSync(layers).mode & 0o777).toBe(0o700);
  });

  it('makes each version a whole copy where overlay mounts are unavailable, and forks copy it', async () => {
    const root = mkdtempSync(join(tmpdir(), 'svc-env-copies-'));
    const store = new EnvironmentStore(join(root, 'environment'), policy, () => undefined, { overlay: false });
    const first = await store.init('first', async (dir) => {
      writeFileSync(join(dir, 'a.txt'), 'one\n');
      writeFileSync(join(dir, 'gone.txt'), 'x\n');
    });
    const { version: second } = await store.change('edit', async (change) => {
      expect(change.fork.info.mode).toBe('clone');
      await sh(change.fork, 'echo two > a.txt && rm gone.txt');
    });
    expect(second.layers).toHaveLength(1);
    expect(await store.readFile(second, 'a.txt')).toBe('two\n');
    expect(await store.readFile(second, 'gone.txt')).toBeNull();
    expect(await store.readFile(first, 'a.txt')).toBe('one\n');
    const fork = await new ForkManager(join(root, 'forks'), policy).create('task', second, { mode: 'clone' });
    expect(await sh(fork, 'cat a.txt; ls')).toBe('two\na.txt\n');
  });

  it('adopts an environment from before versions as version 1', async () => {
    const root = mkdtempSync(join(tmpdir(), 'svc-env-legacy-'));
    const dir = join(root, 'environment');
    mkdirSync(join(dir, 'web'), { recursive: true });
    writeFileSync(join(dir, 'web', 'index.txt'), 'legacy\n');
    const store = new EnvironmentStore(dir, policy);
    const version = await store.init('never used', async () => {
      throw new Error('an adopted environment is not built');
    });
    expect(version.version).toBe(1);
    expect(await store.readFile(version, 'web/index.txt')).toBe('legacy\n');
    expect(existsSync(join(dir, 'web'))).toBe(false);
  });
});

describe.each(testDrivers)('environments catching up on %s', (driver) => {
  let api: TestApi;
  let tenant: Tenant;
  useTestApi(driver, (ready) => ({ api, tenant } = ready));

  /** A commit on the code host's main, as a merge would make it. */
  const landOnMain = (fullName: string, files: Record<string, string>, workspaceId = tenant.workspace.id) => {
    const bare = join(api.dataDir, 'codehost', workspaceId, `${fullName}.git`);
    const work = mkdtempSync(join(tmpdir(), 'svc-land-'));
    gitIn(tmpdir(), 'clone', '--quiet', bare, work);
    for (const [file, content] of Object.entries(files)) writeFileSync(join(work, file), content);
    gitIn(work, 'add', '-A');
    gitIn(work, 'commit', '--quiet', '-m', `change ${Object.keys(files).join(' ')}`);
    gitIn(work, 'push', '--quiet', 'origin', 'HEAD:main');
  };

  it('sweeps merges into a new version and runs setup only when a dependency manifest changed', async () => {
    const db = api.db.database.db;
    await addRepository(db, api.environments, { workspace: tenant.workspace.name, source: sampleRepository('deps'), fullName: 'acme/deps', setup: false });
    const config = parseEnvironmentConfig(api.environments.current(tenant.workspace.id)!.record.config);
    const install = 'n=$(cat ../installs 2>/dev/null || echo 0); echo $((n+1)) > ../installs; mkdir -p node_modules; cp package.json node_modules/installed.json';
    const edited = { ...config, repositories: config.repositories.map((spec) => (spec.dir === 'deps' ? { ...spec, setup: [install] } : spec)) };
    await api.environments.setConfig(tenant.workspace, JSON.stringify(edited));
    expect((await api.environments.setup(tenant.workspace.id, ['deps'])).results.map((result) => result.passed)).toEqual([true]);
    const installs = async () => (await api.environments.readFile(tenant.workspace.id, 'installs'))?.trim();
    expect(await installs()).toBe('1');

    // A change to code only: the working copy catches up, no setup runs.
    landOnMain('acme/deps', { 'greeting.txt': 'hello\n' });
    await api.environments.sweep();
    expect(await api.environments.readFile(tenant.workspace.id, 'deps/greeting.txt')).toBe('hello\n');
    expect(await installs()).toBe('1');

    // A change to package.json: the sweep catches up and installs again.
    landOnMain('acme/deps', { 'package.json': '{"name":"deps","version":"2.0.0"}\n' });
    await api.environments.sweep();
    const current = api.environments.current(tenant.workspace.id)!;
    expect(current.record.reason).toBe('Setup deps');
    expect(await installs()).toBe('2');
    expect(await api.environments.readFile(tenant.workspace.id, 'deps/node_modules/installed.json')).toContain('2.0.0');
    expect(current.record.setups.deps).toMatchObject({ passed: true, head: current.record.heads.deps });

    // Nothing new: a sweep changes nothing.
    await api.environments.sweep();
    expect(api.environments.current(tenant.workspace.id)!.version).toBe(current.version);
  });

  /** The environment's config with `spec` added to (or replacing) its repositories, as an operator edits it. */
  const withRepository = (workspaceId: string, spec: { name: string; dir: string; setup: string[] }): string => {
    const config = parseEnvironmentConfig(api.environments.current(workspaceId)!.record.config);
    return JSON.stringify({ ...config, repositories: [...config.repositories.filter((entry) => entry.dir !== spec.dir), spec] });
  };

  /** The environments of another process on the same data dir and database. */
  const otherProcess = () =>
    new Environments({ db: api.db.database.db, dataDir: api.dataDir, policy: { hiddenPaths: [api.dataDir], allowUnsandboxed: false }, logger: pino({ level: 'silent' }) });
  const environmentHead = (workspaceId: string) => api.environments.codeHost.resolve(workspaceId, 'svc/environment', 'refs/heads/main');

  it('runs a due setup once when two processes update the environment at the same time', async () => {
    const db = api.db.database.db;
    const { workspace } = await api.newTenant();
    await addRepository(db, api.environments, { workspace: workspace.name, source: sampleRepository('deps'), fullName: 'acme/deps', setup: false });
    const install = 'n=$(cat ../installs 2>/dev/null || echo 0); echo $((n+1)) > ../installs';
    await api.environments.setConfig(workspace, withRepository(workspace.id, { name: 'acme/deps', dir: 'deps', setup: [install] }));
    await api.environments.setup(workspace.id, ['deps']);
    const installs = async () => (await api.environments.readFile(workspace.id, 'installs'))?.trim();
    expect(await installs()).toBe('1');

    // This process finds the setup due after a merge; another process runs it before this one does.
    landOnMain('acme/deps', { 'package.json': '{"name":"deps","version":"2.0.0"}\n' }, workspace.id);
    const refreshed = (await api.environments.refresh(workspace.id))!;
    const due = await api.environments.pendingSetups(workspace.id, refreshed);
    expect(due).toEqual(['deps']);
    const other = otherProcess();
    try {
      await other.update(workspace.id);
    } finally {
      await other.close();
    }
    expect(await installs()).toBe('2');
    const { version, results } = await api.environments.setup(workspace.id, due, { onlyDue: true });
    expect(results).toEqual([]);
    expect(version.version).toBe(api.environments.current(workspace.id)!.version);
    expect(await installs()).toBe('2');
  });

  it('pushes a config edit to the code host only with the version that has it, also when another change published first', async () => {
    const { workspace } = await api.newTenant();
    await api.environments.ensure(workspace);
    const before = await environmentHead(workspace.id);
    const host = api.environments.codeHost;
    const knownCommits = host.knownCommits.bind(host);
    let calls = 0;
    // Another process publishes a version while the edit is being committed: the edit's first version
    // loses, and the edit is made again on the newer one.
    host.knownCommits = async (...args: Parameters<typeof knownCommits>) => {
      if (calls++ === 0) {
        await api.environments.store(workspace.id).change('Another change', async (change) => {
          expect((await change.fork.run(['sh', '-c', 'echo x > .git/another-change'], { timeoutMs: 20_000 })).exitCode).toBe(0);
        });
      }
      return knownCommits(...args);
    };
    try {
      const config = parseEnvironmentConfig(api.environments.current(workspace.id)!.record.config);
      await api.environments.setConfig(workspace, JSON.stringify({ ...config, network: true }));
    } finally {
      host.knownCommits = knownCommits;
    }
    expect(calls).toBe(2);
    const current = api.environments.current(workspace.id)!;
    expect(current.record.reason).toBe('Edit the environment config');
    expect(parseEnvironmentConfig(current.record.config).network).toBe(true);
    // The code host has one commit more, the one the published version has checked out.
    expect(await environmentHead(workspace.id)).toBe(current.record.heads['.']);
    const bare = join(api.dataDir, 'codehost', workspace.id, 'svc/environment.git');
    expect(gitIn(bare, 'rev-list', '--count', `${before}..main`).trim()).toBe('1');
  });

  it('pushes a published config commit the code host missed on a later sweep, publishing no identical version meanwhile', async () => {
    const { workspace } = await api.newTenant();
    await api.environments.ensure(workspace);
    const before = await environmentHead(workspace.id);
    const host = api.environments.codeHost;
    const receiveBranch = host.receiveBranch.bind(host);
    // The version is published, then the connection to the code host breaks: svc/environment there is
    // one commit behind the environment's.
    host.receiveBranch = async () => {
      throw new Error('the connection to the code host was interrupted');
    };
    try {
      const config = parseEnvironmentConfig(api.environments.current(workspace.id)!.record.config);
      await expect(api.environments.setConfig(workspace, JSON.stringify({ ...config, network: true }))).rejects.toThrow('interrupted');
      const published = api.environments.current(workspace.id)!;
      expect(published.record.reason).toBe('Edit the environment config');
      expect(await environmentHead(workspace.id)).toBe(before);
      // While the code host stays unreachable, sweeps find nothing to bring and publish nothing.
      await api.environments.sweep();
      await api.environments.sweep();
      expect(api.environments.current(workspace.id)!.version).toBe(published.version);
    } finally {
      host.receiveBranch = receiveBranch;
    }
    // Once it is back, the sweep pushes the commit the environment has.
    await api.environments.sweep();
    const current = api.environments.current(workspace.id)!;
    expect(current.record.reason).toBe('Edit the environment config');
    expect(await environmentHead(workspace.id)).toBe(current.record.heads['.']);
    expect(await environmentHead(workspace.id)).not.toBe(before);
    await api.environments.sweep();
    expect(api.environments.current(workspace.id)!.version).toBe(current.version);
  });

  it('leaves svc/environment ahead of the code host with nothing of its version to push alone until either moves', async () => {
    const { workspace } = await api.newTenant();
    await api.environments.ensure(workspace);
    const host = api.environments.codeHost;
    const [receiveBranch, knownCommits] = [host.receiveBranch.bind(host), host.knownCommits.bind(host)];
    host.receiveBranch = async () => {
      throw new Error('the connection to the code host was interrupted');
    };
    const config = parseEnvironmentConfig(api.environments.current(workspace.id)!.record.config);
    await expect(api.environments.setConfig(workspace, JSON.stringify({ ...config, network: true }))).rejects.toThrow('interrupted');
    host.receiveBranch = receiveBranch;
    const published = api.environments.current(workspace.id)!;
    // The code host says it knows the version's commit (its branch behind it): there is nothing to push.
    let pushes = 0;
    host.knownCommits = async (...args: Parameters<typeof knownCommits>) => {
      pushes += 1;
      return [...(await knownCommits(...args)), published.record.heads['.']!];
    };
    try {
      await api.environments.sweep();
      expect(pushes).toBeGreaterThan(0);
      const first = pushes;
      // Not tried again, sweep after sweep, while nothing moves.
      await api.environments.sweep();
      await api.environments.sweep();
      expect(pushes).toBe(first);
      expect(api.environments.current(workspace.id)!.version).toBe(published.version);
    } finally {
      host.knownCommits = knownCommits;
    }
  });

  it('leaves the code host as it was when connecting a repository fails before its version is published', async () => {
    const db = api.db.database.db;
    const { workspace } = await api.newTenant();
    await api.environments.ensure(workspace);
    await api.environments.setConfig(workspace, withRepository(workspace.id, { name: 'acme/slow', dir: 'slow', setup: ['touch ../setup-started && exec sleep 600'] }));
    const before = { head: await environmentHead(workspace.id), version: api.environments.current(workspace.id)!.version };
    const other = otherProcess();
    const connecting = addRepository(db, other, { workspace: workspace.name, source: sampleRepository('slow'), fullName: 'acme/slow', setup: true });
    connecting.catch(() => undefined);
    // The setup runs (in the change's fork: its upper dir, or its copy): that process shuts down.
    const changes = join(api.dataDir, 'environments', workspace.id, 'changes');
    const started = () => existsSync(changes) && readdirSync(changes).some((entry) => ['upper', 'root'].some((dir) => existsSync(join(changes, entry, dir, 'setup-started'))));
    for (let attempt = 0; attempt < 600 && !started(); attempt++) await new Promise((resolve) => setTimeout(resolve, 50));
    expect(started()).toBe(true);
    await other.close();
    await expect(connecting).rejects.toThrow();
    expect(api.environments.current(workspace.id)!.version).toBe(before.version);
    expect(await environmentHead(workspace.id)).toBe(before.head);
  });

  it('records the commit a setup ran on when the repository is connected with its setup', async () => {
    const db = api.db.database.db;
    const { workspace } = await api.newTenant();
    await api.environments.ensure(workspace);
    // The config names the repository's setup before it is connected, so connecting runs it.
    await api.environments.setConfig(workspace, withRepository(workspace.id, { name: 'acme/web', dir: 'web', setup: ['touch ../installed-web'] }));
    const { setup } = await addRepository(db, api.environments, { workspace: workspace.name, source: sampleRepository('web'), fullName: 'acme/web', setup: true });
    expect(setup.map((result) => result.passed)).toEqual([true]);
    const connected = api.environments.current(workspace.id)!;
    expect(connected.record.heads.web).toMatch(/^[0-9a-f]{40}$/);
    expect(connected.record.setups.web).toMatchObject({ passed: true, head: connected.record.heads.web });

    // So a merge that changes its manifest makes the setup due again.
    landOnMain('acme/web', { 'package.json': '{"name":"web","version":"2.0.0"}\n' }, workspace.id);
    await api.environments.sweep();
    const current = api.environments.current(workspace.id)!;
    expect(current.record.reason).toBe('Setup web');
    expect(current.record.setups.web).toMatchObject({ passed: true, head: current.record.heads.web });
    expect(current.record.setups.web!.head).not.toBe(connected.record.setups.web!.head);
  });
});
