/** `svc admin`: operator bootstrap commands that work directly on the store. */
import { readFileSync } from 'node:fs';
import type { Command } from 'commander';
import { admin, publicUrlOf, withEnvironments, withStore } from '../main.js';
import { formatCredits } from '../domain/pricing.js';
import { CliError, table } from './output.js';
import { addStoreOptions, configFrom } from './store-options.js';

const when = (date: Date | null): string => (date ? date.toISOString().replace(/\.\d+Z$/, 'Z') : '-');


/** The link goes alone on the last line, so that scripts can take it with `tail -n 1`. */
function printSignInLink(link: { url: string; expiresAt: Date }): void {
  process.stdout.write(`One-time sign-in link (works once, until ${when(link.expiresAt)}):\n${link.url}\n`);
}

/** Prints each setup command's result; a failed one fails the command (its output's end on stderr). */
function reportSetup(results: admin.SetupResult[]): void {
  for (const result of results) process.stdout.write(`setup ${result.repository}: \`${result.command}\` ${result.passed ? 'passed' : `failed (exit ${result.exitCode ?? 'signal'})`}\n`);
  const failed = results.find((result) => !result.passed);
  if (failed) throw new CliError(`setup of ${failed.repository} failed: ${failed.outputTail.split('\n').at(-1) ?? ''}`);
}

