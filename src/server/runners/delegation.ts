/** Runner routes that reach beyond the local run: pull-request reports, cloud delegation, workspace shell grants. */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { z } from 'zod';
import {
  DelegateBody,
  DelegateResponse,
  PullRequestReportBody,
  PullRequestReportResponse,
  RUNNER_LIMITS,
  WorkspaceSshBody,
  WorkspaceSshResponse,
} from '../../protocol/runner.js';
import { delegate } from '../../engine/runners/delegation.js';
import { reportPullRequests } from '../../engine/runners/pull-requests.js';
import { requestWorkspaceSsh } from '../../engine/runners/workspace-shell.js';
import type { Environments } from '../../engine/environments.js';
import type { Db } from '../../store/db.js';
import { refuseNulBytes } from '../nul.js';
import { presentPullRequest } from '../rest/present.js';
import { runnerOf } from './auth.js';
import { runnerRouteErrors } from './responses.js';

const TAG = ['runners'];
const RunParams = z.object({ runId: z.uuid() });

export interface DelegationRouteDeps {
  db: Db;
  publicUrl: string;
  /** Their code host is where handed-off branches must be. */
  environments: Environments;
}

export const delegationRoutes: FastifyPluginAsyncZod<DelegationRouteDeps> = async (app, deps) => {
  const { db, publicUrl } = deps;
  // These bodies are stored as text, which cannot hold NUL.
  app.addHook('preValidation', refuseNulBytes);

  app.post(
    '/runs/:runId/pull-requests',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerReportPullRequests',
        summary: "Report the status of the run's task's pull requests (at most 50, keyed by URL); refreshes after completion are accepted",
        params: RunParams,
        body: PullRequestReportBody,
        response: { 200: PullRequestReportResponse, ...runnerRouteErrors(403, 404) },
      },
    },
    async (request) => ({ pullRequests: (await reportPullRequests(db, runnerOf(request), request.params.runId, request.body)).map(presentPullRequest) }),
  );

  app.post(
    '/runs/:runId/delegate',
    {
      bodyLimit: RUNNER_LIMITS.delegateBytes,
      schema: {
        tags: TAG,
        operationId: 'runnerDelegate',
        summary: "Hand the executing run's remaining work and pushed branches to a cloud task (or continue its linked one)",
        params: RunParams,
        body: DelegateBody,
        response: { 200: DelegateResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) =>
      delegate(
        { db, publicUrl, codeHost: deps.environments.codeHost, onDispatchError: (error) => request.log.warn({ err: error }, 'queueing the job of a handed-off cloud task failed') },
        runnerOf(request),
        request.params.runId,
        request.body,
      ),
  );

  app.post(
    '/runs/:runId/workspace-ssh',
    {
      schema: {
        tags: TAG,
        operationId: 'runnerWorkspaceSsh',
        summary: 'Temporary shell access (60 minutes) to a cloud workspace that has every repository of the run\'s project',
        params: RunParams,
        body: WorkspaceSshBody,
        response: { 200: WorkspaceSshResponse, ...runnerRouteErrors(404, 409) },
      },
    },
    async (request) => requestWorkspaceSsh({ db, publicUrl }, runnerOf(request), request.params.runId, request.body),
  );
};
