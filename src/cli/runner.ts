/** `svc runner`: the desktop runner (pair, start, status, projects); the work is in src/runner. */
import { createInterface } from 'node:readline';
import type { Command } from 'commander';
import { RunnerDaemon } from '../runner/daemon.js';
import { RunnerHome, resolveHome, resolveServer } from '../runner/home.js';
import { pair } from '../runner/pair.js';
import { addProject } from '../runner/projects.js';
import { runnerStatus, type RunnerStatus } from '../runner/status.js';
import { CliError, table } from './output.js';

interface HomeOption {
  home?: string;
}

const homeOf = (options: HomeOption) => new RunnerHome(resolveHome(options.home));

/** The first line of standard input: how the pairing code arrives when --code is not given. */
function readLine(prompt: string): Promise<string> {
  return new Promise((resolve, reject) => {
    if (process.stdin.isTTY) process.stderr.write(prompt);
    const lines = createInterface({ input: process.stdin, terminal: false });
    let answered = false;
    lines.once('line', (line) => {
      answered = true;
      lines.close();
      resolve(line);
    });
    lines.once('close', () => {
      if (!answered) reject(new CliError('no pairing code was given (standard input ended); pass it with --code'));
    });
  });
}

function positiveInteger(value: string): number {
  const parsed = Number(value);
  if (!Number.isInteger(parsed) || parsed < 1 || parsed > 64) throw new CliError(`--concurrency must be a whole number from 1 to 64, not ${value}`);
  return parsed;
}

function kib(bytes: number | null): string {
  return bytes === null ? '?' : bytes < 1024 ? `${bytes} B` : `${Math.round(bytes / 1024)} KiB`;
}

function printStatus(status: RunnerStatus): void {
  const out: string[] = [`home: ${status.home}`];
  if (!status.connection) {
    out.push('connection: not paired (svc runner pair)');
  } else {
    const identity =
      status.identity === 'unreachable' ? 'unreachable'
      : status.identity === 'unknown' ? 'the server does not know this credential (pair again)'
      : status.identity?.revoked ? 'revoked (pair again: svc runner pair)'
      : 'connected';
    out.push(`server: ${status.connection.server}`, `runner: ${status.connection.runnerId} (${status.connection.name})`, `workspace: ${status.connection.workspaceId}`, `identity: ${identity}`);
  }
  out.push(`daemon: ${status.daemonPid ? `running (pid ${status.daemonPid})` : 'not running'}`);
  process.stdout.write(`${out.join('\n')}\n\n`);
  process.stdout.write(
    table(status.projects.map((project) => ({ project: project.name, id: project.id, repositories: project.projectless ? '(projectless)' : project.repositories.join(', '), path: project.path }))) ||
      'No projects (svc runner project add PATH).\n',
  );
  process.stdout.write('\n');
  process.stdout.write(
    table(
      status.runs.map((run) => ({
        run: run.runId,
        task: run.taskSlug ?? '?',
        generation: run.generation === null ? '?' : String(run.generation),
        phase: run.phase === null ? '?' : run.outcome ? `${run.phase} (${run.outcome})` : run.phase,
        outbox: run.problem ? `quarantined: ${run.problem}` : `${run.pendingEvents} event(s), ${kib(run.pendingBytes)}`,
      })),
    ) || 'No runs in progress.\n',
  );
  if (status.quarantined.length > 0) {
    const lines = status.quarantined.map((entry) => `  ${entry.path}`);
    process.stdout.write(`\nMoved aside because their state was damaged (the runs were reported failed; remove them when done):\n${lines.join('\n')}\n`);
  }
}

