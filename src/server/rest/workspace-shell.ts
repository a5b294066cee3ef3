/**
 * `POST /api/v1/workspace-shell`: a command in the workspace fork of a temporary shell grant. Its only
 * credential is the grant's `Bearer service_ssh_…` token: API keys, sessions and runner credentials are
 * not accepted here, and the token is accepted nowhere else. Each grant has the API's rate limit, and
 * room for one running command and a few waiting (engine/runners/workspace-shell.ts).
 */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { AppError, RateLimitedError } from '../../domain/errors.js';
import {
  authenticateShellToken,
  SHELL_QUEUED_COMMANDS,
  SHELL_UNAUTHORIZED,
  shellBusy,
  WorkspaceShells,
} from '../../engine/runners/workspace-shell.js';
import type { Environments } from '../../engine/environments.js';
import { ErrorEnvelope } from '../../protocol/errors.js';
import { RUNNER_LIMITS, WorkspaceShellBody, WorkspaceShellResponse } from '../../protocol/runner.js';
import type { SandboxPolicy } from '../../sandbox/fork.js';
import type { Db } from '../../store/db.js';
import type { SshGrantRow } from '../../store/delegations.js';
import { countRequest, type RateLimits } from '../../store/rate-limit.js';
import { bearerToken } from '../auth.js';

export interface WorkspaceShellDeps {
  db: Db;
  environments: Environments;
  dataDir: string;
  policy: SandboxPolicy;
  rateLimits: RateLimits;
}

declare module 'fastify' {
  interface FastifyRequest {
    shellGrant: SshGrantRow | null;
  }
}

const errors = {
  400: '`validation_error`: the body is invalid (an empty command, stdin over 1 MiB, a timeout over 600 s); `details.issues` lists `{ field, message }`',
  401: `\`unauthorized\` "${SHELL_UNAUTHORIZED}": no \`Bearer service_ssh_…\` token, or one that is unknown, expired or revoked (API keys, sessions and runner credentials are not accepted)`,
  403: "`forbidden`: the grant's user is no longer a member of its workspace",
  413: '`payload_too_large` "Request body is too large": over 8 MiB',
  415: '`unsupported_media_type`: a body that is not `application/json`',
  429:
    `\`rate_limited\`: over the grant's rate limit (that of the API, per grant), or the grant already runs a command with ${SHELL_QUEUED_COMMANDS} more ` +
    'waiting; `Retry-After` says when to try again',
  500: '`internal_error` "Server error": server failure; the details are only in the server log',
} as const;

export const workspaceShellRoutes: FastifyPluginAsyncZod<WorkspaceShellDeps> = async (app, deps) => {
  const shells = new WorkspaceShells({ db: deps.db, environments: deps.environments, dataDir: deps.dataDir, policy: deps.policy });
  app.decorateRequest('shellGrant', null);
  app.addHook('onRequest', async (request) => {
    const token = bearerToken(request.headers.authorization);
    const grant = token ? await authenticateShellToken(deps.db, token) : null;
    if (!grant) throw new AppError('unauthorized', SHELL_UNAUTHORIZED);
    const counted = await countRequest(deps.db, grant.id, deps.rateLimits);
    if (counted.kind === 'limited') throw new RateLimitedError(counted.window, counted.limit, counted.retryAfterSeconds);
    // Refused before its body is read; the engine counts again when it queues the command.
    if (shells.busy(grant.id)) throw shellBusy(SHELL_QUEUED_COMMANDS);
    request.shellGrant = grant;
    request.log = request.log.child({ shellGrantId: grant.id });
  });

  app.post(
    '/workspace-shell',
    {
      // stdin of 1 MiB, JSON-escaped at worst six bytes a byte, and the rest of the body.
      bodyLimit: 6 * RUNNER_LIMITS.shellStdinBytes + 2 * 1024 * 1024,
      schema: {
        tags: ['workspace shell'],
        operationId: 'workspaceShell',
        summary: "Run a command with `sh -c` in the grant's fork of the workspace environment (network as the environment config says)",
        security: [{ workspaceShellToken: [] }],
        body: WorkspaceShellBody,
        response: {
          200: WorkspaceShellResponse,
          ...Object.fromEntries(Object.entries(errors).map(([status, description]) => [status, ErrorEnvelope.describe(description)])),
        },
      },
    },
    async (request) => {
      if (!request.shellGrant) throw new AppError('unauthorized', SHELL_UNAUTHORIZED);
      return shells.run(request.shellGrant, request.body);
    },
  );
};
