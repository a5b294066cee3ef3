/**
 * Immutable versions of a workspace environment.
 *
 * A fork's lower layer must never change while the fork exists: overlayfs does not allow it, and a job
 * would see other work land under it half-way. So the environment is never changed in place. Each
 * version is a stack of read-only layers (bottom first); a change is made in a writable fork of the
 * current version, and when it succeeds the fork's own files become a new layer on top and a new version
 * is published. Forks keep the version they were made from (ForkManager records it beside them), and a
 * version is deleted only when no fork and no recent reader can still use it.
 *
 * ```
 * environments/<workspace id>/
 *   layers/<id>/         the layers: an overlay fork's upper dir, or (without overlay) a whole copy
 *   versions/<n>.json    version n: its layers and what is known about it (VersionRecord)
 *   changes/<id>/        writable forks of changes under way
 * ```
 *
 * Publishing is optimistic and needs no lock across processes or hosts: version n+1 is created with an
 * exclusive link, so of two changes made from version n only one publishes; the other is made again
 * from the new current version. Without overlay mounts every version is one whole copy (slower, made
 * only on a change), so the forks of that host (copies themselves) work as before.
 *
 * Stacks stay shallow: past MAX_LAYERS a change flattens the stack into one copied layer.
 */
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { link, mkdir, readdir, rename, rm, stat, unlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { directSandbox, Fork, ForkManager, lowerdirOption, runProcessGroup, sandboxCapabilities, type EnvironmentSnapshot, type RunResult, type SandboxPolicy } from './fork.js';

/** What a version holds and what is known about it. Paths of layers are stored relative to `layers/`. */
export interface VersionRecord {
  version: number;
  /** Layer ids, bottom first. */
  layers: string[];
  createdAt: string;
  /** Why it was made: `Connect acme/web`, `Merge acme/web#3`, `Setup acme/web`… */
  reason: string;
  /** `.svc/environment.json` as this version has it (null: none), read once when it was made. */
  config: string | null;
  /** The checked-out commit of each git repository at the environment's top level (and `.` for the root). */
  heads: Record<string, string>;
  /** Per repository directory: its last setup run, carried from version to version. */
  setups: Record<string, SetupRecord>;
}

/** A repository's setup as it last ran: on which commit, which commands, and whether they all passed. */
export interface SetupRecord {
  head: string | null;
  commands: string[];
  passed: boolean;
  ranAt: string;
}

/** A version as forks take it: absolute layer paths. */
export interface EnvironmentVersion extends EnvironmentSnapshot {
  record: VersionRecord;
}

/** A change under way: a writable fork of `base`, and the facts to carry into the new version. */
export interface EnvironmentChange {
  readonly base: EnvironmentVersion;
  readonly fork: Fork;
  setups: Record<string, SetupRecord>;
  /** Set by the change when it found nothing to do: no version is published. */
  discard: boolean;
}

export class EnvironmentConflictError extends Error {
  constructor(reason: string) {
    super(`the environment kept changing while "${reason}" was being applied; try again`);
    this.name = 'EnvironmentConflictError';
  }
}

/** Deeper stacks are flattened: every lookup of a file missing from the top walks the whole stack. */
export const MAX_LAYERS = 16;
/** A version superseded less than this long ago is kept: a job may have just picked it. */
const SUPERSEDED_GRACE_MS = 10 * 60_000;
/** A change fork older than this was abandoned by a process that died (setups are bounded far below). */
const ABANDONED_CHANGE_MS = 6 * 60 * 60_000;
const ATTEMPTS = 5;
const CONFIG_PATH = '.svc/environment.json';

const newId = (): string => `${Date.now().toString(36)}${randomBytes(4).toString('hex')}`;

export class EnvironmentStore {
  private readonly changes: ForkManager;
  private readonly overlay: boolean;

  constructor(
    /** `environments/<workspace id>`. */
    readonly root: string,
    private readonly policy: SandboxPolicy,
    private readonly log: (message: string) => void = () => undefined,
    /** Whether changes are overlay layers (default: where overlay mounts work) or whole copies. */
    options: { overlay?: boolean } = {},
  ) {
    this.changes = new ForkManager(join(root, 'changes'), policy, log);
    this.overlay = options.overlay ?? sandboxCapabilities().overlay;
  }

  private get layersDir(): string {
    return join(this.root, 'layers');
  }

  private get versionsDir(): string {
    return join(this.root, 'versions');
  }

  private versionPath(version: number): string {
    return join(this.versionsDir, `${version}.json`);
  }

  /** The numbers of the published versions, ascending. */
  private versionNumbers(): number[] {
    if (!existsSync(this.versionsDir)) return [];
    return readdirSync(this.versionsDir)
      .map((entry) => /^(\d+)\.json$/.exec(entry)?.[1])
      .filter((value): value is string => value !== undefined)
      .map(Number)
      .sort((a, b) => a - b);
  }

  /** The newest version, or null before the environment was made. */
  current(): EnvironmentVersion | null {
    const numbers = this.versionNumbers();
    for (let index = numbers.length - 1; index >= 0; index--) {
      const version = this.read(numbers[index]!);
      if (version) return version;
    }
    return null;
  }

  /** Version `n`, or null when it is not there (collected, or never made). */
  read(version: number): EnvironmentVersion | null {
    let record: VersionRecord;
    try {
      record = JSON.parse(readFileSync(this.versionPath(version), 'utf8')) as VersionRecord;
    } catch {
      return null;
    }
    return { version: record.version, layers: record.layers.map((layer) => join(this.layersDir, layer)), record };
  }

  /**
   * Makes the first version from a directory `build` fills on the host (before anyone can see it), unless
   * there is one already. An environment from before versions (its files right in `root`) becomes version 1
   * as it is.
   */
  async init(
    reason: string,
    build: (dir: string) => Promise<void>,
    adopted: (facts: Pick<VersionRecord, 'config' | 'heads'>) => Record<string, SetupRecord> = () => ({}),
  ): Promise<EnvironmentVersion> {
    const existing = this.current();
    if (existing) return existing;
    await mkdir(this.layersDir, { recursive: true });
    await mkdir(this.versionsDir, { recursive: true });
    const legacy = await this.legacyEntries();
    const id = legacy.length > 0 ? await this.adoptLegacy(legacy) : newId();
    const dir = join(this.layersDir, id);
    if (legacy.length === 0) {
      await mkdir(dir);
      await build(dir);
    }
    const record: VersionRecord = {
      version: 1,
      layers: [id],
      createdAt: new Date().toISOString(),
      reason: legacy.length > 0 ? 'The environment as it was before versions' : reason,
      config: null,
      heads: {},
      setups: {},
    };
    const version: EnvironmentVersion = { version: 1, layers: [dir], record };
    const facts = await this.inspect(version);
    // An environment set up before versions existed says through `adopted` which setups it counts as run.
    const published = await this.publish({ ...record, ...facts, setups: legacy.length > 0 ? adopted(facts) : {} });
    if (published) return published;
    await rm(dir, { recursive: true, force: true });
    return this.current()!;
  }

  /** Entries of an environment from before versions: everything in `root` but the store's own. */
  private async legacyEntries(): Promise<string[]> {
    if (!existsSync(this.root)) return [];
    return (await readdir(this.root)).filter((entry) => !['layers', 'versions', 'changes'].includes(entry));
  }

  /** Moves a pre-version environment into a layer of its own (resumable: a crash leaves the rest to move). */
  private async adoptLegacy(entries: string[]): Promise<string> {
    const started = (await readdir(this.layersDir)).filter((entry) => entry.startsWith('legacy-'));
    const id = started[0] ?? `legacy-${newId()}`;
    await mkdir(join(this.layersDir, id), { recursive: true });
    for (const entry of entries) await rename(join(this.root, entry), join(this.layersDir, id, entry));
    this.log(`environment ${this.root}: moved into layer ${id} (version 1)`);
    return id;
  }

  /**
   * Applies a change: `apply` works in a writable fork of the current version; when it resolves, the
   * fork's files become the next version. When another change published first, `apply` runs again on the
   * newer version (it must be safe to repeat). When it throws, nothing is published.
   */
  async change<T>(reason: string, apply: (change: EnvironmentChange) => Promise<T>): Promise<{ version: EnvironmentVersion; result: T }> {
    for (let attempt = 1; attempt <= ATTEMPTS; attempt++) {
      const base = this.current();
      if (!base) throw new Error(`environment ${this.root} has no version yet`);
      const id = newId();
      // Without overlay mounts, a change is made in a whole copy (not shared clones: it becomes a layer).
      const fork = await this.changes.create(id, base, this.overlay ? { mode: 'overlay' } : { mode: 'clone', fullCopy: true });
      try {
        const change: EnvironmentChange = { base, fork, setups: structuredClone(base.record.setups), discard: false };
        const result = await apply(change);
        if (change.discard) return { version: base, result };
        const facts = await this.inspect(fork);
        const layer = newId();
        await rename(fork.changesDir, join(this.layersDir, layer));
        const layers = fork.info.mode === 'overlay' ? [...base.record.layers, layer] : [layer];
        const record: VersionRecord = {
          version: base.version + 1,
          layers,
          createdAt: new Date().toISOString(),
          reason,
          ...facts,
          setups: change.setups,
        };
        const published = await this.publish(record);
        if (!published) {
          await rm(join(this.layersDir, layer), { recursive: true, force: true });
          this.log(`environment ${this.root}: version ${record.version} was published by another change first; applying "${reason}" again`);
          continue;
        }
        return { version: layers.length > MAX_LAYERS ? await this.flatten(published) : published, result };
      } finally {
        await this.changes.removeAll(id);
      }
    }
    throw new EnvironmentConflictError(reason);
  }

  /** Creates the version file exclusively: null when that version exists already. */
  private async publish(record: VersionRecord): Promise<EnvironmentVersion | null> {
    const temporary = join(this.versionsDir, `.${record.version}.${newId()}.tmp`);
    await writeFile(temporary, `${JSON.stringify(record, null, 2)}\n`);
    try {
      await link(temporary, this.versionPath(record.version));
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'EEXIST') return null;
      throw error;
    } finally {
      await unlink(temporary).catch(() => undefined);
    }
    return this.read(record.version);
  }

  /**
   * The config and the checked-out commit of each repository, read inside the sandbox: the environment's
   * files are the agent's and the setup scripts' to shape, so the host never follows its links.
   */
  private async inspect(target: EnvironmentVersion | Fork): Promise<Pick<VersionRecord, 'config' | 'heads'>> {
    const script = [
      `if [ -f ${CONFIG_PATH} ] && [ ! -L ${CONFIG_PATH} ]; then printf 'config\\n'; base64 -w0 ${CONFIG_PATH}; printf '\\n'; fi`,
      'for d in . *; do',
      '  [ -d "$d/.git" ] || continue',
      '  h=$(git -C "$d" rev-parse -q --verify HEAD 2>/dev/null) && printf "head\\t%s\\t%s\\n" "$d" "$h"',
      'done',
    ].join('\n');
    const result = await this.withFork(target, (fork) => fork.run(['sh', '-c', script], { readOnly: true, timeoutMs: 60_000 }));
    if (result.exitCode !== 0) throw new Error(`reading the environment failed: ${(result.stderr || result.stdout).trim()}`);
    const lines = result.stdout.split('\n');
    const configAt = lines.indexOf('config');
    const config = configAt >= 0 ? Buffer.from(lines[configAt + 1] ?? '', 'base64').toString('utf8') : null;
    const heads: Record<string, string> = {};
    for (const line of lines) {
      const [kind, dir, head] = line.split('\t');
      if (kind === 'head' && dir && head && /^[0-9a-f]{40}$/.test(head)) heads[dir] = head;
    }
    return { config, heads };
  }

  /**
   * Runs `use` in `target` (a fork) or in a read-only sandbox over it (a version): the layer itself when
   * there is one, a throwaway overlay fork when there are several.
   */
  private async withFork<T>(target: EnvironmentVersion | Fork, use: (fork: Fork) => Promise<T>): Promise<T> {
    if (target instanceof Fork) return use(target);
    if (target.layers.length === 1) return use(directSandbox(target.layers[0]!, this.policy));
    const id = `read-${newId()}`;
    const fork = await this.changes.create(id, target);
    try {
      return await use(fork);
    } finally {
      await this.changes.removeAll(id);
    }
  }

  /** Runs a command in a read-only sandbox over a version (operators, tests): it sees the version whole. */
  run(version: EnvironmentVersion, argv: readonly string[], options: { cwd?: string } = {}): Promise<RunResult> {
    return this.withFork(version, (fork) => fork.run(argv, { readOnly: true, timeoutMs: 60_000, ...options }));
  }

  /** A file of a version as the sandbox reads it (null when it is missing), for operators and tests. */
  async readFile(version: EnvironmentVersion, path: string): Promise<string | null> {
    const result = await this.run(version, ['sh', '-c', '[ -f "$1" ] || exit 3; exec cat -- "$1"', 'sh', path]);
    if (result.exitCode === 3) return null;
    if (result.exitCode !== 0) throw new Error(`reading ${path} failed: ${result.stderr.trim()}`);
    return result.stdout;
  }

  /** Publishes a version of one layer holding everything `version` shows: a copy of its merged view. */
  private async flatten(version: EnvironmentVersion): Promise<EnvironmentVersion> {
    const id = newId();
    const target = join(this.layersDir, id);
    const mount = join(this.changes.dirOf(`flatten-${id}`));
    await mkdir(target);
    await mkdir(mount, { recursive: true });
    try {
      // A read-only overlay of the lower layers alone (no upper) shows the version; cp -a keeps everything.
      const result = await runProcessGroup(
        ['unshare', '-m', '--propagation', 'private', 'sh', '-c', 'mount -t overlay overlay -o "lowerdir=$1" "$2" && cp -a "$2/." "$3/"', 'sh', lowerdirOption(version), mount, target],
        { timeoutMs: 60 * 60_000 },
      );
      if (result.exitCode !== 0) throw new Error(`flattening version ${version.version} failed: ${result.stderr.trim()}`);
      const published = await this.publish({ ...version.record, version: version.version + 1, layers: [id], createdAt: new Date().toISOString(), reason: `Flatten version ${version.version}` });
      if (!published) {
        await rm(target, { recursive: true, force: true });
        return this.current()!;
      }
      this.log(`environment ${this.root}: version ${version.version} flattened into version ${published.version}`);
      return published;
    } finally {
      await rm(mount, { recursive: true, force: true });
    }
  }

  /**
   * Deletes versions no fork uses (`inUse`: the versions recorded beside every fork of the workspace, on
   * any host) and that were superseded more than a grace period ago, then the layers no version left
   * refers to, and changes abandoned by a process that died.
   */
  async collect(inUse: ReadonlySet<number>, now: number = Date.now()): Promise<{ versions: number; layers: number }> {
    const numbers = this.versionNumbers();
    const current = numbers.at(-1);
    let versions = 0;
    const kept = new Set<string>();
    for (const [index, number] of numbers.entries()) {
      const version = this.read(number);
      const next = numbers[index + 1] === undefined ? null : this.read(numbers[index + 1]!);
      const recent = next !== null && now - Date.parse(next.record.createdAt) < SUPERSEDED_GRACE_MS;
      if (!version || number === current || inUse.has(number) || recent) {
        for (const layer of version?.record.layers ?? []) kept.add(layer);
        continue;
      }
      await rm(this.versionPath(number), { force: true });
      versions += 1;
    }
    let layers = 0;
    if (existsSync(this.layersDir) && current !== undefined) {
      for (const entry of await readdir(this.layersDir)) {
        if (kept.has(entry)) continue;
        // A layer younger than the grace may belong to a change about to publish.
        if (now - (await stat(join(this.layersDir, entry))).mtimeMs < SUPERSEDED_GRACE_MS) continue;
        await rm(join(this.layersDir, entry), { recursive: true, force: true });
        layers += 1;
      }
    }
    const changes = join(this.root, 'changes');
    if (existsSync(changes)) {
      for (const entry of await readdir(changes)) {
        if (now - (await stat(join(changes, entry))).mtimeMs > ABANDONED_CHANGE_MS) await rm(join(changes, entry), { recursive: true, force: true });
      }
    }
    return { versions, layers };
  }
}
