/** /api/v1/repos: connected repositories and the pull requests on the built-in code host. */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import {
  ConnectRepositoryBody,
  ConnectRepositoryResponse,
  ListPullRequestsQuery,
  ListPullRequestsResponse,
  ListRepositoriesResponse,
  PullRequestParams,
  PullRequestResponse,
  PullRequestWithDiffResponse,
  RepositoryParams,
} from '../../protocol/rest.js';
import * as pulls from '../../engine/pull-requests.js';
import { connectRepository } from '../../engine/repositories.js';
import { callerOf } from '../auth.js';
import { refuseNulBytes } from '../nul.js';
import { presentPullRequestDetail, presentRepository } from './present.js';
import { errorResponses } from './responses.js';

export type CodeHostDeps = pulls.PullRequestDeps & {
  /** Roots under which `POST /repos` accepts paths on the server (SVC_REPO_PATHS). */
  repoPaths: readonly string[];
};

const TAG = ['pull requests'];

export const pullRequestRoutes: FastifyPluginAsyncZod<CodeHostDeps> = async (app, deps) => {
  app.addHook('preValidation', refuseNulBytes);
  const { db } = deps;

  app.get(
    '/repos',
    {
      schema: {
        tags: TAG,
        operationId: 'listRepositories',
        summary: 'List the repositories connected to the workspace (`svc admin repo add`)',
        response: { 200: ListRepositoriesResponse, ...errorResponses() },
      },
    },
    async (request) => ({ repositories: (await pulls.listWorkspaceRepositories(db, callerOf(request))).map(presentRepository) }),
  );

  app.post(
    '/repos',
    {
      schema: {
        tags: TAG,
        operationId: 'connectRepository',
        summary: 'Connect a repository to the workspace: the code host gets a copy, the environment a working copy',
        body: ConnectRepositoryBody,
        response: { 201: ConnectRepositoryResponse, ...errorResponses(400, 409, 415) },
      },
    },
    async (request, reply) => {
      const { repository, setup } = await connectRepository(db, deps.environments, callerOf(request), request.body, deps.repoPaths);
      return reply.status(201).send({ repository: presentRepository(repository), setup });
    },
  );

  app.get(
    '/pulls',
    {
      schema: {
        tags: TAG,
        operationId: 'listPullRequests',
        summary: "List the workspace's pull requests, newest first",
        querystring: ListPullRequestsQuery,
        response: { 200: ListPullRequestsResponse, ...errorResponses(400) },
      },
    },
    async (request) => ({
      pullRequests: (await pulls.listWorkspacePullRequests(db, callerOf(request), request.query)).map(presentPullRequestDetail),
    }),
  );

  app.get(
    '/repos/:owner/:repo/pulls',
    {
      schema: {
        tags: TAG,
        operationId: 'listRepositoryPullRequests',
        summary: "List a repository's pull requests, newest first",
        params: RepositoryParams,
        querystring: ListPullRequestsQuery,
        response: { 200: ListPullRequestsResponse, ...errorResponses(400) },
      },
    },
    async (request) => {
      const repository = `${request.params.owner}/${request.params.repo}`;
      return { pullRequests: (await pulls.listWorkspacePullRequests(db, callerOf(request), { ...request.query, repository })).map(presentPullRequestDetail) };
    },
  );

  app.get(
    '/repos/:owner/:repo/pulls/:number',
    {
      schema: {
        tags: TAG,
        operationId: 'getPullRequest',
        summary: 'Fetch a pull request with its proof and diff',
        params: PullRequestParams,
        response: { 200: PullRequestWithDiffResponse, ...errorResponses(400, 404) },
      },
    },
    async (request) => {
      const { owner, repo, number } = request.params;
      const { pullRequest, diff } = await pulls.getPullRequest(deps, callerOf(request), `${owner}/${repo}`, number);
      return { pullRequest: presentPullRequestDetail(pullRequest), diff };
    },
  );

  app.post(
    '/repos/:owner/:repo/pulls/:number/merge',
    {
      schema: {
        tags: TAG,
        operationId: 'mergePullRequest',
        summary: "Merge an open pull request into its base branch; completes its task if it waits for review",
        params: PullRequestParams,
        response: { 200: PullRequestResponse, ...errorResponses(400, 404, 409) },
      },
    },
    async (request) => {
      const { owner, repo, number } = request.params;
      return { pullRequest: presentPullRequestDetail(await pulls.mergePullRequest(deps, callerOf(request), `${owner}/${repo}`, number)) };
    },
  );

  app.post(
    '/repos/:owner/:repo/pulls/:number/close',
    {
      schema: {
        tags: TAG,
        operationId: 'closePullRequest',
        summary: 'Close an open pull request without merging it',
        params: PullRequestParams,
        response: { 200: PullRequestResponse, ...errorResponses(400, 404, 409) },
      },
    },
    async (request) => {
      const { owner, repo, number } = request.params;
      return { pullRequest: presentPullRequestDetail(await pulls.closePullRequest(deps, callerOf(request), `${owner}/${repo}`, number)) };
    },
  );
};
