import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { eq, sql } from 'drizzle-orm';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ForkLifecycle, forkFilesChangedAt, type AcquireInput, type ForkLifecycleOptions, type TickResult } from '../src/engine/fork-lifecycle.js';
import { Scheduler } from '../src/engine/scheduler.js';
import { readProcessRecords, startDevServers } from '../src/sandbox/dev-servers.js';
import { DevServerSpec } from '../src/sandbox/environment.js';
import { EnvironmentStore } from '../src/sandbox/environment-versions.js';
import { ForkManager, groupRunning, sandboxCapabilities, type Fork } from '../src/sandbox/fork.js';
import type { Db } from '../src/store/db.js';
import { forks } from '../src/store/schema.js';
import { insertJob, insertTask } from '../src/store/tasks.js';
import { createWorkspace } from '../src/store/workspaces.js';
import { openTestDatabase, testDrivers, type TestDatabase } from './support/db.js';

const logger = pino({ level: process.env.SVC_TEST_LOG ?? 'silent' });
/** Each test's forks live on a host of their own, so that one test's ticks never move another's forks. */
const newHost = () => `host-${randomBytes(4).toString('hex')}`;
/** Short enough to pass while a test waits; the tests assert states and files, never times. */
const SHORT = { idleStopMs: 150, archiveMs: 150, deleteMs: 600 };
/** A lifecycle on the same forks for which nothing is due yet. */
const LONG = { idleStopMs: 3_600_000, archiveMs: 3_600_000, deleteMs: 3_600_000 };

