/**
 * POST /runners/enroll (no credential yet: the pairing code and its verifier stand for one) and
 * POST /runners/heartbeat (behind the runner credential). Both take registrations of up to 4 MiB.
 */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import * as enrollment from '../../engine/runners/enrollment.js';
import { ErrorEnvelope } from '../../protocol/errors.js';
import { EnrollBody, EnrollmentReceipt, HeartbeatBody, HeartbeatResponse, RUNNER_LIMITS } from '../../protocol/runner.js';
import type { Db } from '../../store/db.js';
import { refuseNulBytes } from '../nul.js';
import { runnerOf } from './auth.js';
import { runnerErrorResponses } from './responses.js';

const TAG = ['runners'];
const mib = (bytes: number) => `${bytes / (1024 * 1024)} MiB`;

const ENROLL_ERRORS = {
  400: '`validation_error`: the body is invalid (a project name or repository that is a native path, over 2,000 models for a harness, a project listed twice…); `details.issues` lists `{ field, message }`',
  401:
    '`unauthorized` "Invalid pairing code or verifier": the code is unknown, used, expired or burnt (five wrong verifiers), or the verifier ' +
    'does not match its challenge; on a reconnect, also when `reconnect.credential` is not the current credential of `reconnect.runnerId`',
  403: '`forbidden`: a reconnect with a pairing code issued to another user than the owner of the connection',
  409: '`conflict`: the credential is already registered to another connection, or a reconnect names a connection that is not revoked',
  413: `\`payload_too_large\` "Request body is too large": over ${mib(RUNNER_LIMITS.registrationBytes)}`,
  429: '`rate_limited`: not answered by this route today (enrollment needs the verifier, and five wrong ones burn a code)',
};

/** Enrollment: outside the authenticated scope of the runner plugin. */
export const enrollRoute: FastifyPluginAsyncZod<{ db: Db }> = async (app, { db }) => {
  app.addHook('preValidation', refuseNulBytes);
  const responses = runnerErrorResponses('POST', 403, 409);
  for (const [status, description] of Object.entries(ENROLL_ERRORS)) {
    (responses as Record<string, unknown>)[status] = ErrorEnvelope.describe(description);
  }

  app.post(
    '/enroll',
    {
      bodyLimit: RUNNER_LIMITS.registrationBytes,
      schema: {
        tags: TAG,
        operationId: 'runnerEnroll',
        summary: 'Redeem a pairing code with its verifier and register a runner credential, capabilities and projects (or reconnect a revoked connection)',
        description:
          'A retry with the same `credential` (the answer was lost) gets the same receipt, whatever happened to the code since; it never ' +
          're-enables a connection revoked after it. See docs/runner-protocol.md "Pairing and enrollment".',
        security: [],
        body: EnrollBody,
        response: { 200: EnrollmentReceipt, ...responses },
      },
    },
    async (request) => enrollment.enroll(db, request.body),
  );
};

/** Heartbeats: registered inside the runner plugin's authenticated scope (its hook adds the common errors). */
export const heartbeatRoute: FastifyPluginAsyncZod<{ db: Db }> = async (app, { db }) => {
  app.addHook('preValidation', refuseNulBytes);

  app.post(
    '/heartbeat',
    {
      bodyLimit: RUNNER_LIMITS.registrationBytes,
      schema: {
        tags: TAG,
        operationId: 'runnerHeartbeat',
        summary: 'Presence, the workspace the runner works for, and (when sent) its capabilities and projects, which replace the registered ones',
        body: HeartbeatBody,
        response: {
          200: HeartbeatResponse,
          403: ErrorEnvelope.describe('`forbidden`: `workspaceId` is neither the user\'s personal workspace nor one the user is a member of'),
          413: ErrorEnvelope.describe(`\`payload_too_large\` "Request body is too large": over ${mib(RUNNER_LIMITS.registrationBytes)}`),
        },
      },
    },
    async (request) => enrollment.heartbeat(db, runnerOf(request), request.body),
  );
};
