/** /api/v1/routing-configs: the `/trigger` configs of the workspace. */
import { z } from 'zod';
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import {
  ListRoutingConfigsResponse,
  PutRoutingConfigBody,
  RoutingConfigParams,
  RoutingConfigResponse,
} from '../../protocol/rest.js';
import * as routing from '../../engine/routing.js';
import { callerOf } from '../auth.js';
import { presentRoutingConfig } from './present.js';
import { errorResponses } from './responses.js';
import { refuseNulBytes } from '../nul.js';
import type { RestDeps } from './tasks.js';

const TAG = ['routing'];

export const routingRoutes: FastifyPluginAsyncZod<RestDeps> = async (app, { db }) => {
  app.addHook('preValidation', refuseNulBytes);
  app.get(
    '/routing-configs',
    {
      schema: {
        tags: TAG,
        operationId: 'listRoutingConfigs',
        summary: 'List the routing configs, `default` included',
        response: { 200: ListRoutingConfigsResponse, ...errorResponses() },
      },
    },
    async (request) => ({ routingConfigs: (await routing.listConfigs(db, callerOf(request))).map(presentRoutingConfig) }),
  );

  app.put(
    '/routing-configs/:name',
    {
      schema: {
        tags: TAG,
        operationId: 'putRoutingConfig',
        summary: 'Create or replace the config a `/name` trigger selects (or edit `default`)',
        params: RoutingConfigParams,
        body: PutRoutingConfigBody,
        response: { 200: RoutingConfigResponse, ...errorResponses(400, 415) },
      },
    },
    async (request) => ({
      routingConfig: presentRoutingConfig(await routing.putConfig(db, callerOf(request), request.params.name, request.body)),
    }),
  );

  app.delete(
    '/routing-configs/:name',
    {
      schema: {
        tags: TAG,
        operationId: 'deleteRoutingConfig',
        summary: 'Delete a routing config; `default` cannot be deleted (409)',
        params: RoutingConfigParams,
        response: { 204: z.null().describe('Deleted'), ...errorResponses(404, 409) },
      },
    },
    async (request, reply) => {
      await routing.deleteConfig(db, callerOf(request), request.params.name);
      return reply.status(204).send(null);
    },
  );
};
