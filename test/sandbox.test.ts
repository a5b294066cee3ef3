import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, type AddressInfo } from 'node:net';
import { networkInterfaces, tmpdir } from 'node:os';
import { join, resolve as resolvePath } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { EGRESS_DIR, ForkManager, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';
import {
  describeOutsideNetwork,
  loopbackUp,
  OutsideNetworkUnavailableError,
  outsideNetworkOf,
  probeOutsideNetwork,
  resolvConfMount,
  sandboxResolvConf,
} from '../src/sandbox/outside-network.js';

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

  it('fails a command with network access where slirp4netns or /dev/net/tun is missing, unless the host network is allowed', () => {
    expect(outsideNetworkOf({}, null)).toBe('slirp4netns');
    expect(outsideNetworkOf({ allowHostNetwork: true }, 'slirp4netns')).toBe('host');
    expect(outsideNetworkOf({ allowHostNetwork: true }, '/dev/net/tun')).toBe('host');
    expect(() => outsideNetworkOf({}, 'slirp4netns')).toThrow(/slirp4netns is not installed.*`apt-get install -y slirp4netns`.*SVC_ALLOW_HOST_NETWORK=true/);
    expect(() => outsideNetworkOf({}, '/dev/net/tun')).toThrow(OutsideNetworkUnavailableError);
    expect(() => outsideNetworkOf({}, '/dev/net/tun')).toThrow(/^\/dev\/net\/tun is not available, .*--device \/dev\/net\/tun.*SVC_ALLOW_HOST_NETWORK=true/);
    expect(describeOutsideNetwork({}, null)).toBe('commands with network access get a private network through slirp4netns (no access to the host loopback)');
    expect(describeOutsideNetwork({ allowHostNetwork: true }, 'slirp4netns')).toBe(
      "slirp4netns is not installed: commands with network access share the host's network (SVC_ALLOW_HOST_NETWORK)",
    );
    expect(describeOutsideNetwork({}, 'slirp4netns')).toBe(
      'slirp4netns is not installed: commands with network access will fail (`apt-get install -y slirp4netns`, or SVC_ALLOW_HOST_NETWORK=true)',
    );
    expect(describeOutsideNetwork({ allowHostNetwork: true }, '/dev/net/tun')).toBe(
      "/dev/net/tun is not available: commands with network access share the host's network (SVC_ALLOW_HOST_NETWORK)",
    );
    expect(describeOutsideNetwork({}, '/dev/net/tun')).toBe(
      '/dev/net/tun is not available: commands with network access will fail (make /dev/net/tun available to the service (a container: `--device /dev/net/tun`), or SVC_ALLOW_HOST_NETWORK=true)',
    );
  });

  it('needs the TUN device as well as slirp4netns for private networks', () => {
    expect(probeOutsideNetwork({ program: 'svc-no-such-program' })).toBe('slirp4netns');
    expect(probeOutsideNetwork({ tunDevice: join(root, 'no-such-tun') })).toBe('/dev/net/tun');
    // This host has both (the test above connects a sandbox through slirp4netns).
    expect(probeOutsideNetwork()).toBeNull();
  });

  it('waits for the sandbox\'s loopback before slirp4netns, a short while where it cannot be seen, not at all for a gone process', async () => {
    const failing = (code: string) => {
      const reader = () => {
        reader.reads += 1;
        throw Object.assign(new Error(code), { code });
      };
      reader.reads = 0;
      return reader;
    };
    // A gone process: no second look.
    const gone = failing('ENOENT');
    await loopbackUp(1, gone);
    expect(gone.reads).toBe(1);
    // Routes that cannot be read: looked at again, and then given up on (the call returns).
    const hidden = failing('EACCES');
    await loopbackUp(1, hidden);
    expect(hidden.reads).toBeGreaterThan(1);
    // Unreadable for a moment, then up: it returns as soon as it sees 127.0.0.1.
    let reads = 0;
    await loopbackUp(1, () => {
      reads += 1;
      if (reads < 3) throw Object.assign(new Error('EACCES'), { code: 'EACCES' });
      return reads < 5 ? '' : '|-- 127.0.0.1\n';
    });
    expect(reads).toBe(5);
  });

  it('points a sandbox at slirp4netns\'s DNS forwarder where the host resolves on its loopback', () => {
    expect(sandboxResolvConf('nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch example.com\n')).toBe(
      'nameserver 10.0.2.3\noptions edns0 trust-ad\nsearch example.com\n',
    );
    expect(sandboxResolvConf('nameserver 10.255.255.53\n')).toBeNull();
  });

  it('binds a resolv.conf that links out of the sandbox\'s directories where the link leads, and rewrites it when it goes', () => {
    const host = mkdtempSync(join(root, 'resolv-'));
    mkdirSync(join(host, 'etc'));
    mkdirSync(join(host, 'run', 'resolve'), { recursive: true });
    const stub = join(host, 'run', 'resolve', 'stub-resolv.conf');
    writeFileSync(stub, 'nameserver 127.0.0.53\nsearch example.com\n');
    symlinkSync('../run/resolve/stub-resolv.conf', join(host, 'etc', 'resolv.conf'));
    const bound = [join(host, 'etc')];
    const generated = resolvConfMount('slirp4netns', bound, join(host, 'etc', 'resolv.conf'));
    expect(generated?.target).toBe(stub);
    expect(readFileSync(generated!.source, 'utf8')).toBe('nameserver 10.0.2.3\nsearch example.com\n');
    // A tmp cleaner removed it: the next use writes it again.
    rmSync(generated!.source);
    const again = resolvConfMount('slirp4netns', bound, join(host, 'etc', 'resolv.conf'));
    expect(readFileSync(again!.source, 'utf8')).toBe('nameserver 10.0.2.3\nsearch example.com\n');
    // The host's resolver changed: so does the sandbox's.
    writeFileSync(stub, 'nameserver 127.0.0.53\nsearch example.org\n');
    expect(readFileSync(resolvConfMount('slirp4netns', bound, join(host, 'etc', 'resolv.conf'))!.source, 'utf8')).toBe('nameserver 10.0.2.3\nsearch example.org\n');
    // A resolver off the loopback: the host's own file, bound where the link leads (it would dangle inside).
    writeFileSync(stub, 'nameserver 192.0.2.53\n');
    expect(resolvConfMount('slirp4netns', bound, join(host, 'etc', 'resolv.conf'))).toEqual({ source: stub, target: stub });
    expect(resolvConfMount('host', bound, join(host, 'etc', 'resolv.conf'))).toEqual({ source: stub, target: stub });
    // A link within the sandbox's directories resolves inside as it is.
    expect(resolvConfMount('host', [join(host, 'etc'), join(host, 'run')], join(host, 'etc', 'resolv.conf'))).toBeNull();
  });

  it.skipIf(!sandboxCapabilities().overlay)('resolves names through slirp4netns where /etc/resolv.conf links to systemd-resolved\'s stub', () => {
    // In a private mount namespace, /etc gets an overlay whose resolv.conf links to a stub file outside /etc,
    // as on a stock Ubuntu host; a command with network access there must see slirp4netns's forwarder.
    const dir = mkdtempSync(join(root, 'resolved-'));
    mkdirSync(join(dir, 'resolve'));
    mkdirSync(join(dir, 'layer'));
    mkdirSync(join(dir, 'workspace'));
    writeFileSync(join(dir, 'resolve', 'stub-resolv.conf'), 'nameserver 127.0.0.53\noptions edns0 trust-ad\n');
    const script = join(dir, 'run.mts');
    writeFileSync(
      script,
      `import { directSandbox } from ${JSON.stringify(resolvePath('src/sandbox/fork.ts'))};\n` +
        `const result = await directSandbox(${JSON.stringify(join(dir, 'workspace'))}, { hiddenPaths: [], allowUnsandboxed: false })` +
        `.run(['cat', '/etc/resolv.conf'], { network: true, timeoutMs: 20_000 });\n` +
        'process.stdout.write(JSON.stringify(result));\n',
    );
    const setup = [
      'mount -t tmpfs tmpfs "$1/layer" && mkdir "$1/layer/upper" "$1/layer/work"',
      'ln -s "$1/resolve/stub-resolv.conf" "$1/layer/upper/resolv.conf"',
      'mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1/layer/upper,workdir=$1/layer/work" /etc',
      'readlink /etc/resolv.conf >&2 && exec "$0" --import tsx "$2"',
    ].join(' && ');
    const output = execFileSync('unshare', ['-m', '--propagation', 'private', 'sh', '-c', setup, process.execPath, dir, script], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const result = JSON.parse(output) as { stdout: string; stderr: string; exitCode: number };
    expect(result.stderr).toBe('');
    expect(result.stdout).toBe('nameserver 10.0.2.3\noptions edns0 trust-ad\n');
    expect(result.exitCode).toBe(0);
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
