/** Runs the real `svc` command from source in child processes, always bounded in time. */
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';

const SVC = ['--import', 'tsx', 'src/svc.ts'];

/** The child's environment: ours with `overrides` applied, where undefined removes a variable. */
function childEnv(overrides: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const env = { ...process.env, ...overrides };
  for (const [name, value] of Object.entries(overrides)) if (value === undefined) delete env[name];
  return env;
}

export interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs `svc …args` to completion (at most `timeoutMs`). */
export function runSvc(args: string[], env: NodeJS.ProcessEnv = {}, timeoutMs = 60_000): Promise<CliResult> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [...SVC, ...args], { env: childEnv(env), stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (chunk) => (stdout += chunk));
    child.stderr.on('data', (chunk) => (stderr += chunk));
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`svc ${args.join(' ')} did not finish in ${timeoutMs} ms\n${stdout}\n${stderr}`));
    }, timeoutMs);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      const port = typeof address === 'object' && address ? address.port : 0;
      server.close(() => resolve(port));
    });
    server.on('error', reject);
  });
}

export interface ServerProcess {
  child: ChildProcess;
  url: string;
  stdout(): string;
  /** Sends SIGTERM and waits for the exit code (SIGKILL after `timeoutMs`). */
  stop(timeoutMs?: number): Promise<number | null>;
}

const running = new Set<ChildProcess>();

/** Starts `svc server` on a free port and resolves once it logs that it is listening. */
export async function startSvcServer(args: string[], env: NodeJS.ProcessEnv = {}, timeoutMs = 60_000): Promise<ServerProcess> {
  const port = await freePort();
  // No executor unless a test asks for one: jobs must never reach a real model from a test.
  const child = await startSvcProcess(['server', '--port', String(port), '--host', '127.0.0.1', ...args], { SVC_EXECUTOR_CONCURRENCY: '0', ...env }, 'svc is listening', timeoutMs);
  return { ...child, url: `http://127.0.0.1:${port}` };
}

/** Starts `svc worker` and resolves once it logs that it runs. */
export function startSvcWorker(args: string[], env: NodeJS.ProcessEnv = {}, timeoutMs = 60_000): Promise<Omit<ServerProcess, 'url'>> {
  return startSvcProcess(['worker', ...args], env, 'svc worker is running', timeoutMs);
}

async function startSvcProcess(argv: string[], env: NodeJS.ProcessEnv, readyMessage: string, timeoutMs: number): Promise<Omit<ServerProcess, 'url'>> {
  const child = spawn(process.execPath, [...SVC, ...argv], {
    env: childEnv({ SVC_LOG_LEVEL: 'info', ...env }),
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  running.add(child);
  let stdout = '';
  let stderr = '';
  child.stdout!.on('data', (chunk) => (stdout += chunk));
  child.stderr!.on('data', (chunk) => (stderr += chunk));
  const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => {
    running.delete(child);
    resolve(code);
  }));
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`svc ${argv[0]} did not start in ${timeoutMs} ms\n${stdout}\n${stderr}`)), timeoutMs);
    const check = () => {
      if (stdout.includes(`"${readyMessage}"`)) {
        clearTimeout(timer);
        resolve();
      }
    };
    child.stdout!.on('data', check);
    child.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`svc ${argv[0]} exited with ${code}\n${stdout}\n${stderr}`));
    });
  });
  return {
    child,
    stdout: () => stdout,
    async stop(stopTimeoutMs = 15_000) {
      if (child.exitCode !== null || child.signalCode !== null) return child.exitCode;
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), stopTimeoutMs);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

/** Kills every server a test left running. */
export function killAll(): void {
  for (const child of running) child.kill('SIGKILL');
  running.clear();
}

/** The JSON log lines (pino) among a server's output; anything else (the bootstrap key) is skipped. */
export function logLines(stdout: string): Array<Record<string, unknown>> {
  return stdout.split('\n').flatMap((line) => {
    if (!line.startsWith('{')) return [];
    try {
      return [JSON.parse(line) as Record<string, unknown>];
    } catch {
      return [];
    }
  });
}

/** Waits (at most `timeoutMs`) until `predicate` holds, polling every 20 ms; returns whether it did. */
export async function eventually(predicate: () => boolean, timeoutMs = 5_000): Promise<boolean> {
  for (const end = Date.now() + timeoutMs; !predicate(); ) {
    if (Date.now() > end) return false;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return true;
}

/** The `service_…` key a fresh server printed, if it printed one. */
export function bootstrapKeyOf(stdout: string): string | null {
  return /^(service_[A-Za-z0-9_-]{43})$/m.exec(stdout)?.[1] ?? null;
}

/** A DATABASE_URL whose connections use `schema` (node-postgres passes `options` to the server). */
export function urlWithSchema(url: string, schema: string): string {
  const parsed = new URL(url);
  parsed.searchParams.set('options', `-c search_path=${schema}`);
  return parsed.toString();
}