export function registerRunner(program: Command): void {
  const runner = program.command('runner').description("the desktop runner: execute local tasks on this computer with the user's own agent CLIs and keys");
  const homeHelp = 'the runner home (SVC_RUNNER_HOME, default ~/.svc-runner)';

  runner
    .command('pair')
    .description('connect this computer to your account: open the link while signed in, then enter the code it shows')
    .option('--server <url>', 'the REST base URL, ending in /api/v1 (SERVICE_BASE_URL, default http://127.0.0.1:8080/api/v1)')
    .option('--name <name>', "this computer's name (default: its host name)")
    .option('--code <code>', 'the pairing code (default: read a line from standard input)')
    .option('--home <dir>', homeHelp)
    .action(async (options: { server?: string; name?: string; code?: string } & HomeOption) => {
      const home = homeOf(options);
      const result = await pair({
        home,
        server: resolveServer(options.server),
        ...(options.name ? { name: options.name } : {}),
        env: process.env,
        show: (url) => process.stdout.write(`Open this while signed in:\n${url}\n`),
        readCode: () => (options.code !== undefined ? Promise.resolve(options.code) : readLine('Pairing code: ')),
      });
      const how = result.reconnected ? 'Reconnected' : 'Paired';
      process.stdout.write(`${how} as runner ${result.receipt.runnerId} ("${result.receipt.name}", workspace ${result.receipt.workspaceId}).\n`);
      for (const runId of result.receipt.finalizedRuns) process.stdout.write(`The server stopped run ${runId} of the old connection.\n`);
      process.stdout.write('Start it with: svc runner start\n');
    });

  runner
    .command('start')
    .description('run the runner in the foreground until interrupted (one per home)')
    .option('--concurrency <n>', 'runs executed at once', '2')
    .option('--home <dir>', homeHelp)
    .action(async (options: { concurrency: string } & HomeOption) => {
      const daemon = new RunnerDaemon({ home: homeOf(options), concurrency: positiveInteger(options.concurrency) });
      const stop = () => daemon.stop();
      process.once('SIGINT', stop);
      process.once('SIGTERM', stop);
      await daemon.run();
      process.stderr.write('svc runner stopped\n');
      // Idle keep-alive sockets must not hold the process once the daemon is done.
      process.exit(0);
    });

  runner
    .command('status')
    .description("this computer's connection, projects, runs in progress and undelivered events")
    .option('--json', 'print JSON')
    .option('--home <dir>', homeHelp)
    .action(async (options: { json?: boolean } & HomeOption) => {
      const status = await runnerStatus(homeOf(options));
      if (options.json) return void process.stdout.write(`${JSON.stringify(status, null, 2)}\n`);
      printStatus(status);
    });

  const project = runner.command('project').description('the local projects runs can work in');
  project
    .command('add <path>')
    .description('register a folder: a git repository, a folder of repositories, or (--projectless) a folder without one')
    .option('--name <name>', 'its name (default: the folder name)')
    .option('--projectless', 'the folder holds no repository: make it the projectless environment')
    .option('--home <dir>', homeHelp)
    .action(async (path: string, options: { name?: string; projectless?: boolean } & HomeOption) => {
      const home = homeOf(options).ensure();
      const added = await addProject(home, path, { ...(options.name ? { name: options.name } : {}), ...(options.projectless ? { projectless: true } : {}) });
      const repositories = added.repositories.map((repository) => `${repository.name}${repository.defaultBranch ? ` (${repository.defaultBranch})` : ''}`);
      process.stdout.write(
        `Added project "${added.name}" (${added.id}): ${repositories.length ? repositories.join(', ') : 'the projectless environment'}.\n` +
          'A running runner registers it with its next heartbeat.\n',
      );
    });
  project
    .command('list')
    .description('list the registered projects')
    .option('--json', 'print JSON')
    .option('--home <dir>', homeHelp)
    .action((options: { json?: boolean } & HomeOption) => {
      const projects = homeOf(options).readProjects();
      if (options.json) return void process.stdout.write(`${JSON.stringify(projects, null, 2)}\n`);
      process.stdout.write(
        table(
          projects.map((entry) => ({
            name: entry.name,
            id: entry.id,
            repositories: entry.repositories.length ? entry.repositories.map((repository) => repository.name).join(', ') : '(projectless)',
            path: entry.path,
          })),
        ) || 'No projects (svc runner project add PATH).\n',
      );
    });
}
