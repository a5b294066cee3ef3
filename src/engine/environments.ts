/**
 * The workspace environments (SPEC.md's long-lived development VM) as immutable versions
 * (sandbox/environment-versions.ts): making one, connecting repositories to it, bringing it up to date
 * with what people merged on the code host, and running setup again when a repository's setup commands
 * or its dependency manifests changed. Every change runs inside a sandbox — the environment's files are
 * the agents' and the setup scripts' to shape, so the host never runs git in them or follows their links
 * — and becomes a new version. Jobs keep the version their fork was made from.
 *
 * The environment is itself a repository, `svc/environment`, holding the config (`.svc/environment.json`)
 * and ignoring the working copies beside it: a `dev_env` run changes it through a pull request like any
 * other repository, and merging that pull request applies it (with setup where its commands changed).
 *
 * After a merge the merging process brings the environment up to date at once and runs the setups that
 * are due in the background; every process's scheduler sweeps all environments too, so an update that a
 * crash interrupted still happens. Two processes doing the same update at once cost work, never
 * correctness: only one of them publishes (the store's versions are created exclusively).
 */
import { existsSync, readdirSync } from 'node:fs';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, dirname, join } from 'node:path';
import type { Logger } from 'pino';
import { forkWorkspace } from '../agents/fork-workspace.js';
import { git } from '../codehost/git.js';
import { FastForwardError, LocalCodeHost, RepositoryExistsError } from '../codehost/local.js';
import { ConflictError } from '../domain/errors.js';
import type { SetupResult } from '../protocol/rest.js';
import {
  CONFIG_FILE,
  EnvironmentConfig,
  environmentDir,
  parseEnvironmentConfig,
  type CheckSpec,
  type RepositorySpec,
} from '../sandbox/environment.js';
import { EnvironmentStore, type EnvironmentChange, type EnvironmentVersion, type SetupRecord } from '../sandbox/environment-versions.js';
import type { Fork, SandboxPolicy } from '../sandbox/fork.js';
import type { Db } from '../store/db.js';
import { findRepository, insertRepository, listRepositories, type RepositoryRow } from '../store/repositories.js';
import type { Workspace } from '../store/workspaces.js';
import { bringBranch, clearTransfers, commitAndBundle, TRANSFER_DIR } from './delivery.js';
import { ForkLifecycle } from './fork-lifecycle.js';

/** The environment's own repository: its config, reviewed like code. */
export const ENVIRONMENT_REPOSITORY = 'svc/environment';
export const ENVIRONMENT_DIR = '.';
const ENVIRONMENT_BRANCH = 'main';

/**
 * Files whose change means a repository's dependencies must be installed again: the manifests and lock
 * files of the common package managers (docs/execution.md lists them).
 */
export const SETUP_INPUTS: ReadonlySet<string> = new Set([
  'package.json', 'package-lock.json', 'npm-shrinkwrap.json', 'yarn.lock', 'pnpm-lock.yaml', 'bun.lockb', '.nvmrc', '.node-version', '.tool-versions',
  'requirements.txt', 'requirements-dev.txt', 'pyproject.toml', 'poetry.lock', 'Pipfile', 'Pipfile.lock', 'uv.lock', 'setup.py', 'setup.cfg',
  'Gemfile', 'Gemfile.lock', 'go.mod', 'go.sum', 'Cargo.toml', 'Cargo.lock', 'composer.json', 'composer.lock', 'mix.exs', 'mix.lock',
  'pom.xml', 'build.gradle', 'build.gradle.kts', 'settings.gradle', 'settings.gradle.kts',
]);

export type { SetupResult };

/** How long one setup command may take (dependency installs are slow). */
const SETUP_TIMEOUT_MS = 30 * 60_000;

export interface EnvironmentsOptions {
  db: Db;
  /** Holds `environments/`, `forks/` and the code host. */
  dataDir: string;
  policy: SandboxPolicy;
  logger: Logger;
}

