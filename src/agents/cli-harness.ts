/**
 * What every agent-CLI harness shares: running the CLI inside the sandboxed fork through
 * `Workspace.runStreaming`, reading its JSON lines in order, and closing the run with one outcome.
 * Each CLI (claude-code.ts, codex.ts) contributes its argv and a translator from its stream format.
 *
 * Questions: in print/exec mode nobody can answer a CLI's question while it runs, so the CLI is told (in
 * its instructions) to end with a final message that starts with `QUESTION:` when it cannot go on
 * without a decision; that final message becomes the run's question outcome, as `ask_user` does in the
 * built-in loop.
 *
 * Credentials and network: the sandbox never holds the platform's provider key, and the CLI has no
 * network but its provider's API. In the cloud each run leases a token from the host's credential proxy
 * (credential-proxy.ts), which allows only that provider's API calls; the CLI runs in a private network
 * namespace with the proxy's unix socket bound in (`egressDir`), and a forwarder started before it
 * (`FORWARDER`) listens on the sandbox's own 127.0.0.1 and relays to that socket. The CLI's base URL is
 * the forwarder's address followed by the lease, and its key variable holds the token, which is worthless
 * outside the proxy and revoked when the run ends. A desktop runner instead runs the CLI with the user's
 * own login and passes no key at all (`own-login`).
 */
import { basename, dirname } from 'node:path';
import type { TaskMode } from '../protocol/rest.js';
import { EGRESS_DIR } from '../sandbox/fork.js';
import type { CredentialProxy } from './credential-proxy.js';
import { ModelConfigError, requireEnv } from './models.js';
import type { AgentEvent, RunManifest, RunOutcome } from './types.js';

/** An agent CLI is slow but not endless: a run that takes longer than this is stopped. */
const CLI_TIMEOUT_MS = 2 * 60 * 60_000;
const STDERR_TAIL = 2_000;

const UNATTENDED =
  'You run unattended: nobody can answer a question while you work. If you cannot go on without a decision ' +
  'from the person, stop and make your final message the question alone, starting with "QUESTION:".';

/** The mode's instructions for an agent CLI: the built-in loop's, without its finish/submit_plan tools. */
const CLI_MODE_PROMPT: Record<TaskMode, string> = {
  agent:
    'Implement the requested change in the repositories under /workspace, then verify it (tests, lint, types, build). ' +
    'When it is done and verified, end with a summary of what you changed and the proof.',
  plan:
    'Research the request without changing files, then answer with a step-by-step implementation plan in Markdown. ' +
    'Implementation starts only after a person approves the plan.',
  ask: 'Answer the question from the code under /workspace without changing anything.',
  goal: 'Work towards the goal in /workspace, checking it after each change, until the goal holds. Then end with the evidence.',
  dev_env:
    'Repair the development environment under /workspace (setup commands, dependencies, dev servers) so that it ' +
    'installs and runs cleanly. End with what you repaired.',
};

/** The mode's instructions, then the routing config's, for a CLI's system prompt (or the head of its prompt). */
export function cliInstructions(manifest: RunManifest): string {
  return [CLI_MODE_PROMPT[manifest.mode], UNATTENDED, manifest.instructions].filter(Boolean).join('\n\n');
}

/** The thread so far and the new message, as one prompt: a CLI run starts without memory of earlier jobs. */
export function cliPrompt(manifest: RunManifest): string {
  if (manifest.history.length === 0) return manifest.input;
  const turns = manifest.history.map((turn) => `### ${turn.role === 'user' ? 'User' : 'You (earlier)'}\n\n${turn.content}`);
  return ['## The conversation so far', ...turns, '## The new message', manifest.input].join('\n\n');
}

/** How a finished run's last words end it: a question, a plan in plan mode, or the answer. */
export function outcomeOfFinalText(mode: TaskMode, text: string, plan: string | null = null): RunOutcome {
  const question = /^\s*QUESTION:\s*([\s\S]*)$/.exec(text);
  if (question?.[1]?.trim()) return { status: 'question', question: question[1].trim() };
  if (mode === 'plan') {
    const proposed = plan?.trim() || text.trim();
    return proposed ? { status: 'plan', plan: proposed } : { status: 'failed', error: 'the agent ended plan mode without a plan' };
  }
  return text.trim() ? { status: 'completed', answer: text } : { status: 'failed', error: 'the agent finished without a final message' };
}

