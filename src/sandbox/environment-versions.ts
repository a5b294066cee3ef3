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
 * A change keeps the version it is made from (its fork's `.lower` record, like a task fork's), so that
 * collection leaves its files alone however long its setup takes; and a version is published only above
 * every version there is, so that a change made from a version collection has since deleted (its number
 * free again) is made again on the current one instead of publishing behind it.
 *
 * Collection (`collect`) deletes layers no version refers to, which includes a layer about to be
 * published. So a layer enters `layers/` only with a fresh time (touched just before it moves there,
 * whatever the times of the files it was made from), collection spares layers younger than a grace
 * period and decides on the version records as they are when it deletes, and within a process
 * collection and publishing never interleave.
 *
 * A version file is written whole and synced before it is linked into place, so a crash never leaves a
 * torn one; a torn file left by an older process (or a damaged disk) above the newest readable version is
 * set aside as `<n>.json.unreadable` (logged) and its number is never used again: the next change
 * publishes above it, since a fork may have been made from what that file was (and records its number).
 * A set-aside file is deleted once a readable version above it keeps the numbers growing.
 *
 * Stacks stay shallow: past MAX_LAYERS a change flattens the stack into one copied layer; the flattened
 * version shows the same files, so forks of the version it flattened are not behind it (`sameFiles`).
 *
 * The layers are the environment's files as setup scripts left them (run as root in the sandbox, so
 * possibly setuid): only the service's user may enter `layers/`.
 */
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { chmod, link, mkdir, open, readdir, rename, rm, stat, unlink, utimes, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import {
  directSandbox,
  Fork,
  ForkManager,
  LOWER_SUFFIX,
  lowerdirOption,
  readSnapshot,
  runProcessGroup,
  sandboxCapabilities,
  type EnvironmentSnapshot,
  type RunResult,
  type SandboxPolicy,
} from './fork.js';

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
  /** Earlier versions that show exactly the same files (a flattened version's: the version it flattened). */
  sameFilesAs?: number[];
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

/** The version an environment from before versions becomes (the first), in a layer named `legacy-…`. */
export const LEGACY_VERSION = 1;
const LEGACY_LAYER_PREFIX = 'legacy-';
/** Beside a fork made before versions: the environment's in-place version then (`legacyLower`). */
export const LEGACY_LOWER_SUFFIX = '.lower-version';
/** Deeper stacks are flattened: every lookup of a file missing from the top walks the whole stack. */
export const MAX_LAYERS = 16;
/** A version superseded less than this long ago is kept: a job may have just picked it. */
const SUPERSEDED_GRACE_MS = 10 * 60_000;
/** A change fork older than this was abandoned by a process that died (setups are bounded far below). */
const ABANDONED_CHANGE_MS = 6 * 60 * 60_000;
const ATTEMPTS = 5;
const CONFIG_PATH = '.svc/environment.json';
/** A torn version file set aside: `<n>.json.unreadable` (its number stays taken). */
const UNREADABLE_SUFFIX = '.json.unreadable';

const newId = (): string => `${Date.now().toString(36)}${randomBytes(4).toString('hex')}`;

/** Per environment root, in this process: collection and publishing take turns (see the module comment). */
const turns = new Map<string, Promise<void>>();

/** Whether a fork made from version `lower` shows the same files as `version` (that version, or a flattening of it). */
export function sameFiles(version: EnvironmentSnapshot & { record?: Pick<VersionRecord, 'sameFilesAs'> }, lower: number): boolean {
  return version.version === lower || (version.record?.sameFilesAs ?? []).includes(lower);
}

export class EnvironmentStore {
  private readonly changes: ForkManager;
  private readonly overlay: boolean;
  private readonly signal: AbortSignal | undefined;

  constructor(
    /** `environments/<workspace id>`. */
    readonly root: string,
    private readonly policy: SandboxPolicy,
    private readonly log: (message: string) => void = () => undefined,
    /**
     * `overlay`: whether changes are overlay layers (default: where overlay mounts work) or whole copies.
     * `signal`: the process shuts down; a flattening under way (a copy of the whole environment) stops.
     */
    options: { overlay?: boolean; signal?: AbortSignal } = {},
  ) {
    this.changes = new ForkManager(join(root, 'changes'), policy, log);
    this.overlay = options.overlay ?? sandboxCapabilities().overlay;
    this.signal = options.signal;
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

  /** Runs `work` while no other collection or publish of this environment runs in this process. */
  private async exclusively<T>(work: () => Promise<T>): Promise<T> {
    const key = resolve(this.root);
    const previous = turns.get(key) ?? Promise.resolve();
    const run = previous.then(work);
    const done = run.then(
      () => undefined,
      () => undefined,
    );
    turns.set(key, done);
    try {
      return await run;
    } finally {
      if (turns.get(key) === done) turns.delete(key);
    }
  }

  /**
   * Moves a finished layer (`from`, outside `layers/`) into `layers/<id>` and publishes `record` on it, in
   * turn with collection; the layer gets a fresh time first, so that a collection in another process
   * spares it until its version exists. Null when that version or a newer one exists already (the layer
   * is removed).
   */
  private async publishLayer(from: string, id: string, record: VersionRecord): Promise<EnvironmentVersion | null> {
    return this.exclusively(async () => {
      const now = new Date();
      await utimes(from, now, now);
      const layer = join(this.layersDir, id);
      await rename(from, layer);
      const published = await this.publish(record);
      if (!published) await rm(layer, { recursive: true, force: true });
      return published;
    });
  }

  /** `layers/` and `versions/`, made private (an environment from before kept them open to everyone). */
  private async makeDirs(): Promise<void> {
    await mkdir(this.layersDir, { recursive: true, mode: 0o700 });
    await chmod(this.layersDir, 0o700);
    await mkdir(this.versionsDir, { recursive: true });
  }

  /** The numbers of the published versions, ascending (`setAside`: those of the torn files set aside instead). */
  private versionNumbers(setAside = false): number[] {
    if (!existsSync(this.versionsDir)) return [];
    const pattern = setAside ? /^(\d+)\.json\.unreadable$/ : /^(\d+)\.json$/;
    return readdirSync(this.versionsDir)
      .map((entry) => pattern.exec(entry)?.[1])
      .filter((value): value is string => value !== undefined)
      .map(Number)
      .sort((a, b) => a - b);
  }

  /**
   * Version `n`'s record: null when its file is missing (collected, or never made), 'torn' when the file
   * is there but holds no record. Any other failure to read it throws.
   */
  private readRecord(version: number): VersionRecord | null | 'torn' {
    let text: string;
    try {
      text = readFileSync(this.versionPath(version), 'utf8');
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'ENOENT') return null;
      throw error;
    }
    let record: unknown;
    try {
      record = JSON.parse(text);
    } catch {
      return 'torn';
    }
    const { version: number, layers } = (record ?? {}) as Partial<VersionRecord>;
    const valid = number === version && Array.isArray(layers) && layers.every((layer) => typeof layer === 'string');
    return valid ? (record as VersionRecord) : 'torn';
  }

  /**
   * Sets aside the torn version files above the newest readable version (a crash of a process that did not
   * sync them), so that they no longer stand for versions; returns that newest readable version's number
   * (0: none). Their numbers stay taken (see the module comment).
   */
  private async setAsideTorn(): Promise<number> {
    const numbers = this.versionNumbers();
    for (let index = numbers.length - 1; index >= 0; index--) {
      const number = numbers[index]!;
      const record = this.readRecord(number);
      if (record === 'torn') {
        try {
          await rename(this.versionPath(number), join(this.versionsDir, `${number}${UNREADABLE_SUFFIX}`));
          this.log(`environment ${this.root}: version file ${number}.json is torn (a crash while it was written); set aside as ${number}${UNREADABLE_SUFFIX}, and its number is not used again`);
        } catch (error) {
          // Another process set it aside first.
          if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
        }
      } else if (record !== null) {
        return number;
      }
    }
    return 0;
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
    let record: VersionRecord | null | 'torn';
    try {
      record = this.readRecord(version);
    } catch {
      return null;
    }
    if (record === null || record === 'torn') return null;
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
    if (existing) {
      await this.makeDirs();
      return existing;
    }
    await this.makeDirs();
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
    const started = (await readdir(this.layersDir)).filter((entry) => entry.startsWith(LEGACY_LAYER_PREFIX));
    const id = started[0] ?? `${LEGACY_LAYER_PREFIX}${newId()}`;
    await mkdir(join(this.layersDir, id), { recursive: true });
    for (const entry of entries) await rename(join(this.root, entry), join(this.layersDir, id, entry));
    // A resumed move's layer may be old, and no version refers to it until version 1 is published.
    const now = new Date();
    await utimes(join(this.layersDir, id), now, now);
    this.log(`environment ${this.root}: moved into layer ${id} (version ${LEGACY_VERSION})`);
    return id;
  }

  /**
   * The version a fork made before versions existed was made from: the environment as it was moved into
   * its `legacy-*` layer (version 1), touched as in use. `marker` is what the fork recorded beside it
   * then (`.lower-version`: the environment's in-place version, kept in `<root>.version`), or null for a
   * fork older than that record; `changedAt` is when the fork's files last changed (ms; null: unknown).
   * Null when this environment was not adopted, that version is gone, the environment had changed in
   * place since the fork was made (the fork was already outdated then), or a fork without a marker is not
   * `mayBeUnmarkedLegacyFork`.
   */
  async legacyLower(fork: { marker: string | null; changedAt: number | null }): Promise<EnvironmentSnapshot | null> {
    const { marker } = fork;
    const layer = this.legacyLayer();
    if (!layer) return null;
    if (marker === null && !this.mayBeUnmarkedLegacyFork(fork.changedAt)) return null;
    if (marker !== null) {
      let adopted = '0';
      try {
        adopted = readFileSync(`${this.root}.version`, 'utf8');
      } catch {
        // Never changed in place: the in-place version was '0'.
      }
      if (marker !== adopted) return null;
    }
    const now = new Date();
    await utimes(layer.path, now, now);
    return { version: LEGACY_VERSION, layers: [layer.path] };
  }

  /** Version 1's layer when it is an environment from before versions, adopted (and still there). */
  private legacyLayer(): { path: string; adoptedAt: number } | null {
    const version = this.read(LEGACY_VERSION);
    if (version?.record.layers.length !== 1 || !version.record.layers[0]!.startsWith(LEGACY_LAYER_PREFIX)) return null;
    const path = version.layers[0]!;
    return existsSync(path) ? { path, adoptedAt: Date.parse(version.record.createdAt) } : null;
  }

  /**
   * Whether a fork with neither a record of its version nor a marker (older than the marker), whose files
   * last changed at `changedAt` (ms), may have been made from the environment as it was adopted (version
   * 1): only when its files are older than that version; a newer fork was not made from it. An unknown
   * time (null) counts as older: the fork's work is kept. Both resuming such a fork and keeping version 1
   * for it ask this.
   */
  mayBeUnmarkedLegacyFork(changedAt: number | null): boolean {
    const layer = this.legacyLayer();
    return layer !== null && (changedAt === null || changedAt < layer.adoptedAt);
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
        const layers = fork.info.mode === 'overlay' ? [...base.record.layers, layer] : [layer];
        const record: VersionRecord = {
          version: base.version + 1,
          layers,
          createdAt: new Date().toISOString(),
          reason,
          ...facts,
          setups: change.setups,
        };
        const published = await this.publishLayer(fork.changesDir, layer, record);
        if (!published) {
          this.log(`environment ${this.root}: version ${record.version} or a newer one was published by another change first; applying "${reason}" again`);
          continue;
        }
        return { version: layers.length > MAX_LAYERS ? await this.flattenPublished(published) : published, result };
      } finally {
        await this.changes.removeAll(id);
      }
    }
    throw new EnvironmentConflictError(reason);
  }

  /**
   * Creates the version file exclusively: null when that version, or a newer one, exists already. A
   * number below the newest may be free again (collection deleted that version): a change made from the
   * version before it is behind the current one all the same. Above torn version files (set aside here),
   * the version is published with the number after theirs.
   */
  private async publish(proposed: VersionRecord): Promise<EnvironmentVersion | null> {
    // Collection never deletes the newest readable version, so its number only grows: checked here, with
    // the exclusive link below, no version is ever published behind the current one.
    const newest = await this.setAsideTorn();
    if (proposed.version <= newest) return null;
    // Every number listed is taken: a torn file's (set aside, or being set aside by another process).
    const taken = [...this.versionNumbers(), ...this.versionNumbers(true)];
    const record = { ...proposed, version: Math.max(proposed.version, ...taken.map((number) => number + 1)) };
    const temporary = join(this.versionsDir, `.${record.version}.${newId()}.tmp`);
    // Synced before it is linked: after a crash the version file is whole or not there.
    const file = await open(temporary, 'wx');
    try {
      await file.writeFile(`${JSON.stringify(record, null, 2)}\n`);
      await file.sync();
    } finally {
      await file.close();
    }
    try {
      await link(temporary, this.versionPath(record.version));
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'EEXIST') return null;
      throw error;
    } finally {
      await unlink(temporary).catch(() => undefined);
    }
    await this.syncVersionsDir();
    return this.read(record.version);
  }

  /** Makes the links made in `versions/` durable (a published version stays published after a crash). */
  private async syncVersionsDir(): Promise<void> {
    const dir = await open(this.versionsDir, 'r');
    try {
      await dir.sync();
    } finally {
      await dir.close();
    }
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

  /**
   * Flattens a version just published; its change stands whatever happens here (a failed flattening is
   * logged, and the next change tries again).
   */
  private async flattenPublished(version: EnvironmentVersion): Promise<EnvironmentVersion> {
    try {
      return await this.flatten(version);
    } catch (error) {
      this.log(`environment ${this.root}: ${(error as Error).message}`);
      return version;
    }
  }

  /** Publishes a version of one layer holding everything `version` shows: a copy of its merged view. */
  private async flatten(version: EnvironmentVersion): Promise<EnvironmentVersion> {
    const id = newId();
    // Made beside the changes, then moved into `layers/`: cp -a gives the copy the old times of the
    // version's top directory, which would make it look abandoned to a collection while it is made.
    const work = this.changes.dirOf(`flatten-${id}`);
    const [mount, target] = [join(work, 'mount'), join(work, 'layer')];
    await mkdir(mount, { recursive: true, mode: 0o700 });
    await mkdir(target);
    // The version copied stays while it is copied, as a change's base does (collection reads this).
    await writeFile(`${work}${LOWER_SUFFIX}`, JSON.stringify({ version: version.version, layers: version.layers }));
    try {
      // A read-only overlay of the lower layers alone (no upper) shows the version; cp -a keeps everything.
      // A shutdown kills the copy: the version stands unflattened, and a later change flattens it.
      const result = await runProcessGroup(
        ['unshare', '-m', '--propagation', 'private', 'sh', '-c', 'mount -t overlay overlay -o "lowerdir=$1" "$2" && cp -a "$2/." "$3/"', 'sh', lowerdirOption(version), mount, target],
        { timeoutMs: 60 * 60_000, ...(this.signal ? { signal: this.signal } : {}) },
      );
      if (result.exitCode !== 0) throw new Error(`flattening version ${version.version} failed: ${result.stderr.trim() || `exit ${result.exitCode ?? result.signal}`}`);
      const published = await this.publishLayer(target, id, {
        ...version.record,
        version: version.version + 1,
        layers: [id],
        createdAt: new Date().toISOString(),
        reason: `Flatten version ${version.version}`,
        sameFilesAs: [version.version, ...(version.record.sameFilesAs ?? [])],
      });
      if (!published) return this.current()!;
      this.log(`environment ${this.root}: version ${version.version} flattened into version ${published.version}`);
      return published;
    } finally {
      await rm(work, { recursive: true, force: true });
      await rm(`${work}${LOWER_SUFFIX}`, { force: true });
    }
  }

  /** The versions the changes under way (and flattenings) are made from: recorded beside each, as forks record theirs. */
  private changeBases(): Set<number> {
    const changes = join(this.root, 'changes');
    const bases = new Set<number>();
    if (!existsSync(changes)) return bases;
    for (const entry of readdirSync(changes)) {
      if (!entry.endsWith(LOWER_SUFFIX)) continue;
      const snapshot = readSnapshot(join(changes, entry));
      if (snapshot) bases.add(snapshot.version);
    }
    return bases;
  }

  /**
   * Deletes versions no fork uses (`forksInUse`: the versions recorded beside every fork of the workspace,
   * on any host), no change under way is made from, and that were superseded more than a grace period ago,
   * then the layers no version left refers to, and changes abandoned by a process that died.
   */
  async collect(forksInUse: ReadonlySet<number>, now: number = Date.now()): Promise<{ versions: number; layers: number }> {
    const changes = join(this.root, 'changes');
    const { versions, doomed } = await this.exclusively(async () => {
      // A change's setup may run for half an hour: its base stays until it has published or failed.
      const inUse = new Set([...forksInUse, ...this.changeBases()]);
      // The newest readable version is the current one, whatever torn files lie above it (set aside).
      const newest = await this.setAsideTorn();
      const current = newest === 0 ? undefined : newest;
      // A set-aside torn file below a readable version takes no number any more: that version does.
      for (const number of this.versionNumbers(true)) {
        if (number < newest) await rm(join(this.versionsDir, `${number}${UNREADABLE_SUFFIX}`), { force: true });
      }
      const numbers = this.versionNumbers();
      let versions = 0;
      for (const [index, number] of numbers.entries()) {
        const version = this.read(number);
        const next = numbers[index + 1] === undefined ? null : this.read(numbers[index + 1]!);
        const recent = next !== null && now - Date.parse(next.record.createdAt) < SUPERSEDED_GRACE_MS;
        // The current version and any published since the torn files were set aside above stay.
        if (!version || number >= newest || inUse.has(number) || recent) continue;
        await rm(this.versionPath(number), { force: true });
        versions += 1;
      }
      const doomed: string[] = [];
      if (current === undefined || !existsSync(this.layersDir)) return { versions, doomed };
      // The records as they are now (another process may have published since they were read above).
      const kept = new Set(this.versionNumbers().flatMap((number) => this.read(number)?.record.layers ?? []));
      for (const entry of await readdir(this.layersDir)) {
        if (kept.has(entry)) continue;
        // A layer younger than the grace may belong to a change about to publish.
        if (now - (await stat(join(this.layersDir, entry))).mtimeMs < SUPERSEDED_GRACE_MS) continue;
        // Out of `layers/` at once (a rename); removed below, outside the turn. A crash leaves it among
        // the changes, as old as the layer was, to be removed as an abandoned one.
        const trash = join(changes, `collected-${newId()}`);
        await mkdir(changes, { recursive: true, mode: 0o700 });
        await rename(join(this.layersDir, entry), trash);
        doomed.push(trash);
      }
      return { versions, doomed };
    });
    for (const trash of doomed) await rm(trash, { recursive: true, force: true });
    if (existsSync(changes)) {
      for (const entry of await readdir(changes)) {
        if (now - (await stat(join(changes, entry))).mtimeMs > ABANDONED_CHANGE_MS) await rm(join(changes, entry), { recursive: true, force: true });
      }
    }
    return { versions, layers: doomed.length };
  }
}