export function registerAdmin(program: Command): void {
  const root = program.command('admin').description('operator commands on the store (--data-dir or DATABASE_URL)');

  const workspace = root.command('workspace').description('manage workspaces');
  addStoreOptions(
    workspace
      .command('create <name>')
      .description('create a workspace with its default routing config')
      .option('--plan <plan>', 'free, pro or max', 'free')
      .option('--default-agent <agent>', 'agent of its default routing config (SVC_DEFAULT_AGENT)'),
  ).action(async (name: string, options: { plan: string; defaultAgent?: string } & Record<string, unknown>) => {
    const { plan, ...rest } = options;
    const config = configFrom(rest);
    const created = await withStore(config, (database) => admin.addWorkspace(database.db, name, plan, config.defaultAgent));
    process.stdout.write(`Created workspace "${created.name}" (plan ${created.plan}, id ${created.id})\n`);
  });
  addStoreOptions(workspace.command('list').description('list workspaces').option('--json', 'print JSON')).action(
    async (options: { json?: boolean } & Record<string, unknown>) => {
      const { json, ...rest } = options;
      const rows = await withStore(configFrom(rest), (database) => admin.listWorkspaces(database.db));
      if (json) return void process.stdout.write(`${JSON.stringify(rows, null, 2)}\n`);
      process.stdout.write(table(rows.map((row) => ({ name: row.name, plan: row.plan, id: row.id, created: when(row.createdAt) }))));
    },
  );

  const credits = root.command('credits').description("manage a workspace's model-compute credits (1 credit = 1 USD)");
  addStoreOptions(
    credits
      .command('grant <amount>')
      .description('add credits to a workspace, e.g. 25 or 2.5')
      .requiredOption('--workspace <name>', 'workspace'),
  ).action(async (amount: string, options: { workspace: string } & Record<string, unknown>) => {
    const { workspace: name, ...rest } = options;
    const result = await withStore(configFrom(rest), (database) => admin.grantCredits(database.db, name, amount));
    process.stdout.write(`Granted ${formatCredits(result.grantedMicro)} credits to "${name}"; balance ${formatCredits(result.balanceMicro)}\n`);
  });
  addStoreOptions(credits.command('balance').description("show a workspace's credit balance").requiredOption('--workspace <name>', 'workspace')).action(
    async (options: { workspace: string } & Record<string, unknown>) => {
      const { workspace: name, ...rest } = options;
      const balance = await withStore(configFrom(rest), (database) => admin.workspaceCredits(database.db, name));
      process.stdout.write(`${formatCredits(balance)}\n`);
    },
  );

  const repo = root.command('repo').description("connect repositories to a workspace's environment and code host");
  addStoreOptions(
    repo
      .command('add <source>')
      .description('connect a repository from a git URL or a local path; its checks and setup are detected from package.json')
      .requiredOption('--workspace <name>', 'workspace')
      .option('--name <owner/repo>', 'its name (default: from the URL, or local/<directory> for a path)')
      .option('--no-setup', 'do not run its setup commands now'),
  ).action(async (source: string, options: { workspace: string; name?: string; setup: boolean } & Record<string, unknown>) => {
    const { workspace: name, name: fullName, setup, ...rest } = options;
    const config = configFrom(rest);
    const { repository, spec, setup: ran } = await withEnvironments(config, (database, environments) =>
      admin.addRepository(database.db, environments, { workspace: name, source, setup, ...(fullName === undefined ? {} : { fullName }) }),
    );
    const checks = spec.checks.map((check) => check.name).join(', ') || 'none';
    process.stdout.write(
      `Connected ${repository.fullName} to "${name}" (branch ${repository.defaultBranch}, directory ${repository.dir}/; checks: ${checks}).\n` +
        `Edit its setup, checks and dev servers with: svc admin environment config --workspace ${name} [--file FILE]\n`,
    );
    reportSetup(ran);
  });
  addStoreOptions(
    repo.command('setup').description("run every repository's setup commands in the environment again").requiredOption('--workspace <name>', 'workspace'),
  ).action(async (options: { workspace: string } & Record<string, unknown>) => {
    const { workspace: name, ...rest } = options;
    const config = configFrom(rest);
    const ran = await withEnvironments(config, (database, environments) => admin.setupEnvironment(database.db, environments, name));
    if (ran.length === 0) process.stdout.write('No setup commands are configured.\n');
    reportSetup(ran);
  });
  addStoreOptions(repo.command('list').description("list a workspace's repositories").requiredOption('--workspace <name>', 'workspace').option('--json', 'print JSON')).action(
    async (options: { workspace: string; json?: boolean } & Record<string, unknown>) => {
      const { workspace: name, json, ...rest } = options;
      const rows = await withStore(configFrom(rest), (database) => admin.workspaceRepositories(database.db, name));
      if (json) return void process.stdout.write(`${JSON.stringify(rows, null, 2)}\n`);
      process.stdout.write(table(rows.map((row) => ({ name: row.fullName, branch: row.defaultBranch, dir: row.dir, source: row.source }))) || 'No repositories.\n');
    },
  );

  const environment = root.command('environment').description("a workspace's environment: the config of its setup, checks and dev servers");
  addStoreOptions(
    environment
      .command('config')
      .description('print the environment config (.svc/environment.json), or replace it with --file (then the setups it changes run)')
      .requiredOption('--workspace <name>', 'workspace')
      .option('--file <path>', 'the new config (JSON); - reads standard input'),
  ).action(async (options: { workspace: string; file?: string } & Record<string, unknown>) => {
    const { workspace: name, file, ...rest } = options;
    const config = configFrom(rest);
    if (file === undefined) {
      const current = await withEnvironments(config, (database, environments) => admin.environmentConfig(database.db, environments, name));
      return void process.stdout.write(current.text);
    }
    let text: string;
    try {
      text = file === '-' ? readFileSync(0, 'utf8') : readFileSync(file, 'utf8');
    } catch (error) {
      throw new CliError(`cannot read ${file}: ${(error as Error).message}`);
    }
    const changed = await withEnvironments(config, (database, environments) => admin.setEnvironmentConfig(database.db, environments, name, text));
    process.stdout.write(`The environment of "${name}" is now at version ${changed.version}.\n`);
    reportSetup(changed.setup);
  });

  const apiKey = root.command('api-key').description('manage workspace API keys');
  addStoreOptions(
    apiKey
      .command('create')
      .description('create an API key; the key is printed once, alone on the last line')
      .requiredOption('--workspace <name>', 'workspace the key belongs to')
      .option('--name <label>', 'a label to tell keys apart', 'api key')
      .option('--expires-in <duration>', 'lifetime such as 1h, 7d, 4w or 1y (default: no expiry)'),
  ).action(async (options: { workspace: string; name: string; expiresIn?: string } & Record<string, unknown>) => {
    const { workspace: name, name: label, expiresIn, ...rest } = options;
    const { key, record } = await withStore(configFrom(rest), (database) =>
      admin.addApiKey(database.db, { workspace: name, name: label, ...(expiresIn === undefined ? {} : { expiresIn }) }),
    );
    const expiry = record.expiresAt ? `, expires ${when(record.expiresAt)}` : '';
    process.stdout.write(`Created API key ${record.prefix}… "${record.name}" for workspace "${name}"${expiry}. It is shown once:\n${key}\n`);
  });
  addStoreOptions(
    apiKey
      .command('list')
      .description("list a workspace's API keys (never the keys themselves)")
      .requiredOption('--workspace <name>', 'workspace')
      .option('--json', 'print JSON'),
  ).action(async (options: { workspace: string; json?: boolean } & Record<string, unknown>) => {
    const { workspace: name, json, ...rest } = options;
    const keys = await withStore(configFrom(rest), (database) => admin.workspaceApiKeys(database.db, name));
    if (json) return void process.stdout.write(`${JSON.stringify(keys, null, 2)}\n`);
    const now = Date.now();
    process.stdout.write(
      table(
        keys.map((key) => ({
          id: key.id,
          prefix: `${key.prefix}…`,
          name: key.name,
          status: key.revokedAt ? 'revoked' : key.expiresAt && key.expiresAt.getTime() <= now ? 'expired' : 'active',
          created: when(key.createdAt),
          expires: when(key.expiresAt),
          'last used': when(key.lastUsedAt),
        })),
      ) || 'No API keys.\n',
    );
  });
  addStoreOptions(
    apiKey
      .command('revoke <idOrPrefix>')
      .description('revoke a key by its id or its listed prefix')
      .requiredOption('--workspace <name>', 'workspace'),
  ).action(async (idOrPrefix: string, options: { workspace: string } & Record<string, unknown>) => {
    const { workspace: name, ...rest } = options;
    const revoked = await withStore(configFrom(rest), (database) => admin.removeApiKey(database.db, name, idOrPrefix.replace(/…$/, '')));
    process.stdout.write(`Revoked API key ${revoked.prefix}… "${revoked.name}" (${revoked.id})\n`);
  });

  const user = root.command('user').description('manage user accounts and their sign-in links');
  addStoreOptions(
    user
      .command('create')
      .description('create a user (with a personal workspace) or take an existing one, add it to a workspace, and print a one-time sign-in link')
      .requiredOption('--email <email>', 'the user\'s email address')
      .requiredOption('--workspace <name>', 'workspace the user joins')
      .option('--name <name>', 'display name (for a new account)')
      .option('--role <role>', 'owner, admin or member', 'member')
      .option('--confirm', 'confirm that an existing account made by another workspace belongs to this person (any workspace may then add it; its password, sessions and older links end)')
      .option('--public-url <url>', 'address people reach the service at, for the link (SVC_PUBLIC_URL)'),
  ).action(async (options: { email: string; workspace: string; name?: string; role: string; confirm?: boolean } & Record<string, unknown>) => {
    const { email, workspace: name, name: displayName, role, confirm, ...rest } = options;
    const config = configFrom(rest);
    const created = await withStore(config, (database) =>
      admin.createUser(
        database.db,
        { email, workspace: name, role, confirm: confirm === true, ...(displayName === undefined ? {} : { name: displayName }) },
        { publicUrl: publicUrlOf(config), defaultAgent: config.defaultAgent },
      ),
    );
    const account = created.created ? `Created user ${created.user.email} (id ${created.user.id}) with a personal workspace` : `User ${created.user.email} (id ${created.user.id}) already exists`;
    const membership = created.membershipAdded ? `added to "${name}" as ${created.role}` : `already a member of "${name}" (${created.role})`;
    process.stdout.write(`${account}; ${membership}.\n`);
    printSignInLink(created.signInLink);
  });
  addStoreOptions(
    user
      .command('sign-in-link')
      .description('print a fresh one-time sign-in link for a user (earlier unused links stop working)')
      .requiredOption('--email <email>', 'the user\'s email address')
      .option('--public-url <url>', 'address people reach the service at, for the link (SVC_PUBLIC_URL)'),
  ).action(async (options: { email: string } & Record<string, unknown>) => {
    const { email, ...rest } = options;
    const config = configFrom(rest);
    const { signInLink } = await withStore(config, (database) => admin.userSignInLink(database.db, email, publicUrlOf(config)));
    printSignInLink(signInLink);
  });
  addStoreOptions(user.command('list').description('list users and their workspaces (never passwords)').option('--json', 'print JSON')).action(
    async (options: { json?: boolean } & Record<string, unknown>) => {
      const { json, ...rest } = options;
      const rows = await withStore(configFrom(rest), (database) => admin.userAccounts(database.db));
      if (json) return void process.stdout.write(`${JSON.stringify(rows, null, 2)}\n`);
      process.stdout.write(
        table(
          rows.map((row) => ({
            email: row.email,
            name: row.name ?? '-',
            id: row.id,
            password: row.hasPassword ? 'set' : 'none',
            workspaces: row.workspaces.map((workspace) => `${workspace.name} (${workspace.personal ? 'personal' : workspace.role})`).join(', '),
            created: when(row.createdAt),
          })),
        ) || 'No users.\n',
      );
    },
  );
}
