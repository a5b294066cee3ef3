/**
 * The signed-in user's side of desktop runners under /api/v1: pairing a computer, listing the user's
 * connections and revoking one. Session only: a workspace API key gets 403 (docs/runner-protocol.md
 * "The user's side").
 */
import { z } from 'zod';
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import * as enrollment from '../../engine/runners/enrollment.js';
import { CreatePairingBody, ListRunnersResponse, PairingResponse, RunnerSummary } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { requireUser, USER_REQUIRED } from '../auth.js';
import { refuseNulBytes } from '../nul.js';
import { describedErrorResponses } from './responses.js';

const TAG = ['runners'];
const SESSION_ONLY = [{ sessionCookie: [] }];
const FORBIDDEN =
  '`forbidden`: "' + USER_REQUIRED + '" for an API key; for the session, a missing or wrong `X-CSRF-Token`, another `Origin` ' +
  'or an `X-Svc-Workspace` the user is not a member of';

const RunnerParams = z.object({ id: z.uuid() });

export const runnerUserRoutes: FastifyPluginAsyncZod<{ db: Db }> = async (app, { db }) => {
  app.addHook('preValidation', refuseNulBytes);

  app.post(
    '/runner-pairings',
    {
      schema: {
        tags: TAG,
        operationId: 'createRunnerPairing',
        summary: "Issue a pairing code for the runner whose verifier's challenge this is (10 minutes, once); the computer joins the user's personal workspace",
        security: SESSION_ONLY,
        body: CreatePairingBody,
        response: {
          201: PairingResponse,
          ...describedErrorResponses({ 403: `${FORBIDDEN}; a user without a personal workspace` }, 400, 403, 413, 415),
        },
      },
    },
    async (request, reply) => {
      const session = requireUser(request);
      const pairing = await enrollment.createPairing(db, { userId: session.userId, challenge: request.body.challenge, name: request.body.name });
      reply.header('cache-control', 'no-store');
      return reply.status(201).send({ pairingCode: pairing.pairingCode, expiresAt: pairing.expiresAt.toISOString() });
    },
  );

  app.get(
    '/runners',
    {
      schema: {
        tags: TAG,
        operationId: 'listRunners',
        summary: "The user's runner connections in every workspace: presence, capabilities and projects",
        security: SESSION_ONLY,
        response: { 200: ListRunnersResponse, ...describedErrorResponses({ 403: FORBIDDEN }, 403) },
      },
    },
    async (request) => ({ runners: await enrollment.listRunners(db, requireUser(request).userId) }),
  );

  app.post(
    '/runners/:id/revoke',
    {
      schema: {
        tags: TAG,
        operationId: 'revokeRunner',
        summary: 'Revoke a runner connection: its credential stops working at once; its runs stay until it reconnects',
        security: SESSION_ONLY,
        params: RunnerParams,
        response: {
          200: RunnerSummary,
          ...describedErrorResponses({ 403: FORBIDDEN, 404: '`not_found` "Runner not found": no connection of this user has that id' }, 400, 403, 404),
        },
      },
    },
    async (request) => enrollment.revokeRunner(db, requireUser(request).userId, request.params.id),
  );
};