export class Environments {
  readonly codeHost: LocalCodeHost;
  private readonly stores = new Map<string, EnvironmentStore>();
  private readonly making = new Map<string, Promise<EnvironmentVersion>>();
  /** Workspaces whose `svc/environment` repository row is known to exist. */
  private readonly registered = new Set<string>();
  /** Per workspace: the update that runs now, and the one queued behind it (several requests share it). */
  private readonly running = new Map<string, Promise<void>>();
  private readonly queued = new Map<string, Promise<void>>();
  /**
   * Working copies that could not be brought to their branch (a failed fast-forward, or svc/environment
   * ahead with nothing to push), as `workspace dir working-copy-commit branch-commit`: not tried again
   * until either commit moves.
   */
  private readonly stuck = new Set<string>();
  /** Stops the setups under way when the process shuts down (an unpublished change is simply redone). */
  private readonly stopping = new AbortController();

  constructor(private readonly options: EnvironmentsOptions) {
    this.codeHost = new LocalCodeHost(options.dataDir);
  }

  private get db(): Db {
    return this.options.db;
  }

  store(workspaceId: string): EnvironmentStore {
    let store = this.stores.get(workspaceId);
    if (!store) {
      store = new EnvironmentStore(environmentDir(this.options.dataDir, workspaceId), this.options.policy, (message) => this.options.logger.info(message), {
        signal: this.stopping.signal,
      });
      this.stores.set(workspaceId, store);
    }
    return store;
  }

  /** The config of a version; an error names what is wrong with a broken one. */
  configOf(version: EnvironmentVersion): EnvironmentConfig {
    return parseEnvironmentConfig(version.record.config);
  }

  /** The workspace's current version, making the environment first when it has none. */
  async ensure(workspace: Workspace): Promise<EnvironmentVersion> {
    const current = this.store(workspace.id).current();
    if (current && this.registered.has(workspace.id)) return current;
    // Jobs of one workspace may start together on a new environment: in this process one makes it.
    let making = this.making.get(workspace.id);
    if (!making) {
      making = this.make(workspace).finally(() => this.making.delete(workspace.id));
      this.making.set(workspace.id, making);
    }
    return making;
  }

  /**
   * The code host's `svc/environment` is the source of the environment's root: made from a template when
   * missing, then cloned into the first version (or an environment from before versions is adopted).
   */
  private async make(workspace: Workspace): Promise<EnvironmentVersion> {
    const path = this.codeHost.repositoryPath(workspace.id, ENVIRONMENT_REPOSITORY);
    if (!existsSync(path) && !this.store(workspace.id).current()) {
      const template = await mkdtemp(join(tmpdir(), 'svc-environment-'));
      try {
        await git(['init', '--quiet', `--initial-branch=${ENVIRONMENT_BRANCH}`], { cwd: template });
        await writeFile(join(template, '.gitignore'), `# svc's transfers, and the working copies of the connected repositories\n/${TRANSFER_DIR}/\n`);
        await git(['add', '.gitignore'], { cwd: template });
        await writeConfigFile(template, EnvironmentConfig.parse({}));
        await git(['add', CONFIG_FILE], { cwd: template });
        await git(['commit', '--quiet', '-m', 'The workspace environment'], { cwd: template });
        await this.codeHost.importRepository(workspace.id, ENVIRONMENT_REPOSITORY, template);
      } catch (error) {
        // Another process made it meanwhile: every environment is cloned from that one.
        if (!(error instanceof RepositoryExistsError)) throw error;
      } finally {
        await rm(template, { recursive: true, force: true });
      }
    }
    const version = await this.store(workspace.id).init(
      'The workspace environment',
      async (dir) => {
        // Our own bare repository, into a directory nobody else sees yet: host git is safe here.
        await git(['clone', '--quiet', '--branch', ENVIRONMENT_BRANCH, '--', path, dir]);
        await git(['remote', 'remove', 'origin'], { cwd: dir });
      },
      (facts) => adoptedSetups(facts.config, facts.heads),
    );
    if (!(await findRepository(this.db, workspace.id, ENVIRONMENT_REPOSITORY))) {
      await insertRepository(this.db, { workspaceId: workspace.id, fullName: ENVIRONMENT_REPOSITORY, dir: ENVIRONMENT_DIR, defaultBranch: ENVIRONMENT_BRANCH, source: path });
    }
    this.registered.add(workspace.id);
    return version;
  }

