/** /api/v1/tasks: thin routes that parse, call the task service and present. */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import {
  ApprovePlanBody,
  CancelTaskResponse,
  CreateTaskBody,
  FILE_LIMITS,
  GetTaskResponse,
  ListJobsQuery,
  ListJobsResponse,
  ListTasksQuery,
  ListTasksResponse,
  SendMessageBody,
  TaskAndJob,
  TaskParams,
  TaskResponse,
} from '../../protocol/rest.js';
import * as tasks from '../../engine/tasks.js';
import type { Db } from '../../store/db.js';
import { callerOf } from '../auth.js';
import { presentJob, presentListItem, presentView } from './present.js';
import { errorResponses } from './responses.js';
import { refuseNulBytes } from '../nul.js';

export interface RestDeps {
  db: Db;
  publicUrl: string;
}

const TAG = ['tasks'];

export const taskRoutes: FastifyPluginAsyncZod<RestDeps> = async (app, { db, publicUrl }) => {
  app.addHook('preValidation', refuseNulBytes);
  const answer = (result: tasks.TaskAndJobRows) => ({ task: presentView(result.view, publicUrl), job: presentJob(result.job) });

  app.post(
    '/tasks',
    {
      bodyLimit: FILE_LIMITS.bodyLimitBytes,
      schema: {
        tags: TAG,
        operationId: 'createTask',
        summary: 'Create a task and queue its first job',
        body: CreateTaskBody,
        response: { 201: TaskAndJob, ...errorResponses(400, 413, 415) },
      },
    },
    async (request, reply) => {
      const result = await tasks.createTask(db, callerOf(request), request.body);
      return reply.status(201).send(answer(result));
    },
  );

  app.get(
    '/tasks',
    {
      schema: {
        tags: TAG,
        operationId: 'listTasks',
        summary: "List the workspace's tasks, newest first",
        querystring: ListTasksQuery,
        response: { 200: ListTasksResponse, ...errorResponses(400) },
      },
    },
    async (request) => {
      const { rows, nextCursor } = await tasks.listWorkspaceTasks(db, callerOf(request), request.query);
      return { tasks: rows.map((row) => presentListItem(row, publicUrl)), nextCursor };
    },
  );

  app.get(
    '/tasks/:taskIdOrSlug',
    {
      schema: {
        tags: TAG,
        operationId: 'getTask',
        summary: 'Fetch one task with its latest job',
        params: TaskParams,
        response: { 200: GetTaskResponse, ...errorResponses(404) },
      },
    },
    async (request) => {
      const view = await tasks.getTask(db, callerOf(request), request.params.taskIdOrSlug);
      return { task: presentView(view, publicUrl), latestJob: view.latestJob ? presentJob(view.latestJob) : null };
    },
  );

  app.get(
    '/tasks/:taskIdOrSlug/jobs',
    {
      schema: {
        tags: TAG,
        operationId: 'listTaskJobs',
        summary: "List a task's jobs: newest page first, chronological within a page",
        params: TaskParams,
        querystring: ListJobsQuery,
        response: { 200: ListJobsResponse, ...errorResponses(400, 404) },
      },
    },
    async (request) => {
      const { rows, nextCursor } = await tasks.listTaskJobs(db, callerOf(request), request.params.taskIdOrSlug, request.query);
      return { jobs: rows.map(presentJob), nextCursor };
    },
  );

  app.post(
    '/tasks/:taskIdOrSlug/messages',
    {
      bodyLimit: FILE_LIMITS.bodyLimitBytes,
      schema: {
        tags: TAG,
        operationId: 'sendMessage',
        summary: 'Send a follow-up message; queues a new job and resumes a waiting or cancelled task',
        params: TaskParams,
        body: SendMessageBody,
        response: { 201: TaskAndJob, ...errorResponses(400, 404, 409, 413, 415) },
      },
    },
    async (request, reply) => {
      const result = await tasks.sendMessage(db, callerOf(request), request.params.taskIdOrSlug, request.body);
      return reply.status(201).send(answer(result));
    },
  );

  app.post(
    '/tasks/:taskIdOrSlug/approve-plan',
    {
      schema: {
        tags: TAG,
        operationId: 'approvePlan',
        summary: 'Approve the READY plan and queue its implementation',
        params: TaskParams,
        // The body is optional: a POST without one arrives as null.
        body: ApprovePlanBody.nullish(),
        response: { 201: TaskAndJob, ...errorResponses(400, 404, 409, 415) },
      },
    },
    async (request, reply) => {
      const result = await tasks.approvePlan(db, callerOf(request), request.params.taskIdOrSlug, request.body ?? {});
      return reply.status(201).send(answer(result));
    },
  );

  app.post(
    '/tasks/:taskIdOrSlug/cancel',
    {
      schema: {
        tags: TAG,
        operationId: 'cancelTask',
        summary: "Mark the task CANCELLED and stop its pending and running jobs",
        params: TaskParams,
        response: { 200: CancelTaskResponse, ...errorResponses(404, 409) },
      },
    },
    async (request) => {
      const { view, cancelled } = await tasks.cancelTask(db, callerOf(request), request.params.taskIdOrSlug);
      return { task: presentView(view, publicUrl), cancelledJobs: cancelled.map(presentJob) };
    },
  );

  app.post(
    '/tasks/:taskIdOrSlug/archive',
    {
      schema: {
        tags: TAG,
        operationId: 'archiveTask',
        summary: 'Archive a task that has no active runs; a later follow-up unarchives it',
        params: TaskParams,
        response: { 200: TaskResponse, ...errorResponses(404, 409) },
      },
    },
    async (request) => {
      const view = await tasks.archiveTask(db, callerOf(request), request.params.taskIdOrSlug);
      return { task: presentView(view, publicUrl) };
    },
  );
};
