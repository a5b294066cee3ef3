import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { createServer, type AddressInfo } from 'node:net';
import { networkInterfaces, tmpdir } from 'node:os';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { EGRESS_DIR, ForkManager, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';
import { describeOutsideNetwork, outsideNetworkOf, sandboxResolvConf } from '../src/sandbox/outside-network.js';

const root = mkdtempSync(join(tmpdir(), 'svc-sandbox-'));
const dataDir = join(root, 'data');
const environments = join(root, 'environments');
const environment = join(environments, 'acme');
const forksRoot = join(root, 'forks');
const policy = { hiddenPaths: [dataDir, environments, forksRoot], allowUnsandboxed: false };
const logs: string[] = [];
const forks = new ForkManager(forksRoot, policy, (message) => logs.push(message));

beforeAll(() => {
  mkdirSync(dataDir, { recursive: true });
  writeFileSync(join(dataDir, 'secret.key'), 'service_top_secret');
  mkdirSync(join(environment, 'web', 'node_modules', 'dep'), { recursive: true });
  writeFileSync(join(environment, 'web', 'a.txt'), 'hi\n');
  writeFileSync(join(environment, 'web', '.gitignore'), 'node_modules\n');
  writeFileSync(join(environment, 'web', 'node_modules', 'dep', 'index.js'), 'module.exports = 1;\n');
  const git = (...args: string[]) => execFileSync('git', ['-C', join(environment, 'web'), ...args], { stdio: 'ignore' });
  git('init', '-q');
  git('-c', 'user.email=t@example.com', '-c', 'user.name=t', 'add', 'a.txt', '.gitignore');
  git('-c', 'user.email=t@example.com', '-c', 'user.name=t', 'commit', '-q', '-m', 'init');
  mkdirSync(forksRoot, { recursive: true });
});

const sh = (fork: Fork, script: string, options: Parameters<Fork['run']>[1] = {}) => fork.run(['sh', '-c', script], options);

describe('sandbox forks', () => {
  it('has bubblewrap (npm test checks for it first)', () => {
    expect(sandboxCapabilities().bwrap).toBe(true);
  });

  it.each(['overlay', 'clone'] as const)('keeps a %s fork apart from its environment, and its changes across runs', async (mode) => {
    const fork = await forks.create(`changes-${mode}`, environment, { mode });
    expect(fork.info.mode).toBe(mode === 'overlay' && !sandboxCapabilities().overlay ? 'clone' : mode);
    const first = await sh(fork, 'cat web/a.txt && echo changed > web/a.txt && echo new > web/b.txt && pwd', { timeoutMs: 20_000 });
    expect(first.stderr).toBe('');
    expect(first.stdout).toBe('hi\n/workspace\n');
    expect(first.exitCode).toBe(0);
    const second = await sh(fork, 'cat web/a.txt web/b.txt && ls web/node_modules/dep', { timeoutMs: 20_000 });
    expect(second.stdout).toBe('changed\nnew\nindex.js\n');
    expect(readFileSync(join(environment, 'web', 'a.txt'), 'utf8')).toBe('hi\n');
    expect(existsSync(join(environment, 'web', 'b.txt'))).toBe(false);
    expect(readFileSync(join(fork.changesDir, 'web', 'b.txt'), 'utf8')).toBe('new\n');
    await forks.remove(fork);
    expect(existsSync(fork.info.dir)).toBe(false);
  });

  it('clones git repositories in the fallback and says so in the log', async () => {
    const fork = await forks.create('fallback', environment, { mode: 'clone' });
    expect(logs.some((line) => line.includes('fallback') && line.includes('git clone --local --shared'))).toBe(true);
    const log = await fork.run(['git', '-C', 'web', 'log', '--format=%s'], { timeoutMs: 20_000 });
    expect(log.stderr).toBe('');
    expect(log.stdout).toBe('init\n');
    const ignored = await sh(fork, 'cat web/.gitignore', { timeoutMs: 20_000 });
    expect(ignored.stdout).toBe('node_modules\n');
    await forks.remove(fork);
  });

  it('hides the data dir, other forks and environments, and the host is read-only', async () => {
    const fork = await forks.create('nosy', environment);
    const other = await forks.create('other', environment);
    await sh(other, 'echo private > web/other.txt', { timeoutMs: 20_000 });
    const attempts = await sh(
      fork,
      [
        `cat ${dataDir}/secret.key; echo "data=$?"`,
        `ls -A ${forksRoot} | wc -l`,
        `ls -A ${environments} | wc -l`,
        `cat ${join(other.changesDir, 'web', 'other.txt')}; echo "other=$?"`,
        'touch /etc/svc-probe; echo "etc=$?"',
      ].join('\n'),
      { timeoutMs: 20_000 },
    );
    expect(attempts.stdout).not.toContain('service_top_secret');
    expect(attempts.stdout).not.toContain('private');
    expect(attempts.stdout).toMatch(/data=1\n0\n0\nother=1\netc=1\n/);
    await forks.remove(fork);
    await forks.remove(other);
  });

  it('gives a command with network access a network of its own through slirp4netns, never the host loopback', async () => {
    const listen = async (host: string, answer: string) => {
      const server = createServer((socket) => socket.end(`${answer}\n`));
      await new Promise<void>((resolve) => server.listen(0, host, resolve));
      return { server, port: (server.address() as AddressInfo).port };
    };
    // The host's loopback (where the service's database and API listen) and, if the host has one, an
    // address on another interface: an outside host as far as slirp4netns is concerned.
    const loopback = await listen('127.0.0.1', 'loopback');
    const address = Object.values(networkInterfaces())
      .flat()
      .find((entry) => entry && entry.family === 'IPv4' && !entry.internal)?.address;
    const outside = address ? await listen(address, 'outside') : null;
    const connect = (host: string, port: number) =>
      `${process.execPath} -e "require('net').connect(${port},'${host}').on('error',e=>{console.log(e.code);process.exit(0)}).on('data',d=>{process.stdout.write(d);process.exit(0)})"`;
    const probe = [
      connect('127.0.0.1', loopback.port),
      // slirp4netns's gateway, which would be the host's loopback without --disable-host-loopback.
      connect('10.0.2.2', loopback.port),
      // The interface that holds the default route.
      `awk '$2 == "00000000" { print "default via " $1 }' /proc/net/route`,
      outside && address ? connect(address, outside.port) : 'true',
    ].join('\n');
    try {
      const fork = await forks.create('net', environment);
      const online = await sh(fork, probe, { timeoutMs: 20_000, network: true });
      expect(online.stderr).toBe('');
      expect(online.stdout.split('\n')).toEqual(['ECONNREFUSED', 'ENETUNREACH', 'default via tap0', ...(outside ? ['outside'] : []), '']);
      const offline = await sh(fork, probe, { timeoutMs: 20_000 });
      expect(offline.stdout.split('\n')).toEqual(['ECONNREFUSED', 'ENETUNREACH', ...(outside ? ['ENETUNREACH'] : []), '']);
      await forks.remove(fork);
    } finally {
      loopback.server.close();
      outside?.server.close();
    }
  });

  it('fails a command with network access where slirp4netns is missing, unless the host network is allowed', () => {
    expect(outsideNetworkOf({}, true)).toBe('slirp4netns');
    expect(outsideNetworkOf({ allowHostNetwork: true }, false)).toBe('host');
    expect(() => outsideNetworkOf({}, false)).toThrow(/slirp4netns is not installed.*`apt-get install -y slirp4netns`.*SVC_ALLOW_HOST_NETWORK=true/);
    expect(describeOutsideNetwork({})).toContain('slirp4netns');
  });

  it('points a sandbox at slirp4netns\'s DNS forwarder where the host resolves on its loopback', () => {
    expect(sandboxResolvConf('nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch example.com\n')).toBe(
      'nameserver 10.0.2.3\noptions edns0 trust-ad\nsearch example.com\n',
    );
    expect(sandboxResolvConf('nameserver 10.255.255.53\n')).toBeNull();
  });

  it('confines a command with an egress directory to its sockets, even when it asks for network', async () => {
    const server = createServer((socket) => socket.end('host\n'));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const port = (server.address() as AddressInfo).port;
    const egress = mkdtempSync(join(root, 'egress-'));
    const unix = createServer((socket) => socket.end('proxy\n'));
    await new Promise<void>((resolve) => unix.listen(join(egress, 'proxy.sock'), resolve));
    try {
      const fork = await forks.create('egress', environment);
      const connect = (target: string) =>
        `${process.execPath} -e "require('net').connect(${target}).on('error',e=>{console.log(e.code);process.exit(0)}).on('data',d=>{process.stdout.write(d);process.exit(0)})"`;
      const probe = [connect(`${port},'127.0.0.1'`), connect(`'${EGRESS_DIR}/proxy.sock'`), `ls ${EGRESS_DIR}`].join('\n');
      const confined = await sh(fork, probe, { timeoutMs: 20_000, network: true, egressDir: egress });
      expect(confined.stderr).toBe('');
      expect(confined.stdout).toBe('ECONNREFUSED\nproxy\nproxy.sock\n');
      // Without it, the same command asking for network has a network of its own (never the host's loopback).
      expect((await sh(fork, connect(`${port},'127.0.0.1'`), { timeoutMs: 20_000, network: true })).stdout).toBe('ECONNREFUSED\n');
      await forks.remove(fork);
    } finally {
      server.close();
      unix.close();
    }
  });

  it('kills the whole process group on timeout, and applies resource limits', async () => {
    const fork = await forks.create('limits', environment);
    const slow = await sh(fork, 'sleep 30 & sleep 30; echo never', { timeoutMs: 500 });
    expect(slow.timedOut).toBe(true);
    expect(slow.stdout).not.toContain('never');
    const limited = await sh(fork, 'ulimit -v; ulimit -t', { timeoutMs: 20_000, memoryMiB: 256, cpuSeconds: 7 });
    expect(limited.stdout).toBe('262144\n7\n');
    await forks.remove(fork);
  });

  it('runs commands without capabilities, under the policy\'s default limits, and keeps forks private', async () => {
    const limited = new ForkManager(join(root, 'limited-forks'), { ...policy, memoryMiB: 2048, cpuSeconds: 77 });
    const fork = await limited.create('nocaps', environment);
    const result = await sh(fork, 'ulimit -v; ulimit -t; touch f && chown 65534 f; echo "chown=$?"; grep CapEff /proc/self/status');
    expect(result.stdout).toContain(`${2048 * 1024}\n77\n`);
    expect(result.stdout).toMatch(/chown=1/);
    expect(result.stdout).toMatch(/CapEff:\s+0+\n/);
    expect((await sh(fork, 'ulimit -v', { memoryMiB: 512 })).stdout.trim()).toBe(String(512 * 1024));
    // A setuid file a command could leave in its fork is out of other users' reach.
    expect(statSync(join(root, 'limited-forks')).mode & 0o077).toBe(0);
  });

  it('refuses bad fork names', async () => {
    for (const name of ['', 'a b', '../up', 'x'.repeat(65), 'dot.name']) {
      await expect(forks.create(name, environment)).rejects.toThrow(/letters, digits/);
    }
  });
});