  /** The current version of a workspace that has an environment; null when it has none yet. */
  current(workspaceId: string): EnvironmentVersion | null {
    return this.store(workspaceId).current();
  }

  /** A file of the environment's current version (null when missing), as the sandbox reads it. */
  async readFile(workspaceId: string, path: string): Promise<string | null> {
    const current = this.current(workspaceId);
    return current ? this.store(workspaceId).readFile(current, path) : null;
  }

  /** A change of the current version; the transfer dir never becomes part of a version. */
  private change<T>(workspaceId: string, reason: string, apply: (change: EnvironmentChange) => Promise<T>): Promise<{ version: EnvironmentVersion; result: T }> {
    return this.store(workspaceId).change(reason, async (change) => {
      try {
        return await apply(change);
      } finally {
        await clearTransfers(change.fork);
      }
    });
  }

  /**
   * Repositories whose working copy in `version` is behind their code-host default branch, each with its
   * `stuck` key: the working copy's commit and the branch's, so that it is tried again when either moves.
   */
  private async behind(workspaceId: string, version: EnvironmentVersion, repositories: RepositoryRow[]): Promise<Array<{ repository: RepositoryRow; stuckKey: string }>> {
    const behind: Array<{ repository: RepositoryRow; stuckKey: string }> = [];
    for (const repository of repositories) {
      const head = await this.codeHost.resolve(workspaceId, repository.fullName, `refs/heads/${repository.defaultBranch}`);
      const have = version.record.heads[repository.dir];
      if (!head || have === head) continue;
      const stuckKey = `${workspaceId} ${repository.dir} ${have ?? '-'} ${head}`;
      if (this.stuck.has(stuckKey)) continue;
      behind.push({ repository, stuckKey });
    }
    return behind;
  }

  /**
   * Fast-forwards every working copy that is behind its code-host default branch (a merge landed), as one
   * new version. Runs no setup. A working copy that cannot fast-forward is left as it is, logged, and not
   * tried again until its branch moves; so is one ahead of its branch (nothing to bring), except
   * `svc/environment`'s: its commits the code host lacks are pushed there (`pushEnvironmentRepository`).
   */
  async refresh(workspaceId: string): Promise<EnvironmentVersion | null> {
    const current = this.current(workspaceId);
    if (!current) return null;
    const repositories = await listRepositories(this.db, workspaceId);
    const pending = await this.behind(workspaceId, current, repositories);
    if (pending.length === 0) return current;
    const names = pending.map(({ repository }) => repository.fullName).join(', ');
    // The `stuck` key of svc/environment when its working copy is ahead of the code host.
    const found: { environmentAhead: string | null } = { environmentAhead: null };
    const { version } = await this.change(workspaceId, `Update ${names}`, async (change) => {
      let moved = 0;
      found.environmentAhead = null;
      for (const { repository, stuckKey } of await this.behind(workspaceId, change.base, repositories)) {
        const outcome = await this.fastForward(change.fork, repository, change.base.record.heads[repository.dir] ?? null);
        // Only a working copy whose commit changed makes the new version differ from its base.
        if (outcome === 'moved') moved += 1;
        else if (outcome === 'ahead' && repository.fullName === ENVIRONMENT_REPOSITORY) found.environmentAhead = stuckKey;
        else this.stuck.add(stuckKey);
      }
      change.discard = moved === 0;
    });
    if (found.environmentAhead !== null) await this.pushEnvironmentRepository(workspaceId, found.environmentAhead);
    return version;
  }

  /**
   * Brings one working copy of a change up to its code-host default branch: `moved` when its commit
   * changed, `ahead` when it has the branch already (a merge --ff-only onto an ancestor does nothing and
   * succeeds), `failed` when it could not.
   */
  private async fastForward(fork: Fork, repository: RepositoryRow, from: string | null): Promise<'moved' | 'ahead' | 'failed'> {
    // A working copy's commit the code host lacks (an operator's own) cannot bound the bundle.
    const base = from && (await this.codeHost.resolve(repository.workspaceId, repository.fullName, from)) ? from : null;
    try {
      const before = await headIn(fork, repository.dir);
      await bringBranch(fork, this.codeHost, {
        workspaceId: repository.workspaceId,
        fullName: repository.fullName,
        dir: repository.dir,
        branch: repository.defaultBranch,
        base,
        bundleName: `update-${repository.id}.bundle`,
        apply: 'fast-forward',
      });
      return (await headIn(fork, repository.dir)) === before ? 'ahead' : 'moved';
    } catch (error) {
      this.options.logger.warn({ err: error, repository: repository.fullName }, 'the environment working copy cannot fast-forward to its default branch; left as it is');
      return 'failed';
    }
  }

