/** The `svc` command line: one program, one file per command group. */
import { Command, CommanderError } from 'commander';
import { registerAdmin } from './admin.js';
import { fail } from './output.js';
import { registerRunner } from './runner.js';
import { registerServer } from './server.js';
import { registerWorker } from './worker.js';

export function buildProgram(): Command {
  const program = new Command('svc')
    .description('svc: a task delegation service for coding agents')
    .version(process.env.npm_package_version ?? '0.1.0')
    .showHelpAfterError('(run with --help for usage)')
    .exitOverride()
    .configureOutput({ writeErr: (text) => process.stderr.write(text) });
  registerServer(program);
  registerWorker(program);
  registerAdmin(program);
  registerRunner(program);
  return program;
}

export async function run(argv: string[]): Promise<void> {
  const program = buildProgram();
  try {
    await program.parseAsync(argv);
  } catch (error) {
    if (error instanceof CommanderError) {
      // Commander already printed its one-line message (or the help/version text).
      process.exit(error.exitCode === 0 ? 0 : 2);
    }
    fail(error);
  }
}
