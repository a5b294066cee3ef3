import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { EGRESS_DIR, ForkManager, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';

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

  it('has no network unless allowed', async () => {
    const server = createServer((socket) => socket.end());
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const port = (server.address() as AddressInfo).port;
    try {
      const fork = await forks.create('net', environment);
      const probe = `${process.execPath} -e "require('net').connect(${port},'127.0.0.1').on('error',e=>{console.log(e.code);process.exit(0)}).on('connect',()=>{console.log('connected');process.exit(0)})"`;
      expect((await sh(fork, probe, { timeoutMs: 20_000, network: true })).stdout).toBe('connected\n');
      expect((await sh(fork, probe, { timeoutMs: 20_000 })).stdout).toBe('ECONNREFUSED\n');
      await forks.remove(fork);
    } finally {
      server.close();
    }
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
      // Without it, the same command asking for network is on the host's.
      expect((await sh(fork, connect(`${port},'127.0.0.1'`), { timeoutMs: 20_000, network: true })).stdout).toBe('host\n');
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