  /**
   * Pushes `svc/environment` commits of the current version that the code host lacks (forward only): a
   * change published its version, then failed to push its config commit (an interrupted connection). The
   * bundle is made in a throwaway change, of what the version has committed and nothing else. When there
   * is nothing of the version's to push, that is logged once and `stuckKey` is not tried again until the
   * version's commit or the code host's branch moves (a failed push is tried again by the next sweep).
   */
  private async pushEnvironmentRepository(workspaceId: string, stuckKey: string): Promise<void> {
    const staged: { commit: { head: string; bundle: string } | null; version: string | null } = { commit: null, version: null };
    try {
      await this.change(workspaceId, `Push ${ENVIRONMENT_REPOSITORY}`, async (change) => {
        change.discard = true;
        staged.version = change.base.record.heads[ENVIRONMENT_DIR] ?? null;
        // Whatever else lies in the environment's root (setup leftovers) stays out of the commit bundled.
        const cleaned = await change.fork.run(['sh', '-c', 'git reset --quiet --hard && git clean -fdq'], { timeoutMs: 120_000 });
        if (cleaned.exitCode !== 0) throw new Error(`cleaning the ${ENVIRONMENT_REPOSITORY} working copy failed: ${cleaned.stderr.trim()}`);
        const known = await this.codeHost.knownCommits(workspaceId, ENVIRONMENT_REPOSITORY, [ENVIRONMENT_BRANCH]);
        staged.commit = await commitAndBundle(change.fork, { dir: ENVIRONMENT_DIR, known, message: 'unused: nothing is left to commit', bundleName: 'environment.bundle' });
      });
      // Only the commit the version has checked out (what its record says) goes to the code host.
      const { commit } = staged;
      if (!commit || commit.head !== staged.version) {
        this.stuck.add(stuckKey);
        this.options.logger.warn(
          { workspaceId, version: staged.version, workingCopy: commit?.head ?? null },
          `the environment's ${ENVIRONMENT_REPOSITORY} working copy is ahead of the code host, but has no commit of its version to push (the code host knows it already, or the working copy is not the version's commit); left as it is until either moves`,
        );
        return;
      }
      await this.codeHost.receiveBranch(workspaceId, ENVIRONMENT_REPOSITORY, commit.bundle, ENVIRONMENT_BRANCH, commit.head, { fastForwardOnly: true });
      this.options.logger.info({ workspaceId, head: commit.head }, `the environment's ${ENVIRONMENT_REPOSITORY} commits reached the code host`);
    } catch (error) {
      this.options.logger.warn({ err: error, workspaceId }, `pushing the environment's ${ENVIRONMENT_REPOSITORY} commits to the code host failed; the next sweep tries again`);
    } finally {
      if (staged.commit) await rm(dirname(staged.commit.bundle), { recursive: true, force: true });
    }
  }

  /**
   * Repository directories whose setup is due in `version`: its setup commands changed since they last
   * ran, a merge changed one of its SETUP_INPUTS since then, or its last setup failed and something changed
   * since. A repository whose setup never ran (connected with --no-setup) is left to the operator.
   */
  async pendingSetups(workspaceId: string, version: EnvironmentVersion): Promise<string[]> {
    let config: EnvironmentConfig;
    try {
      config = this.configOf(version);
    } catch {
      return [];
    }
    const repositories = await listRepositories(this.db, workspaceId);
    const due: string[] = [];
    for (const spec of config.repositories) {
      const last = version.record.setups[spec.dir];
      if (!last || spec.setup.length === 0) continue;
      const head = version.record.heads[spec.dir] ?? null;
      const commandsChanged = JSON.stringify(last.commands) !== JSON.stringify(spec.setup);
      if (commandsChanged || (!last.passed && last.head !== head)) {
        due.push(spec.dir);
        continue;
      }
      if (!head || !last.head || last.head === head) continue;
      const repository = repositories.find((candidate) => candidate.dir === spec.dir);
      if (!repository) continue;
      const changed = await this.codeHost.changedPaths(workspaceId, repository.fullName, last.head, head).catch(() => null);
      // Commits the code host cannot compare: install again rather than run on stale dependencies.
      if (changed === null || changed.some((path) => SETUP_INPUTS.has(basename(path)))) due.push(spec.dir);
    }
    return due;
  }

