/** Runner routes for events: batches into the journal, and the parts of large events. */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { EventPartBody, EventPartResponse, EventsBody, EventsResponse, RUNNER_LIMITS } from '../../protocol/runner.js';
import { ingestEvents, stagePart } from '../../engine/runners/events.js';
import type { Db } from '../../store/db.js';
import { runnerOf } from './auth.js';
import { runnerRouteErrors } from './responses.js';

const TAG = ['runners'];

export const eventRoutes: FastifyPluginAsyncZod<{ db: Db }> = async (app, { db }) => {
  app.post(
    '/events',
    {
      bodyLimit: RUNNER_LIMITS.eventBatchBytes,
      schema: {
        tags: TAG,
        operationId: 'runnerUploadEvents',
        summary: 'Upload event batches, one per run; each run gets its own result',
        body: EventsBody,
        response: { 200: EventsResponse },
      },
    },
    async (request) => ({
      results: await ingestEvents(db, runnerOf(request), request.body, (error, runId) => request.log.error({ err: error, runId }, 'an event batch failed')),
    }),
  );

  app.post(
    '/runs/:runId/event-parts',
    {
      // 192 KiB of data as base64, and the rest of the body.
      bodyLimit: Math.ceil((RUNNER_LIMITS.partDataBytes * 4) / 3) + 16 * 1024,
      schema: {
        tags: TAG,
        operationId: 'runnerStageEventPart',
        summary: "Stage one part of the run's next event (outputs above 240 KiB)",
        params: z.object({ runId: z.uuid() }),
        body: EventPartBody,
        response: { 200: EventPartResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) => stagePart(db, runnerOf(request), request.params.runId, request.body),
  );
};
