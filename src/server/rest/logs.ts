/**
 * GET /api/v1/tasks/{id}/logs: the task's journal as Server-Sent Events. Each event's SSE `id` is its
 * journal id, so a client resumes with `Last-Event-ID` (or `lastEventId`). With `follow` the stream stays
 * open, woken by NOTIFY, until the task no longer has a queued or running job; then `event: end`.
 */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { ValidationError } from '../../domain/errors.js';
import * as tasks from '../../engine/tasks.js';
import { TaskParams } from '../../protocol/rest.js';
import type { Db } from '../../store/db.js';
import { readTaskEvents, type EventRow } from '../../store/journal.js';
import { callerOf } from '../auth.js';
import type { EventHub } from '../event-hub.js';
import { errorResponses } from './responses.js';
import { refuseNulBytes } from '../nul.js';

const PAGE = 500;
const KEEP_ALIVE_MS = 15_000;

export const LogsQuery = z.object({
  follow: z.enum(['true', 'false', '1', '0']).default('false').describe('Keep the stream open until the task is idle'),
  lastEventId: z.string().optional().describe('Resume after this event id (the `Last-Event-ID` header does the same)'),
});

function cursorOf(header: string | string[] | undefined, query: string | undefined): number {
  const value = query ?? (Array.isArray(header) ? header[0] : header);
  if (value === undefined || value === '') return 0;
  if (!/^\d{1,15}$/.test(value)) {
    throw new ValidationError([{ field: 'lastEventId', message: 'must be an event id this stream sent' }], 'Invalid query parameters');
  }
  return Number(value);
}

function frame(event: EventRow): string {
  const data = JSON.stringify({
    jobId: event.jobId,
    sequence: event.sequence,
    kind: event.kind,
    data: event.data,
    createdAt: event.createdAt.toISOString(),
  });
  return `id: ${event.id}\ndata: ${data}\n\n`;
}

export const logRoutes: FastifyPluginAsyncZod<{ db: Db; hub: EventHub }> = async (app, { db, hub }) => {
  app.addHook('preValidation', refuseNulBytes);
  // Streams that follow a task would hold the server open: end them as soon as it starts closing.
  app.addHook('preClose', async () => hub.close());
  app.get(
    '/tasks/:taskIdOrSlug/logs',
    {
      schema: {
        tags: ['tasks'],
        operationId: 'streamTaskLogs',
        summary: "Stream the task's journal as Server-Sent Events",
        description:
          'Each SSE message has `id` (journal id; resume with `Last-Event-ID`) and JSON `data` ' +
          '`{ jobId, sequence, kind, data, createdAt }`. The stream ends with `event: end`: at once without ' +
          '`follow`, or once the task has no queued or running job.',
        params: TaskParams,
        querystring: LogsQuery,
        headers: z.looseObject({
          'last-event-id': z.string().optional().describe('Resume after this event id, as EventSource sends it on reconnect'),
        }),
        response: {
          200: z.string().meta({ 'x-media-type': 'text/event-stream', description: 'Server-Sent Events' }),
          ...errorResponses(400, 404),
        },
      },
    },
    async (request, reply) => {
      const caller = callerOf(request);
      let after = cursorOf(request.headers['last-event-id'], request.query.lastEventId);
      const follow = request.query.follow === 'true' || request.query.follow === '1';
      const view = await tasks.getTask(db, caller, request.params.taskIdOrSlug);
      const taskId = view.task.id;

      reply.hijack();
      const out = reply.raw;
      out.writeHead(200, {
        'content-type': 'text/event-stream; charset=utf-8',
        'cache-control': 'no-cache, no-transform',
        connection: 'keep-alive',
        'x-accel-buffering': 'no',
        'x-request-id': request.id,
      });
      // A first comment flushes the headers at once, so clients and proxies see the stream open.
      out.write(': stream open\n\n');
      let closed = false;
      let wake: (() => void) | null = null;
      request.raw.on('close', () => {
        closed = true;
        wake?.();
      });
      const drain = async () => {
        for (;;) {
          const events = await readTaskEvents(db, taskId, after, PAGE);
          for (const event of events) out.write(frame(event));
          if (events.length > 0) after = events[events.length - 1]!.id;
          if (events.length < PAGE) return;
        }
      };
      let unfollow: (() => void) | null = null;
      try {
        let pending = true;
        if (follow) unfollow = await hub.follow(taskId, () => ((pending = true), wake?.()));
        while (!closed) {
          pending = false;
          await drain();
          if (!follow || hub.closed || !(await tasks.isTaskActive(db, caller, taskId))) {
            // Events appended just before the task went idle are committed by now: one last drain.
            await drain();
            break;
          }
          if (!pending) {
            await new Promise<void>((resolve) => {
              wake = resolve;
              const timer = setTimeout(() => {
                if (!closed) out.write(': keep-alive\n\n');
                resolve();
              }, KEEP_ALIVE_MS);
              timer.unref();
            });
            wake = null;
          }
        }
        if (!closed) out.write('event: end\ndata: {}\n\n');
      } catch (error) {
        request.log.error({ err: error }, 'log stream failed');
        if (!closed) out.write(`event: error\ndata: ${JSON.stringify({ code: 'internal_error', message: 'Server error' })}\n\n`);
      } finally {
        unfollow?.();
        out.end();
      }
    },
  );
};