  /**
   * Runs the setup commands of the repositories in `dirs` (default: every repository that has some) in a
   * change of the environment, with network (installing dependencies needs it), stopping at a repository's
   * first failure. The result is a new version either way: a failed setup is recorded, not hidden.
   *
   * `onlyDue` runs only the setups still due in the version the change is made from: a setup found due
   * earlier may have been run meanwhile by another update (in this process or another), whose version
   * this change is then applied on again, and installing twice is waste.
   */
  async setup(workspaceId: string, dirs?: readonly string[], options: { onlyDue?: boolean } = {}): Promise<{ version: EnvironmentVersion; results: SetupResult[] }> {
    const names = dirs ? dirs.join(', ') : 'every repository';
    const { version, result } = await this.change(workspaceId, `Setup ${names}`, async (change) => {
      const due = options.onlyDue ? await this.pendingSetups(workspaceId, change.base) : null;
      const specs = this.configOf(change.base).repositories.filter(
        (spec) => spec.setup.length > 0 && (!dirs || dirs.includes(spec.dir)) && (!due || due.includes(spec.dir)),
      );
      if (specs.length === 0) change.discard = true;
      return runSetups(change, specs, this.stopping.signal);
    });
    return { version, results: result };
  }

  /**
   * After a merge on the code host: the environment catches up now (a fast-forward), and the setups this
   * makes due run in the background (`update`), so that the merge is not held up by an install.
   */
  async afterMerge(workspaceId: string): Promise<void> {
    await this.refresh(workspaceId);
    void this.update(workspaceId).catch((error: unknown) => this.options.logger.warn({ err: error, workspaceId }, 'updating the environment after a merge failed'));
  }

  /** Refresh, then the setups that are due; one update at a time per workspace in this process. */
  update(workspaceId: string): Promise<void> {
    const queued = this.queued.get(workspaceId);
    if (queued) return queued;
    const previous = this.running.get(workspaceId) ?? Promise.resolve();
    const next: Promise<void> = previous
      .catch(() => undefined)
      .then(async () => {
        this.queued.delete(workspaceId);
        this.running.set(workspaceId, next);
        const refreshed = await this.refresh(workspaceId);
        if (!refreshed) return;
        const due = await this.pendingSetups(workspaceId, refreshed);
        if (due.length === 0) return;
        const { results } = await this.setup(workspaceId, due, { onlyDue: true });
        const failed = results.filter((result) => !result.passed);
        const log = failed.length ? 'warn' : 'info';
        this.options.logger[log]({ workspaceId, results: results.map(({ repository, command, passed }) => ({ repository, command, passed })) }, 'environment setup ran after a change');
      })
      .finally(() => {
        if (this.running.get(workspaceId) === next) this.running.delete(workspaceId);
      });
    this.queued.set(workspaceId, next);
    return next;
  }

  /** Waits for the updates this process runs in the background (tests). */
  async idle(): Promise<void> {
    while (this.running.size > 0 || this.queued.size > 0) {
      await Promise.allSettled([...this.running.values(), ...this.queued.values()]);
    }
  }

  /**
   * Shutdown, first step: stops the setups under way at once (their changes are not published; the next
   * sweep redoes them) and the sweep before its next workspace, so that what waits for them does not hang.
   */
  abort(): void {
    this.stopping.abort();
  }

  /** Shutdown: aborts (see `abort`) and waits for the updates under way to end. */
  async close(): Promise<void> {
    this.abort();
    await this.idle();
  }

