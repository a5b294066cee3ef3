/** Runner routes for runs: list, claim, signals, controls, syncing, the receipt, wake, review requests. */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { z } from 'zod';
import {
  ClaimResponse,
  CompleteBody,
  ControlsResponse,
  GenerationBody,
  ListRunsResponse,
  MAX_COUNTER,
  ReviewAnswerBody,
  ReviewRequestsResponse,
  RUNNER_LIMITS,
  RunStatusResponse,
  SignalsBody,
  SignalsResponse,
  WakeResponse,
} from '../../protocol/runner.js';
import { answerReview, listReviewRequests } from '../../engine/runners/owner.js';
import { claimRun, completeRun, listRuns, markSyncing, readControls, wakeRun } from '../../engine/runners/runs.js';
import type { RunnerSignals } from '../../engine/runners/signals.js';
import type { Db } from '../../store/db.js';
import { refuseNulBytes } from '../nul.js';
import { runnerOf } from './auth.js';
import { runnerRouteErrors } from './responses.js';

const TAG = ['runners'];
const RunParams = z.object({ runId: z.uuid() });

export const runRoutes: FastifyPluginAsyncZod<{ db: Db; signals: RunnerSignals }> = async (app, { db, signals }) => {
  // Receipts and review answers go into text columns: a NUL is a 400 naming its field, not a 500.
  app.addHook('preValidation', refuseNulBytes);

  app.get(
    '/runs',
    { schema: { tags: TAG, operationId: 'runnerListRuns', summary: "The runner's runs with their manifests, and its work version; counts as presence", response: { 200: ListRunsResponse } } },
    async (request) => listRuns(db, runnerOf(request)),
  );

  app.post(
    '/runs/:runId/claim',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerClaimRun',
        summary: 'Claim a queued run (or claim again an executing one after a restart) under a new generation',
        params: RunParams,
        body: z.object({}).passthrough().nullish(),
        response: { 200: ClaimResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) => ({ run: await claimRun(db, runnerOf(request), request.params.runId) }),
  );

  app.post(
    '/signals',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerSignals',
        summary: 'Long poll for controls, missing runs, review requests or a new work version (waitMs ≤ 10,000); counts as presence',
        body: SignalsBody,
        response: { 200: SignalsResponse },
      },
    },
    async (request, reply) => {
      // The wait ends when the client goes away: nobody would read the answer. (The response's `close`,
      // not the request's: a request stream closes as soon as its body has been read.)
      const gone = new AbortController();
      const onClose = () => gone.abort();
      reply.raw.once('close', onClose);
      try {
        return await signals.poll(runnerOf(request), request.body, gone.signal);
      } finally {
        reply.raw.off('close', onClose);
      }
    },
  );

  app.get(
    '/runs/:runId/controls',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerControls',
        summary: "Legacy: a run's controls after a cursor (runners that predate signals)",
        params: RunParams,
        querystring: z.object({ after: z.coerce.number().int().min(0).max(MAX_COUNTER).default(0) }),
        response: { 200: ControlsResponse, ...runnerRouteErrors(404) },
      },
    },
    async (request) => ({ controls: await readControls(db, runnerOf(request), request.params.runId, request.query.after) }),
  );

  app.post(
    '/runs/:runId/syncing',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerSyncing',
        summary: 'The process group stopped and output is pending: pending prompts are cleared, the claim stays',
        params: RunParams,
        body: GenerationBody,
        response: { 200: RunStatusResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) => markSyncing(db, runnerOf(request), request.params.runId, request.body.generation),
  );

  app.post(
    '/runs/:runId/complete',
    {
      bodyLimit: 4 * 1024 * 1024,
      schema: {
        tags: TAG,
        operationId: 'runnerComplete',
        summary: 'The completion receipt: every event delivered, the process group stopped; ends the run',
        params: RunParams,
        body: CompleteBody,
        response: { 200: RunStatusResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) => completeRun(db, runnerOf(request), request.params.runId, request.body),
  );

  app.post(
    '/runs/:runId/wake',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerWake',
        summary: 'A parked CLI started a turn by itself: queue a run that resumes it',
        params: RunParams,
        body: GenerationBody,
        response: { 200: WakeResponse, ...runnerRouteErrors(404) },
      },
    },
    async (request) => wakeRun(db, runnerOf(request), request.params.runId, request.body),
  );

  app.get(
    '/review-requests',
    { schema: { tags: TAG, operationId: 'runnerReviewRequests', summary: 'Legacy: pending review requests', response: { 200: ReviewRequestsResponse } } },
    async (request) => ({ reviewRequests: await listReviewRequests(db, runnerOf(request)) }),
  );

  app.post(
    '/review-requests/:id',
    {
      bodyLimit: Math.ceil((RUNNER_LIMITS.reviewAnswerBytes * 4) / 3) + 64 * 1024,
      schema: {
        tags: TAG,
        operationId: 'runnerAnswerReviewRequest',
        summary: 'Answer a review request with the file (base64) or why it could not be read',
        params: z.object({ id: z.uuid() }),
        body: ReviewAnswerBody,
        response: { 204: z.null().describe('Answered'), ...runnerRouteErrors(404, 409) },
      },
    },
    async (request, reply) => {
      await answerReview(db, runnerOf(request), request.params.id, request.body);
      return reply.status(204).send(null);
    },
  );
};