/** Where a CLI's provider credentials come from; see the file comment. */
export type CliCredentials =
  /** The cloud: the platform key from the service's environment, reached only through a proxy lease. */
  | { kind: 'proxy'; proxy: CredentialProxy }
  /** A desktop runner: the CLI's own login and configuration on the user's computer; no key is passed. */
  | { kind: 'own-login' };

/** How one CLI reaches its provider, and the service variables that configure it. */
export interface ProviderRoute {
  /** The platform key in the service's environment; in the sandbox, the variable the CLI reads its key from. */
  keyVariable: string;
  /** Further variables the CLI may read its key from. */
  alsoKeyVariables?: string[];
  /** The service's optional endpoint; in the sandbox, the variable the CLI reads its base URL from. */
  baseUrlVariable: string;
  /** The base URL the CLI uses by default: the proxy's upstream when the service sets none. */
  defaultUpstream: string;
  /** The upstream for a configured endpoint, where the service's convention differs from the CLI's. */
  upstreamOf?: (configured: string) => string;
  /** The headers that carry the real key to the provider. */
  credentialHeaders: (key: string) => Record<string, string>;
  /** The provider API calls the CLI makes (`METHOD /path` under its base URL): all that its lease allows. */
  paths: readonly string[];
}

/** The sandbox variables of one run, how it reaches its provider, and the end of their validity. */
export interface CliSession {
  env: Record<string, string>;
  /** Through the credential proxy: its socket (on the host), and the variable that gets the forwarder's URL and the lease path. */
  proxy?: { socketPath: string; baseUrlVariable: string; basePath: string };
  release(): void;
}

export interface CliAccess {
  open(): Promise<CliSession>;
}

/**
 * Resolves a CLI's credentials once, when its harness is made: a missing key or an unusable endpoint fails
 * then (ModelConfigError), naming the variable. Each run then opens a session of its own.
 */
export function cliAccess(env: NodeJS.ProcessEnv, agentId: string, route: ProviderRoute, credentials: CliCredentials): CliAccess {
  switch (credentials.kind) {
    case 'own-login':
      return { open: async () => ({ env: {}, release: () => undefined }) };
    case 'proxy': {
      const key = requireEnv(env, route.keyVariable, agentId);
      const configured = env[route.baseUrlVariable];
      const upstreamBaseUrl = configured ? (route.upstreamOf?.(configured) ?? configured) : route.defaultUpstream;
      if (!/^https?:\/\//.test(upstreamBaseUrl) || !URL.canParse(upstreamBaseUrl)) {
        throw new ModelConfigError(`${route.baseUrlVariable} is not an http(s) URL: the agent ${agentId} cannot reach its provider`);
      }
      const headers = route.credentialHeaders(key);
      return {
        async open() {
          const lease = await credentials.proxy.lease({ upstreamBaseUrl, headers, paths: route.paths });
          const keys = [route.keyVariable, ...(route.alsoKeyVariables ?? [])].map((name) => [name, lease.token] as const);
          return {
            env: Object.fromEntries(keys),
            proxy: { socketPath: lease.socketPath, baseUrlVariable: route.baseUrlVariable, basePath: lease.basePath },
            release: lease.release,
          };
        },
      };
    }
  }
}

/** Reads one CLI's JSON stream: each parsed line in, journal events out; the outcome once it ended. */
export interface StreamTranslator {
  translate(message: Record<string, unknown>): AgentEvent[];
  /** Called once the process is gone: trailing events (usage never reported per step) and the outcome, if the stream told one. */
  end(): { events: AgentEvent[]; outcome: RunOutcome | null };
}