  /**
   * Scheduler work: every environment of this data dir catches up with its code host (an update a crash
   * interrupted), then versions no fork uses any more are deleted.
   */
  async sweep(): Promise<{ updated: number; versions: number; layers: number }> {
    const root = join(this.options.dataDir, 'environments');
    const result = { updated: 0, versions: 0, layers: 0 };
    if (!existsSync(root)) return result;
    for (const workspaceId of readdirSync(root)) {
      if (this.stopping.signal.aborted) break;
      const before = this.current(workspaceId);
      if (!before) continue;
      try {
        await this.update(workspaceId);
        if (this.current(workspaceId)?.version !== before.version) result.updated += 1;
        const store = this.store(workspaceId);
        const collected = await store.collect(ForkLifecycle.versionsInUse(join(this.options.dataDir, 'forks'), workspaceId, store));
        result.versions += collected.versions;
        result.layers += collected.layers;
      } catch (error) {
        this.options.logger.warn({ err: error, workspaceId }, 'the environment sweep failed for this workspace');
      }
    }
    return result;
  }

  /**
   * Connects a repository the code host has now (`defaultBranch` of `fullName`): its working copy goes into
   * the environment, its entry into the config (with the checks and setup its package.json offers), the
   * config change into `svc/environment`, and its setup runs when asked. Repeatable: a change applied
   * again on a newer version finds its own earlier steps done.
   */
  async connect(
    workspace: Workspace,
    input: { fullName: string; defaultBranch: string; setup: boolean },
  ): Promise<{ version: EnvironmentVersion; spec: RepositorySpec; setup: SetupResult[] }> {
    await this.ensure(workspace);
    const { version, result } = await this.changeCommitting(workspace.id, `Connect ${input.fullName}`, async (change, commit) => {
      const files = forkWorkspace(change.fork, { network: false });
      await this.catchUpEnvironmentRepository(workspace.id, change);
      const config = parseEnvironmentConfig(await readInFork(change.fork, CONFIG_FILE));
      const dir = config.repositories.find((entry) => entry.name === input.fullName)?.dir ?? (await freeDirectory(change.fork, input.fullName, config));
      if ((await change.fork.run(['test', '-e', dir], { readOnly: true })).exitCode !== 0) {
        await bringBranch(change.fork, this.codeHost, {
          workspaceId: workspace.id,
          fullName: input.fullName,
          dir,
          branch: input.defaultBranch,
          base: null,
          bundleName: 'connect.bundle',
          apply: 'clone',
        });
      }
      const lockFile = (await change.fork.run(['test', '-f', `${dir}/package-lock.json`], { readOnly: true })).exitCode === 0;
      const spec: RepositorySpec = { name: input.fullName, dir, ...detectChecks(await readInFork(change.fork, `${dir}/package.json`), lockFile), devServers: [] };
      const existing = config.repositories.find((entry) => entry.dir === dir);
      const repositories = existing ? config.repositories : [...config.repositories, spec];
      await files.writeFile(CONFIG_FILE, configText({ ...config, repositories }));
      const ignore = (await readInFork(change.fork, '.gitignore')) ?? '';
      if (!ignore.split('\n').includes(`/${dir}/`)) await files.writeFile('.gitignore', `${ignore.trimEnd()}\n/${dir}/\n`);
      await commit(`Connect ${input.fullName}`);
      const chosen = existing ?? spec;
      return { spec: chosen, setup: input.setup ? await runSetups(change, [chosen], this.stopping.signal) : [] };
    });
    return { version, ...result };
  }

  /** Replaces the config (an operator's edit): committed to `svc/environment`, then the setups it makes due run. */
  async setConfig(workspace: Workspace, text: string): Promise<{ version: EnvironmentVersion; setup: SetupResult[] }> {
    const config = parseEnvironmentConfig(text);
    await this.ensure(workspace);
    const { version } = await this.changeCommitting(workspace.id, 'Edit the environment config', async (change, commit) => {
      await this.catchUpEnvironmentRepository(workspace.id, change);
      await forkWorkspace(change.fork, { network: false }).writeFile(CONFIG_FILE, configText(config));
      if (!(await commit('Edit the environment config'))) change.discard = true;
    });
    const due = await this.pendingSetups(workspace.id, version);
    if (due.length === 0) return { version, setup: [] };
    const ran = await this.setup(workspace.id, due, { onlyDue: true });
    return { version: ran.version, setup: ran.results };
  }

