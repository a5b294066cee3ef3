/**
 * The local runner protocol under `{base_url}/runners` (SPEC.md "Local runner protocol";
 * docs/runner-protocol.md): enrollment (no credential yet: the pairing code and verifier stand for one),
 * then every other route behind the runner's own credential. Routes are thin; the rules live in
 * engine/runners.
 */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { Identity } from '../../protocol/runner.js';
import type { Database } from '../../store/db.js';
import type { RateLimits } from '../../store/rate-limit.js';
import { runnerErrorResponses } from './responses.js';
import { makeRunnerAuthenticator, runnerOf } from './auth.js';
import { enrollRoute, heartbeatRoute } from './enrollment.js';
import { eventRoutes } from './events.js';
import { runRoutes } from './runs.js';
import { RunnerSignals } from '../../engine/runners/signals.js';
import type { Environments } from '../../engine/environments.js';
import { delegationRoutes } from './delegation.js';

export interface RunnerRouteDeps {
  database: Database;
  publicUrl: string;
  /** Per runner connection. */
  rateLimits: RateLimits;
  /** The workspace environments: their code host holds the branches a delegation hands off. */
  environments: Environments;
}

const TAG = ['runners'];

export const runnerRoutes: FastifyPluginAsyncZod<RunnerRouteDeps> = async (app, deps) => {
  const db = deps.database.db;
  app.decorateRequest('runner', null);
  // One LISTEN for every long poll of this server; closing the server ends the polls at once.
  const signals = new RunnerSignals(deps.database);
  app.addHook('preClose', async () => signals.close());

  await app.register(enrollRoute, { db });

  await app.register(async (authed) => {
    authed.addHook('onRequest', makeRunnerAuthenticator(db, deps.rateLimits));
    authed.addHook('onRoute', (route) => {
      route.schema = {
        ...route.schema,
        security: [{ runnerCredential: [] }],
        response: { ...runnerErrorResponses(route.method), ...(route.schema?.response as object | undefined) },
      };
    });

    authed.get(
      '/identity',
      {
        config: { acceptsRevoked: true },
        schema: {
          tags: TAG,
          operationId: 'runnerIdentity',
          summary: 'Who the presented runner credential is (a revoked one too); no tasks or credentials',
          response: { 200: Identity },
        },
      },
      async (request) => {
        const runner = runnerOf(request);
        return { runnerId: runner.id, workspaceId: runner.workspaceId, userId: runner.userId, revoked: runner.revokedAt !== null };
      },
    );

    await authed.register(heartbeatRoute, { db });
    await authed.register(runRoutes, { db, signals });
    await authed.register(eventRoutes, { db });
    await authed.register(delegationRoutes, { db, publicUrl: deps.publicUrl, environments: deps.environments });
  });
};
