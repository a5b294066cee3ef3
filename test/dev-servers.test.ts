import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readProcessRecords, startDevServers, stopRecordedProcesses, type RunningDevServers } from '../src/sandbox/dev-servers.js';
import { DevServerSpec } from '../src/sandbox/environment.js';
import { ForkManager, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';

const root = mkdtempSync(join(tmpdir(), 'svc-dev-servers-'));
const environment = join(root, 'environments', 'acme');
const forksRoot = join(root, 'forks');
const forks = new ForkManager(forksRoot, { hiddenPaths: [join(root, 'environments'), forksRoot], allowUnsandboxed: false });
/** Marks this file's dev server processes, so `ps` can tell whether any is left. */
const marker = `svc-dev-test-${process.pid}`;
const logs: string[] = [];
const running: RunningDevServers[] = [];

// A dev server that answers with the fork's web/who.txt, the way a real one serves the fork's files.
const SERVER = `
const http = require('http');
const fs = require('fs');
http.createServer((req, res) => {
  if (req.url === '/broken') { res.statusCode = 503; return res.end('not yet'); }
  res.end('dev:' + fs.readFileSync('who.txt', 'utf8').trim());
}).listen(Number(process.env.PORT), '127.0.0.1', () => console.log('listening on ' + process.env.PORT));
`;

const spec = (fields: Partial<DevServerSpec> & { name: string }) =>
  DevServerSpec.parse({ command: `exec node server.js ${marker}`, healthPath: '/health', startTimeoutSeconds: 20, ...fields });

/** Fetches a URL from inside the fork: the body, or the connection error's code. */
const fetchFromFork = async (fork: Fork, url: string, options: { network?: boolean } = {}) => {
  const script = `fetch(${JSON.stringify(url)}).then(r=>r.text()).then(t=>console.log(t),e=>console.log(e.cause?.code??e.message))`;
  const result = await fork.run(['node', '-e', script], { timeoutMs: 20_000, ...options });
  expect(result.stderr).toBe('');
  return result.stdout.trim();
};

/**
 * Running processes whose command line holds this file's marker, or that are in one of the given groups
 * (zombies do not run: they only wait for init to reap them).
 */
const leftovers = (groups: number[] = []) => {
  const lines = execFileSync('ps', ['-eo', 'pid=,pgid=,stat=,args='], { encoding: 'utf8' }).split('\n');
  return lines.filter((line) => {
    const [, pgid, stat] = line.trim().split(/\s+/);
    if (!stat || stat.startsWith('Z')) return false;
    return (line.includes(marker) && !line.includes('ps -eo')) || groups.includes(Number(pgid));
  });
};

async function newFork(name: string, who: string): Promise<Fork> {
  const fork = await forks.create(name, environment);
  const written = await fork.run(['sh', '-c', `echo ${who} > web/who.txt`], { timeoutMs: 20_000 });
  expect(written.exitCode).toBe(0);
  return fork;
}

beforeAll(() => {
  mkdirSync(join(environment, 'web'), { recursive: true });
  writeFileSync(join(environment, 'web', 'server.js'), SERVER);
  writeFileSync(join(environment, 'web', 'who.txt'), 'environment\n');
  mkdirSync(forksRoot, { recursive: true });
});

afterAll(async () => {
  await Promise.all(running.map((servers) => servers.stop()));
});

describe('dev servers in a fork', () => {
  it('runs in a sandbox with nsenter rights here (the private network needs them)', () => {
    expect(sandboxCapabilities().bwrap).toBe(true);
  });

  it('start healthy, and the fork reaches them on 127.0.0.1 without network access, but nothing on the host', async () => {
    const host: Server = createServer((_request, response) => response.end('host'));
    await new Promise<void>((resolve) => host.listen(0, '127.0.0.1', resolve));
    const hostPort = (host.address() as AddressInfo).port;
    try {
      const fork = await newFork('reach', 'reach');
      // The dev server takes the very port the host's server listens on: inside the fork it is the fork's.
      const servers = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web-app', port: hostPort }) }], {
        network: false,
        log: (message) => logs.push(message),
      });
      running.push(servers);
      expect(servers.servers).toEqual([{ name: 'web-app', port: hostPort, url: `http://127.0.0.1:${hostPort}`, healthy: true }]);
      expect(servers.env()).toEqual({ SVC_DEV_WEB_APP_URL: `http://127.0.0.1:${hostPort}`, SVC_DEV_WEB_APP_PORT: String(hostPort) });
      expect(fork.network).not.toBeNull();
      expect(logs.filter((line) => line.includes('could not be made'))).toEqual([]);
      expect(await fetchFromFork(fork, `http://127.0.0.1:${hostPort}/`)).toBe('dev:reach');
      // A command run through a shell, the way the agent's are, too.
      const viaShell = await fork.run(['sh', '-c', `node -e "fetch('$SVC_DEV_WEB_APP_URL').then(r=>r.text()).then(console.log)"`], {
        timeoutMs: 20_000,
        env: servers.env(),
      });
      expect(viaShell.stdout).toBe('dev:reach\n');
      // The host's own server (on another port) stays out of reach, with network access too (which has a
      // network of its own, connected through slirp4netns without the host's loopback).
      const other: Server = createServer((_request, response) => response.end('other'));
      await new Promise<void>((resolve) => other.listen(0, '127.0.0.1', resolve));
      const otherPort = (other.address() as AddressInfo).port;
      try {
        expect(await fetchFromFork(fork, `http://127.0.0.1:${otherPort}/`)).toBe('ECONNREFUSED');
        expect(await fetchFromFork(fork, `http://127.0.0.1:${otherPort}/`, { network: true })).toBe('ECONNREFUSED');
        expect(await fetchFromFork(fork, `http://127.0.0.1:${hostPort}/`, { network: true })).toBe('ECONNREFUSED');
      } finally {
        other.close();
      }
      await servers.stop();
      expect(fork.network).toBeNull();
      // Once stopped, the fork's commands are back in an empty network of their own.
      expect(await fetchFromFork(fork, `http://127.0.0.1:${hostPort}/`)).toBe('ECONNREFUSED');
    } finally {
      host.close();
    }
  });

  it('reports a server that fails, with its output, and a server that never becomes healthy', async () => {
    const fork = await newFork('failing', 'failing');
    const servers = await startDevServers(
      fork,
      [
        { repoDir: 'web', spec: spec({ name: 'crash', command: `echo "cannot find module ${marker}" >&2; exit 3` }) },
        { repoDir: 'web', spec: spec({ name: 'slow', healthPath: '/broken', startTimeoutSeconds: 1 }) },
        { repoDir: 'web', spec: spec({ name: 'fine' }) },
      ],
      { network: false },
    );
    running.push(servers);
    const [crash, slow, fine] = servers.servers;
    expect(crash).toMatchObject({ name: 'crash', healthy: false });
    expect(crash!.error).toContain('exit code 3');
    expect(crash!.error).toContain(`cannot find module ${marker}`);
    expect(slow).toMatchObject({ name: 'slow', healthy: false });
    expect(slow!.error).toContain('status 503');
    expect(slow!.error).toContain('listening on');
    expect(fine).toMatchObject({ name: 'fine', healthy: true });
    // The failed ones are stopped; the healthy one runs on.
    expect(Object.keys(servers.env())).toEqual(['SVC_DEV_FINE_URL', 'SVC_DEV_FINE_PORT']);
    expect(await fetchFromFork(fork, `${fine!.url}/`)).toBe('dev:failing');
    expect(await fetchFromFork(fork, `${slow!.url}/`)).toBe('ECONNREFUSED');
    await servers.stop();
  });

  it("serves the agent's later edits: the server and the fork's commands share one overlay mount", async () => {
    // who.txt is the environment's until the agent edits it: the edit copies it up into the fork.
    const fork = await forks.create('live-edits', environment);
    const servers = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web', port: 4400 }) }], { network: false });
    running.push(servers);
    expect(await fetchFromFork(fork, 'http://127.0.0.1:4400/')).toBe('dev:environment');
    const edited = await fork.run(['sh', '-c', 'echo after > web/who.txt'], { timeoutMs: 20_000 });
    expect(edited.exitCode, edited.stderr).toBe(0);
    expect(await fetchFromFork(fork, 'http://127.0.0.1:4400/')).toBe('dev:after');
    await servers.stop();
    expect(fork.heldMountPath()).toBeNull();
    // Once they stop, commands mount the fork themselves again, and the edit is still there.
    expect((await fork.run(['cat', 'web/who.txt'], { timeoutMs: 20_000 })).stdout).toBe('after\n');
  });

  it('lets two forks use the same preferred port, each reaching its own server', async () => {
    const [first, second] = await Promise.all([newFork('twin-a', 'a'), newFork('twin-b', 'b')]);
    const target = [{ repoDir: 'web', spec: spec({ name: 'web', port: 4321 }) }];
    const [serversA, serversB] = await Promise.all([
      startDevServers(first!, target, { network: false }),
      startDevServers(second!, target, { network: false }),
    ]);
    running.push(serversA, serversB);
    expect(serversA.servers[0]).toMatchObject({ port: 4321, healthy: true });
    expect(serversB.servers[0]).toMatchObject({ port: 4321, healthy: true });
    expect(await fetchFromFork(first!, 'http://127.0.0.1:4321/')).toBe('dev:a');
    expect(await fetchFromFork(second!, 'http://127.0.0.1:4321/')).toBe('dev:b');
    await Promise.all([serversA.stop(), serversB.stop()]);
  });

  it('with network access, run in a private network connected through slirp4netns, healthy from the service side', async () => {
    const fork = await newFork('online', 'online');
    // The host's loopback holds the server's preferred port: the fork's network has a loopback of its own.
    const host: Server = createServer((_request, response) => response.end('host'));
    await new Promise<void>((resolve) => host.listen(0, '127.0.0.1', resolve));
    const hostPort = (host.address() as AddressInfo).port;
    try {
      const servers = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web', port: hostPort }) }], {
        network: true,
        log: (message) => logs.push(message),
      });
      running.push(servers);
      expect(servers.servers).toEqual([{ name: 'web', port: hostPort, url: `http://127.0.0.1:${hostPort}`, healthy: true }]);
      expect(fork.network).toMatchObject({ outside: true });
      const records = readProcessRecords(fork.info.dir);
      expect(records.map((record) => record.name).sort()).toEqual(['mount', 'network', 'network-outside', 'web']);
      // The fork's commands with network access join that network: the dev server, with a route outside.
      expect(await fetchFromFork(fork, `http://127.0.0.1:${hostPort}/`, { network: true })).toBe('dev:online');
      const route = await fork.run(['awk', '$2 == "00000000" { print $1 }', '/proc/net/route'], { timeoutMs: 20_000, network: true });
      expect(route.stdout).toBe('tap0\n');
      // Commands without network access stay out of it (and the outside).
      expect(await fetchFromFork(fork, `http://127.0.0.1:${hostPort}/`)).toBe('ECONNREFUSED');
      await servers.stop();
      expect(fork.network).toBeNull();
      // slirp4netns went with the network.
      expect(leftovers(records.map((record) => record.pid))).toEqual([]);
    } finally {
      host.close();
    }
  });

  it('where no private network can be made, are not started unless the host network is allowed, then run on it', async () => {
    const fork = await newFork('no-namespace', 'no-namespace');
    const unmade = 'nsenter: reassociate to namespace failed: Operation not permitted';
    const lines: string[] = [];
    const refused = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web', port: 4000 }) }], {
      network: false,
      noPrivateNetwork: unmade,
      log: (message) => lines.push(message),
    });
    running.push(refused);
    expect(refused.servers).toEqual([
      { name: 'web', port: 4000, url: 'http://127.0.0.1:4000', healthy: false, error: `dev servers need a private network namespace: ${unmade}` },
    ]);
    expect(refused.env()).toEqual({});
    expect(lines).toEqual([`dev servers of fork no-namespace not started: dev servers need a private network namespace: ${unmade}`]);
    expect(fork.network).toBeNull();
    expect(fork.mount).toBeNull();
    expect(readProcessRecords(fork.info.dir)).toEqual([]);
    expect(leftovers()).toEqual([]);

    // The operator allowed the host's network: the servers use it (not a slirp4netns network of their own,
    // where the health check could not reach them), and the service reaches them there.
    const hostForks = new ForkManager(join(root, 'host-forks'), { hiddenPaths: [join(root, 'environments'), forksRoot], allowUnsandboxed: false, allowHostNetwork: true });
    const hostFork = await hostForks.create('host-network', environment);
    await hostFork.run(['sh', '-c', 'echo host-network > web/who.txt'], { timeoutMs: 20_000 });
    const servers = await startDevServers(hostFork, [{ repoDir: 'web', spec: spec({ name: 'web' }) }], {
      network: false,
      noPrivateNetwork: unmade,
      log: (message) => lines.push(message),
    });
    running.push(servers);
    expect(servers.servers).toMatchObject([{ name: 'web', healthy: true }]);
    expect(lines.at(-1)).toContain("run on the host's network (SVC_ALLOW_HOST_NETWORK; a private network for the fork could not be made: nsenter");
    const answer = await fetch(servers.servers[0]!.url).then((response) => response.text());
    expect(answer).toBe('dev:host-network');
    await servers.stop();
    expect(leftovers()).toEqual([]);
  });

  it('stop() leaves no process behind, and neither do the recorded processes of another starter', async () => {
    const fork = await newFork('cleanup', 'cleanup');
    // A server that starts children of its own in its group, as `npm run dev` does.
    const command = `sleep 300 & node server.js ${marker}`;
    const servers = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web', command }) }], { network: false });
    running.push(servers);
    expect(servers.servers[0]!.healthy).toBe(true);
    // The overlay mount's holder, the network's and the server's.
    expect(readProcessRecords(fork.info.dir).map((record) => record.name).sort()).toEqual(['mount', 'network', 'web']);
    const groups = readProcessRecords(fork.info.dir).map((record) => record.pid);
    expect(leftovers(groups).length).toBeGreaterThanOrEqual(3);
    await servers.stop();
    expect(leftovers(groups)).toEqual([]);
    expect(readProcessRecords(fork.info.dir)).toEqual([]);

    // The fork lifecycle stops a fork's servers from their records alone (it may be another process).
    const again = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web', command }) }], { network: false });
    running.push(again);
    const records = readProcessRecords(fork.info.dir);
    expect(await stopRecordedProcesses(fork.info.dir, records)).toBe(3);
    expect(leftovers(records.map((record) => record.pid))).toEqual([]);
    expect(readProcessRecords(fork.info.dir)).toEqual([]);
    // A later start stops whatever an earlier one left (here: nothing is left, and it starts cleanly).
    const third = await startDevServers(fork, [{ repoDir: 'web', spec: spec({ name: 'web' }) }], { network: false });
    running.push(third);
    expect(third.servers[0]!.healthy).toBe(true);
    await third.stop();
    expect(leftovers()).toEqual([]);
  });
});