  /** The change's `svc/environment` working copy, fast-forwarded to the code host's (a merged dev_env change). */
  private async catchUpEnvironmentRepository(workspaceId: string, change: EnvironmentChange): Promise<void> {
    const repository = await findRepository(this.db, workspaceId, ENVIRONMENT_REPOSITORY);
    const head = await this.codeHost.resolve(workspaceId, ENVIRONMENT_REPOSITORY, `refs/heads/${ENVIRONMENT_BRANCH}`);
    const from = change.base.record.heads[ENVIRONMENT_DIR] ?? null;
    if (repository && head && head !== from && (await this.fastForward(change.fork, repository, from)) === 'failed') {
      throw new ConflictError(`the environment's ${ENVIRONMENT_REPOSITORY} working copy cannot catch up with the code host`);
    }
  }

  /**
   * A change that commits to `svc/environment`: `commit` (handed to `apply`) commits what changed in the
   * change's working copy, inside the sandbox, and answers false when nothing did. The commit reaches the
   * code host only once the change's version is published; a change that fails, is discarded, or is
   * applied again on a newer version (whose `apply` commits afresh) drops it, so the code host never holds
   * a config that no version of the environment has.
   */
  private async changeCommitting<T>(
    workspaceId: string,
    reason: string,
    apply: (change: EnvironmentChange, commit: (message: string) => Promise<boolean>) => Promise<T>,
  ): Promise<{ version: EnvironmentVersion; result: T }> {
    const staged: { commit: { head: string; bundle: string } | null } = { commit: null };
    const drop = async () => {
      // The bundle sits alone in a private temporary directory (commitAndBundle's copy out of the fork).
      if (staged.commit) await rm(dirname(staged.commit.bundle), { recursive: true, force: true });
      staged.commit = null;
    };
    try {
      const outcome = await this.change(workspaceId, reason, async (change) => {
        await drop();
        const result = await apply(change, async (message) => {
          await drop();
          const known = await this.codeHost.knownCommits(workspaceId, ENVIRONMENT_REPOSITORY, [ENVIRONMENT_BRANCH]);
          staged.commit = await commitAndBundle(change.fork, { dir: ENVIRONMENT_DIR, known, message, bundleName: 'environment.bundle' });
          return staged.commit !== null;
        });
        if (change.discard) await drop();
        return result;
      });
      if (staged.commit) {
        // Forward only: a merge into svc/environment since this change caught up is never overwritten.
        const { head, bundle } = staged.commit;
        try {
          await this.codeHost.receiveBranch(workspaceId, ENVIRONMENT_REPOSITORY, bundle, ENVIRONMENT_BRANCH, head, { fastForwardOnly: true });
        } catch (error) {
          if (!(error instanceof FastForwardError)) throw error;
          throw new ConflictError(
            `${ENVIRONMENT_REPOSITORY} on the code host moved while "${reason}" was applied: environment version ${outcome.version.version} has the change, the code host does not; merge the two by hand`,
          );
        }
      }
      return outcome;
    } finally {
      await drop();
    }
  }
}

/** Setups of an environment from before versions: whatever its config lists counts as having run. */
function adoptedSetups(config: string | null, heads: Record<string, string>): Record<string, SetupRecord> {
  let parsed: EnvironmentConfig;
  try {
    parsed = parseEnvironmentConfig(config);
  } catch {
    return {};
  }
  const now = new Date().toISOString();
  return Object.fromEntries(
    parsed.repositories.filter((spec) => spec.setup.length > 0).map((spec) => [spec.dir, { head: heads[spec.dir] ?? null, commands: spec.setup, passed: true, ranAt: now }]),
  );
}

