/**
 * The owner's routes of local work (docs/runner-protocol.md "The user's side"): what a local run asks,
 * the answers, and files asked of the runner. Only a signed-in user gets here (API keys: 403), and only
 * the runner's owner finds the task (anyone else: 404).
 */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { TaskParams } from '../../protocol/rest.js';
import {
  AsyncAnswerBody,
  CreateReviewRequestBody,
  ListLocalRequestsResponse,
  LocalRequestResponse,
  PermissionAnswerBody,
  ReviewRequestResponse,
} from '../../protocol/runner.js';
import { answerAsyncQuestion, answerPermission, createReviewRequest, getReviewRequest, listRequests, type Owner } from '../../engine/runners/owner.js';
import type { Db } from '../../store/db.js';
import { requireUser } from '../auth.js';
import { refuseNulBytes } from '../nul.js';
import { errorResponses } from './responses.js';
import type { FastifyRequest } from 'fastify';

const TAG = ['local work'];
/** Only a signed-in person: workspace API keys get 403. */
const SESSION_ONLY = [{ sessionCookie: [] }];
const RequestParams = TaskParams.extend({ requestId: z.string().min(1).max(200) });

function ownerOf(request: FastifyRequest): Owner {
  const session = requireUser(request);
  return { workspaceId: session.workspaceId, userId: session.userId };
}

export const localWorkRoutes: FastifyPluginAsyncZod<{ db: Db }> = async (app, { db }) => {
  app.addHook('preValidation', refuseNulBytes);

  app.get(
    '/tasks/:taskIdOrSlug/requests',
    {
      schema: {
        tags: TAG,
        security: SESSION_ONLY,
        operationId: 'listLocalRequests',
        summary: "The permissions and questions of a local task's runs, oldest first",
        params: TaskParams,
        response: { 200: ListLocalRequestsResponse, ...errorResponses(403, 404) },
      },
    },
    async (request) => ({ requests: await listRequests(db, ownerOf(request), request.params.taskIdOrSlug) }),
  );

  app.post(
    '/tasks/:taskIdOrSlug/permissions/:requestId',
    {
      schema: {
        tags: TAG,
        security: SESSION_ONLY,
        operationId: 'answerPermission',
        summary: 'Allow or deny a permission (answering its questions); an invalid answer leaves it pending',
        params: RequestParams,
        body: PermissionAnswerBody,
        response: { 200: LocalRequestResponse, ...errorResponses(400, 403, 404, 409) },
      },
    },
    async (request) => ({
      request: await answerPermission(db, ownerOf(request), request.params.taskIdOrSlug, request.params.requestId, request.body),
    }),
  );

  app.post(
    '/tasks/:taskIdOrSlug/questions/:requestId',
    {
      schema: {
        tags: TAG,
        security: SESSION_ONLY,
        operationId: 'answerAsyncQuestion',
        summary: 'Answer an async question: delivered to the running harness, or queued as a follow-up',
        params: RequestParams,
        body: AsyncAnswerBody,
        response: { 200: LocalRequestResponse, ...errorResponses(400, 403, 404, 409) },
      },
    },
    async (request) => ({
      request: await answerAsyncQuestion(db, ownerOf(request), request.params.taskIdOrSlug, request.params.requestId, request.body.text),
    }),
  );

  app.post(
    '/tasks/:taskIdOrSlug/review-requests',
    {
      schema: {
        tags: TAG,
        security: SESSION_ONLY,
        operationId: 'createReviewRequest',
        summary: "Ask the runner for a file of a local task (a path relative to the task's folder)",
        params: TaskParams,
        body: CreateReviewRequestBody,
        response: { 201: ReviewRequestResponse, ...errorResponses(400, 403, 404) },
      },
    },
    async (request, reply) =>
      reply.status(201).send({ reviewRequest: await createReviewRequest(db, ownerOf(request), request.params.taskIdOrSlug, request.body.path) }),
  );

  app.get(
    '/tasks/:taskIdOrSlug/review-requests/:id',
    {
      schema: {
        tags: TAG,
        security: SESSION_ONLY,
        operationId: 'getReviewRequest',
        summary: 'A review request and, once the runner answered, the file',
        params: TaskParams.extend({ id: z.uuid() }),
        response: { 200: ReviewRequestResponse, ...errorResponses(400, 403, 404) },
      },
    },
    async (request) => ({ reviewRequest: await getReviewRequest(db, ownerOf(request), request.params.taskIdOrSlug, request.params.id) }),
  );
};
