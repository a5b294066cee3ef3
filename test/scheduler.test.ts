/**
 * The scheduler runs long work detached from its ticks, and a process shutting down stops that work
 * first instead of waiting for it (a setup the environments' sweep runs can take half an hour).
 */
import { existsSync, mkdtempSync, readdirSync, writeFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { loadConfig } from '../src/config.js';
import { addRepository } from '../src/engine/repositories.js';
import { Scheduler } from '../src/engine/scheduler.js';
import { admin, startWorker, withEnvironments } from '../src/main.js';
import { parseEnvironmentConfig } from '../src/sandbox/environment.js';
import { gitIn, sampleRepository } from './support/repos.js';

const logger = pino({ level: process.env.SVC_TEST_LOG ?? 'silent' });
const pause = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('scheduler', () => {
  it('runs detached work beside its ticks: a slow round holds up no other work, never overlaps itself, and stop waits for it', async () => {
    let release!: () => void;
    const released = new Promise<void>((resolve) => (release = resolve));
    const rounds = { slow: 0, fast: 0 };
    let slowEnded = false;
    const scheduler = new Scheduler({
      tickMs: 10,
      logger,
      work: [
        {
          name: 'slow',
          detached: true,
          run: async () => {
            rounds.slow += 1;
            await released;
            slowEnded = true;
          },
        },
        { name: 'fast', run: async () => (rounds.fast += 1) },
      ],
    });
    scheduler.start();
    try {
      for (let attempt = 0; attempt < 500 && rounds.fast < 5; attempt++) await pause(10);
      expect(rounds.fast).toBeGreaterThanOrEqual(5);
      expect(rounds.slow).toBe(1);
    } finally {
      // The slow round ends only after stop was called (a timer runs after everything stop could do at once).
      const stopped = scheduler.stop().then(() => slowEnded);
      setTimeout(release, 20);
      expect(await stopped).toBe(true);
    }
  });

  it('starts no work once stopped, also not through a tick', async () => {
    const rounds = { plain: 0, detached: 0 };
    const scheduler = new Scheduler({
      tickMs: 3_600_000,
      logger,
      work: [
        { name: 'plain', run: async () => (rounds.plain += 1) },
        { name: 'detached', detached: true, run: async () => (rounds.detached += 1) },
      ],
    });
    scheduler.start();
    await scheduler.tick();
    expect(rounds).toEqual({ plain: 1, detached: 1 });
    await scheduler.stop();
    // What shuts down after the scheduler (the database) must not find its work running again.
    await scheduler.tick();
    expect(rounds).toEqual({ plain: 1, detached: 1 });
  });
});

// The worker opens the database its config names: the embedded one in its data dir here, whatever
// DATABASE_URL says (a worker would use the public schema of that database).
describe('a worker shutting down', () => {
  it('stops the setup its scheduler is running rather than wait for it', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'svc-worker-close-'));
    const config = loadConfig({ dataDir, schedulerTickMs: 100, executorConcurrency: 1 }, {});
    try {
      const workspaceId = await withEnvironments(config, async (database, environments) => {
        const workspace = await admin.addWorkspace(database.db, 'acme', 'free', 'openai-compatible/fake');
        await addRepository(database.db, environments, { workspace, source: sampleRepository('web'), fullName: 'acme/web', setup: false });
        const current = parseEnvironmentConfig(environments.current(workspace.id)!.record.config);
        const withSetup = (setup: string[]) => ({ ...current, repositories: current.repositories.map((spec) => ({ ...spec, setup })) });
        await environments.setConfig(workspace, JSON.stringify(withSetup(['true'])));
        await environments.setup(workspace.id, ['web']);
        // A merged repair of the environment changes the setup: the next sweep runs it, and it is slow.
        const work = mkdtempSync(join(tmpdir(), 'svc-environment-'));
        gitIn(tmpdir(), 'clone', '--quiet', join(dataDir, 'codehost', workspace.id, 'svc/environment.git'), work);
        writeFileSync(join(work, '.svc', 'environment.json'), JSON.stringify(withSetup(['touch ../setup-started && exec sleep 600'])));
        gitIn(work, 'commit', '--quiet', '-am', 'a slow setup');
        gitIn(work, 'push', '--quiet', 'origin', 'HEAD:main');
        return workspace.id;
      });
      const worker = await startWorker(config, logger);
      try {
        const changes = join(dataDir, 'environments', workspaceId, 'changes');
        const started = () => existsSync(changes) && readdirSync(changes).some((entry) => ['upper', 'root'].some((dir) => existsSync(join(changes, entry, dir, 'setup-started'))));
        for (let attempt = 0; attempt < 600 && !started(); attempt++) await pause(50);
        expect(started()).toBe(true);
      } finally {
        // Hangs (past the test's timeout) when the scheduler is stopped before the setup.
        await worker.close();
      }
    } finally {
      await rm(dataDir, { recursive: true, force: true });
    }
  });
});
