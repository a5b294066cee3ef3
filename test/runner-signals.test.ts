/**
 * The signals long poll's life in a server process, on both databases: one LISTEN serves every poll, and
 * once the server closes it, a poll that still comes in is refused (503) and never listens again (a
 * LISTEN started then would never be stopped).
 */
import { describe, expect, it } from 'vitest';
import { RunnerSignals } from '../src/engine/runners/signals.js';
import type { Database } from '../src/store/db.js';
import { findRunner } from '../src/store/runners.js';
import { useTestApi, type TestApi } from './support/api.js';
import { testDrivers } from './support/db.js';
import { enrolledRunner, signedInUser } from './support/runners.js';

describe.each(testDrivers)('runner signals on %s', (driver) => {
  let api: TestApi;
  useTestApi(driver, (ready) => ({ api } = ready));

  /** The test database, counting the LISTENs started and those still running. */
  function countingListens(database: Database) {
    const count = { started: 0, running: 0 };
    const counting: Database = {
      db: database.db,
      driver: database.driver,
      ping: () => database.ping(),
      close: () => database.close(),
      async listen(channel, handler) {
        count.started += 1;
        const stop = await database.listen(channel, handler);
        count.running += 1;
        return async () => {
          count.running -= 1;
          await stop();
        };
      },
    };
    return { counting, count };
  }

  it('refuses a poll after close() and starts no LISTEN for it', async () => {
    const owner = await signedInUser(api);
    const runner = (await findRunner(api.db.database.db, (await enrolledRunner(api, owner)).id))!;
    const { counting, count } = countingListens(api.db.database);
    const signals = new RunnerSignals(counting);
    const body = { runs: [], version: null, waitMs: 0 };

    expect(await signals.poll(runner, body, new AbortController().signal)).toMatchObject({ controls: [], missing: [] });
    expect(await signals.poll(runner, body, new AbortController().signal)).toMatchObject({ controls: [] });
    expect(count).toEqual({ started: 1, running: 1 });

    await signals.close();
    expect(count).toEqual({ started: 1, running: 0 });
    await expect(signals.poll(runner, { ...body, waitMs: 10_000 }, new AbortController().signal)).rejects.toMatchObject({
      code: 'service_unavailable',
      status: 503,
      headers: { 'retry-after': expect.stringMatching(/^\d+$/) },
    });
    expect(count).toEqual({ started: 1, running: 0 });
  });
});