/** Runs each repository's setup commands in the change's fork and records how they went. */
async function runSetups(change: EnvironmentChange, specs: readonly RepositorySpec[], signal: AbortSignal): Promise<SetupResult[]> {
  const results: SetupResult[] = [];
  for (const spec of specs) {
    let passed = true;
    for (const command of spec.setup) {
      const result = await change.fork.run(['sh', '-c', `exec 2>&1\n${command}`], { cwd: spec.dir, network: true, timeoutMs: SETUP_TIMEOUT_MS, signal });
      signal.throwIfAborted();
      passed = result.exitCode === 0 && !result.timedOut;
      results.push({ repository: spec.name, command, passed, exitCode: result.exitCode, outputTail: result.stdout.trimEnd().split('\n').slice(-20).join('\n') });
      if (!passed) break;
    }
    // The commit it ran on is the working copy's in this change: a repository connected in the same
    // change has no head in the base yet, and one that lacked it would never be found due again.
    change.setups[spec.dir] = { head: await headIn(change.fork, spec.dir), commands: spec.setup, passed, ranAt: new Date().toISOString() };
  }
  return results;
}

/** The checked-out commit of a repository of the fork, read inside the sandbox; null when there is none. */
async function headIn(fork: Fork, dir: string): Promise<string | null> {
  const result = await fork.run(['git', '-C', dir, 'rev-parse', '-q', '--verify', 'HEAD'], { readOnly: true, timeoutMs: 60_000 });
  const head = result.stdout.trim();
  return result.exitCode === 0 && /^[0-9a-f]{40}$/.test(head) ? head : null;
}

/** A file of the fork read inside the sandbox, or null when it is not a regular file. */
async function readInFork(fork: Fork, path: string): Promise<string | null> {
  const result = await fork.run(['sh', '-c', '[ -f "$1" ] && [ ! -L "$1" ] || exit 3; exec cat -- "$1"', 'sh', path], { readOnly: true, timeoutMs: 60_000 });
  if (result.exitCode === 3) return null;
  if (result.exitCode !== 0) throw new Error(`reading ${path} in the environment failed: ${result.stderr.trim()}`);
  return result.stdout;
}

/** A directory for `owner/repo` that neither the config nor the environment uses: `repo`, else `owner-repo`. */
async function freeDirectory(fork: Fork, fullName: string, config: EnvironmentConfig): Promise<string> {
  const [owner, repo] = fullName.split('/') as [string, string];
  for (const candidate of [repo, `${owner}-${repo}`]) {
    if (config.repositories.some((entry) => entry.dir === candidate)) continue;
    if ((await fork.run(['test', '-e', candidate], { readOnly: true })).exitCode === 0) continue;
    return candidate;
  }
  throw new ConflictError(`the environment already has directories named ${repo} and ${owner}-${repo}`);
}

/** Checks a repository offers, read from its package.json scripts (the operator edits them later). */
export function detectChecks(manifest: string | null, hasLockFile: boolean): { setup: string[]; checks: CheckSpec[] } {
  if (manifest === null) return { setup: [], checks: [] };
  let manifestJson: { scripts?: Record<string, unknown>; dependencies?: object; devDependencies?: object };
  try {
    manifestJson = JSON.parse(manifest) as typeof manifestJson;
  } catch {
    return { setup: [], checks: [] };
  }
  if (typeof manifestJson !== 'object' || manifestJson === null) return { setup: [], checks: [] };
  const scripts = manifestJson.scripts ?? {};
  const checks = ['lint', 'typecheck', 'test', 'build']
    .filter((name) => typeof scripts[name] === 'string')
    .map((name) => ({ name, command: name === 'test' ? 'npm test' : `npm run ${name}`, timeoutSeconds: 600 }));
  // Dependencies go in as the lock file says; without one, installing must not write one into the
  // working copy (every fork would then show it as a change).
  const hasDependencies = Object.keys({ ...(manifestJson.dependencies ?? {}), ...(manifestJson.devDependencies ?? {}) }).length > 0;
  const setup = hasLockFile ? ['npm ci'] : hasDependencies ? ['npm install --no-package-lock'] : [];
  return { setup, checks };
}

const configText = (config: EnvironmentConfig): string => `${JSON.stringify(config, null, 2)}\n`;

async function writeConfigFile(dir: string, config: EnvironmentConfig): Promise<void> {
  await mkdir(join(dir, '.svc'), { recursive: true });
  await writeFile(join(dir, CONFIG_FILE), configText(config));
}