describe.each(testDrivers)('fork lifecycle on %s', (driver) => {
  let testDb: TestDatabase;
  let db: Db;
  let workspaceId: string;
  const root = mkdtempSync(join(tmpdir(), 'svc-fork-lifecycle-'));
  const environmentDir = join(root, 'environments', 'acme');
  /**
   * One version of one layer: these tests are about the forks, not the environment's versions (not the
   * first version, which forks made before versions resume on).
   */
  const environment = { version: 3, layers: [environmentDir] };
  /** Each host has a disk of its own (as a data dir shared by hosts keeps them: `forks/<host>`). */
  const forksParent = join(root, 'forks');
  const forksRootOf = (host: string) => join(forksParent, host);

  const lifecycle = (host: string, durations: Partial<ForkLifecycleOptions['durations']> = SHORT) =>
    new ForkLifecycle({
      database: testDb.database,
      forksRoot: forksRootOf(host),
      host,
      environmentsRoot: join(root, 'environments'),
      policy: { hiddenPaths: [join(root, 'environments'), forksRootOf(host)], allowUnsandboxed: false },
      durations: { ...SHORT, ...durations },
      logger,
    });

  /** A task and a running job of it (IN_PROGRESS under a live lease). */
  const newTask = async () => {
    const task = await insertTask(
      db,
      { workspaceId, title: 'change things', status: 'IN_PROGRESS', mode: 'agent', agent: 'openai-compatible/fake', effort: 'medium' },
      () => `task-${randomBytes(4).toString('hex')}`,
    );
    return task;
  };
  const newJob = async (taskId: string) =>
    insertJob(db, { taskId, workspaceId, status: 'IN_PROGRESS', type: 'SWE', leaseExpiresAt: sql`now() + interval '1 hour'` as unknown as Date });
  const acquire = async (forksOf: ForkLifecycle, task: { id: string; slug: string }, current: AcquireInput['environment'] = environment) => {
    const job = await newJob(task.id);
    return { job, ...(await forksOf.acquire({ workspaceId, taskId: task.id, name: task.slug, jobId: job.id, environment: current })) };
  };
  const row = async (name: string) => (await db.select().from(forks).where(eq(forks.name, name)))[0]!;
  const sh = async (fork: Fork, script: string) => {
    const result = await fork.run(['sh', '-c', script], { timeoutMs: 20_000 });
    expect(result.stderr).toBe('');
    return result.stdout;
  };
  const ORDER = ['active', 'idle', 'stopped', 'archiving', 'archived', 'deleting', 'deleted'];
  /**
   * Ticks (bounded) until the fork is in `state` or past it (on a loaded machine one round of ticks may
   * carry a fork through two states); the moves made on the way, summed.
   */
  const tickUntil = async (ticking: ForkLifecycle[], name: string, state: string): Promise<TickResult> => {
    const total: TickResult = { stopped: 0, archived: 0, deleted: 0 };
    for (let attempt = 0; attempt < 200; attempt++) {
      for (const result of await Promise.all(ticking.map((one) => one.tick()))) {
        total.stopped += result.stopped;
        total.archived += result.archived;
        total.deleted += result.deleted;
      }
      const now = (await row(name)).state;
      if (now === state || ORDER.indexOf(now) > ORDER.indexOf(state)) return total;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    throw new Error(`fork ${name} did not reach ${state}: it is ${(await row(name)).state}`);
  };
  const dirOf = (host: string, name: string) => join(forksRootOf(host), workspaceId, name);

  beforeAll(async () => {
    testDb = await openTestDatabase(driver);
    db = testDb.database.db;
    const workspace = await createWorkspace(db, { name: `ws-${randomBytes(4).toString('hex')}`, plan: 'free', defaultAgent: 'openai-compatible/fake' });
    workspaceId = workspace!.id;
    mkdirSync(join(environmentDir, 'web'), { recursive: true });
    writeFileSync(join(environmentDir, 'web', 'a.txt'), 'original\n');
    writeFileSync(join(environmentDir, 'web', 'old.txt'), 'to be deleted\n');
    writeFileSync(join(environmentDir, 'web', 'server.js'), "require('http').createServer((q, s) => s.end('up')).listen(Number(process.env.PORT));\n");
  });

  afterAll(async () => {
    await testDb?.close();
  });

  it('creates a task fork, then hands the same one to the next job, and never to two running jobs', async () => {
    const host = newHost();
    const forksOf = lifecycle(host);
    const task = await newTask();
    const first = await acquire(forksOf, task);
    expect(first.fresh).toBe(true);
    expect(first.fork.info.dir).toBe(dirOf(host, task.slug));
    expect(await row(task.slug)).toMatchObject({ state: 'active', jobId: first.job.id, taskId: task.id, host });
    await sh(first.fork, 'echo changed > web/a.txt');
    // Another job of the task while the first still runs waits for it: the fork is never shared.
    const other = await newJob(task.id);
    let handedOver = false;
    const waiting = forksOf.acquire({ workspaceId, taskId: task.id, name: task.slug, jobId: other.id, environment }).then((made) => {
      handedOver = true;
      return made;
    });
    await sh(first.fork, 'echo still mine > web/b.txt');
    expect(handedOver).toBe(false);
    expect(await row(task.slug)).toMatchObject({ state: 'active', jobId: first.job.id });
    await forksOf.release(first.fork);
    const handed = await waiting;
    expect(handed.fresh).toBe(false);
    expect(await sh(handed.fork, 'cat web/b.txt')).toBe('still mine\n');
    await forksOf.release(handed.fork);
    expect(await row(task.slug)).toMatchObject({ state: 'idle', jobId: null });

    const second = await acquire(forksOf, task);
    expect(second.fresh).toBe(false);
    expect(await sh(second.fork, 'cat web/a.txt')).toBe('changed\n');
    expect(await row(task.slug)).toMatchObject({ state: 'active', jobId: second.job.id });
    // A job that no longer runs (its executor died) leaves the fork to the next one.
    await db.execute(sql`update jobs set status = 'FAILED' where id = ${second.job.id}`);
    const third = await acquire(forksOf, task);
    expect(third.fresh).toBe(false);
    expect(await sh(third.fork, 'cat web/a.txt')).toBe('changed\n');
    await forksOf.release(third.fork);
    // A lifecycle on another host has forks of its own.
    const elsewhere = await acquire(lifecycle(newHost()), task);
    expect(elsewhere.fresh).toBe(true);
  });

  it('stops an idle fork (its dev servers), archives it, then deletes it', async () => {
    const host = newHost();
    const forksOf = lifecycle(host);
    const patient = lifecycle(host, LONG);
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await sh(fork, 'echo kept > web/new.txt');
    const servers = await startDevServers(
      fork,
      [{ repoDir: 'web', spec: DevServerSpec.parse({ name: 'web', command: 'exec node server.js', port: 4500 }) }],
      { network: false },
    );
    expect(servers.servers[0]!.healthy).toBe(true);
    const records = readProcessRecords(fork.info.dir);
    expect(records.map((record) => record.name).sort()).toEqual(['mount', 'network', 'web']);
    await forksOf.release(fork);

    expect(await patient.tick()).toEqual({ stopped: 0, archived: 0, deleted: 0 });
    expect(await tickUntil([forksOf], task.slug, 'stopped')).toEqual({ stopped: 1, archived: 0, deleted: 0 });
    expect(records.filter((record) => groupRunning(record.pid))).toEqual([]);
    expect(existsSync(dirOf(host, task.slug))).toBe(true);

    expect(await patient.tick()).toEqual({ stopped: 0, archived: 0, deleted: 0 });
    expect(await tickUntil([forksOf], task.slug, 'archived')).toEqual({ stopped: 0, archived: 1, deleted: 0 });
    expect(existsSync(dirOf(host, task.slug))).toBe(false);
    expect(existsSync(`${dirOf(host, task.slug)}.tar.gz`)).toBe(true);
    // Nothing else is left beside it: no temporary file, no half-restored directory.
    expect(readdirSync(join(forksRootOf(host), workspaceId)).filter((entry) => entry.startsWith(task.slug))).toEqual([`${task.slug}.lower`, `${task.slug}.tar.gz`]);

    expect(await tickUntil([forksOf], task.slug, 'deleted')).toEqual({ stopped: 0, archived: 0, deleted: 1 });
    expect(existsSync(`${dirOf(host, task.slug)}.tar.gz`)).toBe(false);
    expect(await forksOf.tick()).toEqual({ stopped: 0, archived: 0, deleted: 0 });

    // The task's next job starts over in a fresh fork.
    const again = await acquire(forksOf, task);
    expect(again.fresh).toBe(true);
    expect(await sh(again.fork, 'cat web/new.txt 2>/dev/null; cat web/a.txt')).toBe('original\n');
    await forksOf.release(again.fork);
  });

  it('restores an archived fork with its changes on acquire', async () => {
    const host = newHost();
    const forksOf = lifecycle(host, { ...SHORT, deleteMs: 3_600_000 });
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await sh(fork, 'echo edited > web/a.txt && rm web/old.txt && mkdir -p web/src/deep && echo new > web/src/deep/b.txt && ln -s a.txt web/link');
    await forksOf.release(fork);
    await tickUntil([forksOf], task.slug, 'archived');
    expect(existsSync(dirOf(host, task.slug))).toBe(false);

    const restored = await acquire(forksOf, task);
    expect(restored.fresh).toBe(false);
    expect(await sh(restored.fork, 'cat web/a.txt web/src/deep/b.txt web/link; ls web')).toBe('edited\nnew\nedited\na.txt\nlink\nserver.js\nsrc\n');
    expect(existsSync(`${dirOf(host, task.slug)}.tar.gz`)).toBe(false);
    expect(await row(task.slug)).toMatchObject({ state: 'active', jobId: restored.job.id });
    await forksOf.release(restored.fork);
  });

  it('does each move once when two lifecycles on one host tick at the same time', async () => {
    const host = newHost();
    const [one, two] = [lifecycle(host), lifecycle(host)];
    const tasks = await Promise.all([newTask(), newTask(), newTask(), newTask()]);
    for (const task of tasks) {
      const { fork } = await acquire(one, task);
      await sh(fork, `echo ${task.slug} > web/a.txt`);
      await one.release(fork);
    }
    const last = tasks.at(-1)!.slug;
    const totals: TickResult = { stopped: 0, archived: 0, deleted: 0 };
    for (const state of ['stopped', 'archived', 'deleted']) {
      // Each fork passes through every state; wait for the last one, the others went before it.
      for (const task of tasks) {
        const moved = await tickUntil([one, two], task.slug, state);
        totals.stopped += moved.stopped;
        totals.archived += moved.archived;
        totals.deleted += moved.deleted;
      }
    }
    expect(totals).toEqual({ stopped: 4, archived: 4, deleted: 4 });
    expect((await row(last)).state).toBe('deleted');
    for (const task of tasks) {
      expect(existsSync(dirOf(host, task.slug))).toBe(false);
      expect(existsSync(`${dirOf(host, task.slug)}.tar.gz`)).toBe(false);
    }
  });

  it('finishes a move that a crashed process left half done', async () => {
    const host = newHost();
    const forksOf = lifecycle(host, { ...SHORT, deleteMs: 3_600_000, claimLeaseMs: 100 });
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await sh(fork, 'echo survived > web/a.txt');
    await forksOf.release(fork);
    // A process claimed the archive move, wrote part of a temporary archive, and died.
    await db.execute(sql`update forks set state = 'archiving', state_changed_at = now() - interval '1 minute' where name = ${task.slug}`);
    writeFileSync(`${dirOf(host, task.slug)}.tar.gz.999-1.tmp`, 'partial');
    expect(await tickUntil([forksOf], task.slug, 'archived')).toEqual({ stopped: 0, archived: 1, deleted: 0 });
    expect(existsSync(dirOf(host, task.slug))).toBe(false);
    expect(readdirSync(join(forksRootOf(host), workspaceId))).toEqual([`${task.slug}.lower`, `${task.slug}.tar.gz`]);
    const restored = await acquire(forksOf, task);
    expect(await sh(restored.fork, 'cat web/a.txt')).toBe('survived\n');
    await forksOf.release(restored.fork);
  });

  it('keeps a fork current when the environment was only flattened, and says when it really changed', async () => {
    const forksOf = lifecycle(newHost(), LONG);
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await forksOf.release(fork);
    const reacquire = async (next: AcquireInput['environment']) => {
      const made = await acquire(forksOf, task, next);
      await forksOf.release(made.fork);
      return made;
    };
    // Version 4 is version 3 flattened: the same files.
    expect(await reacquire({ version: 4, layers: [environmentDir], record: { sameFilesAs: [3] } })).toMatchObject({ fresh: false, outdated: false });
    expect(await reacquire({ version: 4, layers: [environmentDir] })).toMatchObject({ fresh: false, outdated: true });
  });

  it.skipIf(!sandboxCapabilities().overlay)('resumes forks made before environment versions on the layer their environment was moved into', async () => {
    const [host, archivingHost] = [newHost(), newHost()];
    const [forksOf, archiving] = [lifecycle(host, LONG), lifecycle(archivingHost, { ...SHORT, deleteMs: 3_600_000 })];
    // A workspace environment from before versions, changed in place twice.
    const environmentRoot = join(root, 'environments', workspaceId);
    mkdirSync(join(environmentRoot, 'web'), { recursive: true });
    writeFileSync(join(environmentRoot, 'web', 'a.txt'), 'legacy\n');
    writeFileSync(`${environmentRoot}.version`, 'in-place-2');
    // Forks of it as they were kept then: an overlay upper with the fork's own change, and beside it the
    // environment's in-place version when the fork was made (no record of a version), or nothing at all
    // (a fork older than that marker).
    const legacyFork = async (lifecycleOf: ForkLifecycle, forkHost: string, marker: string | null) => {
      const task = await newTask();
      const { fork } = await acquire(lifecycleOf, task);
      expect(fork.info.mode).toBe('overlay');
      await sh(fork, 'echo mine > web/b.txt');
      await lifecycleOf.release(fork);
      rmSync(`${dirOf(forkHost, task.slug)}.lower`);
      if (marker !== null) writeFileSync(`${dirOf(forkHost, task.slug)}.lower-version`, marker);
      return task;
    };
    const current = await legacyFork(forksOf, host, 'in-place-2');
    const outdated = await legacyFork(forksOf, host, 'in-place-1');
    const archived = await legacyFork(archiving, archivingHost, 'in-place-2');
    const unmarked = await legacyFork(forksOf, host, null);
    const archivedEarlier = await legacyFork(forksOf, host, null);
    await tickUntil([archiving], archived.slug, 'archived');
    // Archived only once the environment is version 1: its archive is newer than version 1, its files are not.
    const unmarkedArchived = await legacyFork(archiving, archivingHost, null);
    // Until they are resumed, their markers keep the first version from being collected.
    expect(ForkLifecycle.versionsInUse(forksParent, workspaceId).has(1)).toBe(true);

    const store = new EnvironmentStore(environmentRoot, { hiddenPaths: [], allowUnsandboxed: false });
    const first = await store.init('never used', async () => {
      throw new Error('an environment from before versions is adopted, not built');
    });
    await tickUntil([archiving], unmarkedArchived.slug, 'archived');
    // Archived after version 1 by a release that did not adopt it first: its archive is newer than version 1.
    await new ForkManager(join(forksRootOf(host), workspaceId), { hiddenPaths: [], allowUnsandboxed: false }).archive(archivedEarlier.slug, 'overlay');
    // A fork without a marker made after the environment became version 1 was not made from it.
    const newer = await legacyFork(forksOf, host, null);
    const later = new Date(Date.parse(first.record.createdAt) + 60_000);
    utimesSync(join(dirOf(host, newer.slug), 'upper'), later, later);
    // Version 1 is kept for the older forks without a record, and not for the newer one alone.
    expect(ForkLifecycle.versionsInUse(forksParent, workspaceId, store).has(1)).toBe(true);
    expect(store.mayBeUnmarkedLegacyFork(Date.parse(first.record.createdAt) - 1)).toBe(true);
    expect(store.mayBeUnmarkedLegacyFork(later.getTime())).toBe(false);
    const resumed = await acquire(forksOf, current, first);
    expect(resumed).toMatchObject({ fresh: false, outdated: false });
    expect(await sh(resumed.fork, 'cat web/a.txt web/b.txt')).toBe('legacy\nmine\n');
    expect(resumed.fork.info.lower).toEqual({ version: 1, layers: first.layers });
    expect(existsSync(`${dirOf(host, current.slug)}.lower-version`)).toBe(false);
    await forksOf.release(resumed.fork);

    const restored = await acquire(archiving, archived, first);
    expect(restored).toMatchObject({ fresh: false, outdated: false });
    expect(await sh(restored.fork, 'cat web/a.txt web/b.txt')).toBe('legacy\nmine\n');
    await archiving.release(restored.fork);

    // Forks without a marker resume when their files are older than version 1, archived or not.
    for (const [lifecycleOf, task] of [[forksOf, unmarked], [archiving, unmarkedArchived], [forksOf, archivedEarlier]] as const) {
      const unmarkedResumed = await acquire(lifecycleOf, task, first);
      expect(unmarkedResumed).toMatchObject({ fresh: false, outdated: false });
      expect(await sh(unmarkedResumed.fork, 'cat web/a.txt web/b.txt')).toBe('legacy\nmine\n');
      await lifecycleOf.release(unmarkedResumed.fork);
    }
    const notResumed = await acquire(forksOf, newer, first);
    expect(notResumed.fresh).toBe(true);
    expect(await sh(notResumed.fork, 'cat web/b.txt 2>/dev/null; cat web/a.txt')).toBe('legacy\n');
    await forksOf.release(notResumed.fork);

    // The environment had changed under this one already: it starts over, and its marker goes.
    const fresh = await acquire(forksOf, outdated, first);
    expect(fresh.fresh).toBe(true);
    expect(await sh(fresh.fork, 'cat web/b.txt 2>/dev/null; cat web/a.txt')).toBe('legacy\n');
    await forksOf.release(fresh.fork);
    // Every fork now records its version as forks of versions do, and the resumed ones keep theirs in use.
    expect(readdirSync(join(forksRootOf(host), workspaceId)).filter((entry) => entry.endsWith('.lower-version'))).toEqual([]);
    expect(ForkLifecycle.versionsInUse(forksParent, workspaceId).has(1)).toBe(true);
  });

  it('discards a fork at once', async () => {
    const host = newHost();
    const forksOf = lifecycle(host);
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await forksOf.discard(fork);
    expect(existsSync(dirOf(host, task.slug))).toBe(false);
    expect(await row(task.slug)).toMatchObject({ state: 'deleted', jobId: null });
  });

  it('is ticked by the scheduler, which survives failing work and waits for a tick in flight on stop', async () => {
    const host = newHost();
    const forksOf = lifecycle(host, { ...SHORT, archiveMs: 3_600_000 });
    const task = await newTask();
    const { fork } = await acquire(forksOf, task);
    await forksOf.release(fork);
    let failures = 0;
    let slowEnded = false;
    const scheduler = new Scheduler({
      tickMs: 20,
      logger,
      work: [
        {
          name: 'failing',
          run: async () => {
            failures += 1;
            throw new Error('boom');
          },
        },
        { name: 'forks', run: () => forksOf.tick() },
        {
          name: 'slow',
          run: async () => {
            slowEnded = false;
            await new Promise((resolve) => setTimeout(resolve, 30));
            slowEnded = true;
          },
        },
      ],
    });
    scheduler.start();
    try {
      for (let attempt = 0; attempt < 200 && (await row(task.slug)).state !== 'stopped'; attempt++) {
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      expect((await row(task.slug)).state).toBe('stopped');
      expect(failures).toBeGreaterThan(1);
    } finally {
      await scheduler.stop();
    }
    expect(slowEnded).toBe(true);
    const after = failures;
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(failures).toBe(after);
  });
});

describe('versions forks use', () => {
  it('counts the first version in use for a fork, or its archive, with no record of its version', () => {
    const forksParent = mkdtempSync(join(tmpdir(), 'svc-forks-in-use-'));
    const workspace = join(forksParent, 'host-a', 'acme');
    mkdirSync(join(workspace, 'recorded'), { recursive: true });
    writeFileSync(join(workspace, 'recorded.lower'), JSON.stringify({ version: 5, layers: ['/nowhere'] }));
    expect([...ForkLifecycle.versionsInUse(forksParent, 'acme')]).toEqual([5]);
    // Made before versions and before their marker: it may resume on the first version.
    mkdirSync(join(workspace, 'unmarked'));
    expect([...ForkLifecycle.versionsInUse(forksParent, 'acme')].sort()).toEqual([1, 5]);
    rmSync(join(workspace, 'unmarked'), { recursive: true });
    writeFileSync(join(workspace, 'unmarked.tar.gz'), '');
    expect([...ForkLifecycle.versionsInUse(forksParent, 'acme')].sort()).toEqual([1, 5]);
    rmSync(join(workspace, 'unmarked.tar.gz'));
    expect([...ForkLifecycle.versionsInUse(forksParent, 'acme')]).toEqual([5]);
  });

  it('keeps the first version only for forks with no record whose files, archived or not, are older than it', async () => {
    const forksParent = mkdtempSync(join(tmpdir(), 'svc-forks-in-use-'));
    const workspace = join(forksParent, 'host-a', 'acme');
    const adoptedAt = Date.parse('2026-01-01T00:00:00Z');
    const environment = { mayBeUnmarkedLegacyFork: (changedAt: number | null) => changedAt === null || changedAt < adoptedAt };
    const inUse = () => [...ForkLifecycle.versionsInUse(forksParent, 'acme', environment)];
    const forkWithFiles = (name: string, at: Date) => {
      mkdirSync(join(workspace, name, 'upper', 'web'), { recursive: true });
      writeFileSync(join(workspace, name, 'upper', 'web', 'b.txt'), 'mine\n');
      utimesSync(join(workspace, name, 'upper'), at, at);
    };
    const [before, after] = [new Date(adoptedAt - 86_400_000), new Date(adoptedAt + 86_400_000)];
    // A fork dir that merely looks like a fork, made after version 1: it keeps nothing.
    forkWithFiles('newer', after);
    expect(inUse()).toEqual([]);
    forkWithFiles('older', before);
    expect(inUse()).toEqual([1]);
    // Archived (now, after version 1): judged by the time its files have in the archive.
    const manager = new ForkManager(workspace, { hiddenPaths: [], allowUnsandboxed: false });
    await manager.archive('older', 'overlay');
    expect(existsSync(join(workspace, 'older'))).toBe(false);
    expect(forkFilesChangedAt(join(workspace, 'older'))).toBe(before.getTime());
    expect(inUse()).toEqual([1]);
    await manager.archive('newer', 'overlay');
    rmSync(join(workspace, 'older.tar.gz'));
    expect(inUse()).toEqual([]);
    // An archive whose time cannot be read is kept resumable: its work may be from before version 1.
    writeFileSync(join(workspace, 'unreadable.tar.gz'), 'not a gzip');
    expect(inUse()).toEqual([1]);
  });
});