export interface CliSpec {
  /** For messages: "Claude Code". */
  label: string;
  /** The program (name on PATH or absolute path inside the sandbox) and the variable that set it. */
  command: string;
  commandVariable: string;
  install: string;
  argv: string[];
  /** The CLI's settings; its credentials come from `access`. */
  env: Record<string, string>;
  access: CliAccess;
  stdin: string;
  translator: StreamTranslator;
}

/** Runs a CLI in the manifest's workspace and reports its stream as journal events; see the file comment. */
export async function runCli(spec: CliSpec, manifest: RunManifest, emit: (event: AgentEvent) => Promise<void>): Promise<RunOutcome> {
  let session: CliSession;
  try {
    session = await spec.access.open();
  } catch (error) {
    const message = `${spec.label} could not start: no credential lease (${error instanceof Error ? error.message : String(error)})`;
    await emit({ kind: 'error', data: { message } });
    return { status: 'failed', error: message };
  }
  try {
    return await runCliProcess(spec, session, manifest, emit);
  } finally {
    session.release();
  }
}

/**
 * Started in the sandbox before the CLI (by `node -e`, argv: socket, `{ variable: path }` as JSON, then the
 * CLI's argv): listens on the sandbox's own 127.0.0.1, relays every connection to the credential proxy's
 * socket, and runs the CLI with each variable set to its address followed by the path. It ends with the
 * CLI, with its exit code. Plain CommonJS: it runs on whatever node the sandbox has.
 */
const FORWARDER = `
const net = require('node:net');
const { spawn } = require('node:child_process');
const { constants } = require('node:os');
const [socketPath, routes, command, ...args] = process.argv.slice(1);
const fail = (message, code) => { process.stderr.write('svc proxy forwarder: ' + message + '\\n'); process.exit(code); };
const server = net.createServer((client) => {
  const upstream = net.connect(socketPath);
  const drop = () => { client.destroy(); upstream.destroy(); };
  client.on('error', drop);
  upstream.on('error', drop);
  client.pipe(upstream).pipe(client);
});
server.on('error', (error) => fail(error.message, 126));
server.listen(0, '127.0.0.1', () => {
  const env = { ...process.env };
  for (const [name, path] of Object.entries(JSON.parse(routes))) env[name] = 'http://127.0.0.1:' + server.address().port + path;
  const child = spawn(command, args, { stdio: 'inherit', env });
  child.on('error', (error) => fail(error.message, 127));
  child.on('exit', (code, signal) => process.exit(code ?? 128 + (constants.signals[signal] ?? 0)));
  for (const name of ['SIGTERM', 'SIGINT', 'SIGHUP']) process.on(name, () => child.kill(name));
});
`;

/**
 * The sandbox's argv for the CLI. `command -v` makes a missing program exit 127 the same way with and
 * without bubblewrap (whose own exec failure is a plain 1). Through the proxy, the forwarder starts it.
 */
function cliArgv(spec: CliSpec, proxy: CliSession['proxy']): string[] {
  const found = 'command -v "$1" >/dev/null 2>&1 || exit 127';
  if (!proxy) return ['sh', '-c', `${found}; exec "$@"`, 'sh', spec.command, ...spec.argv];
  const script = [
    found,
    'command -v node >/dev/null 2>&1 || { echo "node is not installed in the sandbox; the credential proxy\'s forwarder needs it" >&2; exit 126; }',
    'c=$1; f=$2; s=$3; r=$4; shift 4',
    // `--`: whatever follows is the forwarder's arguments, never node's options.
    'exec node -e "$f" -- "$s" "$r" "$c" "$@"',
  ].join('\n');
  const socket = `${EGRESS_DIR}/${basename(proxy.socketPath)}`;
  return ['sh', '-c', script, 'sh', spec.command, FORWARDER, socket, JSON.stringify({ [proxy.baseUrlVariable]: proxy.basePath }), ...spec.argv];
}

async function runCliProcess(
  spec: CliSpec,
  session: CliSession,
  manifest: RunManifest,
  emit: (event: AgentEvent) => Promise<void>,
): Promise<RunOutcome> {
  // Events go out in stream order although lines arrive synchronously; a failed emit (the journal refused)
  // stops reporting and is rethrown once the process is gone.
  let queue = Promise.resolve();
  const refused: unknown[] = [];
  const send = (events: AgentEvent[]) => {
    if (events.length === 0) return;
    queue = queue.then(async () => {
      if (refused.length) return;
      try {
        for (const event of events) await emit(event);
      } catch (error) {
        refused.push(error);
      }
    });
  };
  let unreadable = 0;
  const onLine = (line: string) => {
    if (!line.trim()) return;
    let message: unknown;
    try {
      message = JSON.parse(line);
    } catch {
      unreadable += 1;
      return;
    }
    if (typeof message !== 'object' || message === null || Array.isArray(message)) unreadable += 1;
    else send(spec.translator.translate(message as Record<string, unknown>));
  };
  const { proxy } = session;
  // Through the proxy: a private network whose one way out is the proxy's socket. With its own login (a
  // desktop runner), the CLI reaches its provider itself.
  const reach = proxy ? { network: false, egressDir: dirname(proxy.socketPath) } : { network: true };
  let result: Awaited<ReturnType<RunManifest['workspace']['runStreaming']>>;
  try {
    result = await manifest.workspace.runStreaming(cliArgv(spec, proxy), { env: { ...spec.env, ...session.env }, timeoutMs: CLI_TIMEOUT_MS, ...reach, stdin: spec.stdin, onLine });
  } catch (error) {
    await queue;
    return fail(`${spec.label} could not start: ${error instanceof Error ? error.message : String(error)}`);
  }
  await queue;
  if (refused.length) throw refused[0];
  if (manifest.signal?.aborted) return { status: 'failed', error: `${spec.label} was stopped: the run was cancelled` };

  const ended = spec.translator.end();
  for (const event of ended.events) await emit(event);
  const stderr = result.stderr.trim().slice(-STDERR_TAIL);
  if (result.exitCode === 127) {
    return fail(
      `the ${spec.label} CLI is not installed: "${spec.command}" was not found in the sandbox. Install it with ${spec.install} ` +
        `where the sandbox sees it (under /usr or /opt), or point ${spec.commandVariable} at it`,
    );
  }
  if (result.timedOut) return fail(`${spec.label} ran longer than ${CLI_TIMEOUT_MS / 60_000} minutes and was stopped`);
  const outcome = ended.outcome ?? {
    status: 'failed' as const,
    error:
      `${spec.label} ended without a result (exit code ${result.exitCode}` +
      `${unreadable ? `, ${unreadable} unreadable output line${unreadable === 1 ? '' : 's'}` : ''})` +
      (stderr ? `: ${stderr}` : ''),
  };
  await emit(closingEvent(outcome));
  return outcome;

  async function fail(error: string): Promise<RunOutcome> {
    await emit({ kind: 'error', data: { message: error } });
    return { status: 'failed', error };
  }
}

function closingEvent(outcome: RunOutcome): AgentEvent {
  switch (outcome.status) {
    case 'completed':
      return { kind: 'final', data: { answer: outcome.answer } };
    case 'question':
      return { kind: 'question', data: { question: outcome.question } };
    case 'plan':
      return { kind: 'plan', data: { plan: outcome.plan } };
    case 'failed':
      return { kind: 'error', data: { message: outcome.error } };
  }
}

/** Narrowing helpers for foreign JSON: a field of the expected type or nothing. */
export const field = {
  string: (value: unknown, key: string): string | undefined => {
    const found = isRecord(value) ? value[key] : undefined;
    return typeof found === 'string' ? found : undefined;
  },
  number: (value: unknown, key: string): number | undefined => {
    const found = isRecord(value) ? value[key] : undefined;
    return typeof found === 'number' && Number.isFinite(found) ? found : undefined;
  },
  record: (value: unknown, key: string): Record<string, unknown> | undefined => {
    const found = isRecord(value) ? value[key] : undefined;
    return isRecord(found) ? found : undefined;
  },
  array: (value: unknown, key: string): unknown[] => {
    const found = isRecord(value) ? value[key] : undefined;
    return Array.isArray(found) ? found : [];
  },
};

export function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
