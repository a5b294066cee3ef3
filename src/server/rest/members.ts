/** /api/v1/members: the people of the caller's workspace, and adding one (creating the account if new). */
import type { FastifyPluginAsyncZod } from 'fastify-type-provider-zod';
import { AddMemberBody, AddMemberResponse, ListMembersResponse, type Member } from '../../protocol/auth.js';
import * as users from '../../engine/users.js';
import type { MemberRow } from '../../store/users.js';
import { callerOf } from '../auth.js';
import { refuseNulBytes } from '../nul.js';
import { describedErrorResponses, errorResponses } from './responses.js';
import type { RestDeps } from './tasks.js';

const TAG = ['members'];

function presentMember(row: MemberRow): Member {
  return { userId: row.userId, email: row.email, name: row.name, role: row.role, createdAt: row.createdAt.toISOString() };
}

export const memberRoutes: FastifyPluginAsyncZod<RestDeps> = async (app, { db, publicUrl }) => {
  app.addHook('preValidation', refuseNulBytes);

  app.get(
    '/members',
    {
      schema: {
        tags: TAG,
        operationId: 'listMembers',
        summary: 'List the members of the workspace',
        response: { 200: ListMembersResponse, ...errorResponses() },
      },
    },
    async (request) => ({ members: (await users.workspaceMembers(db, callerOf(request))).map(presentMember) }),
  );

  app.post(
    '/members',
    {
      schema: {
        tags: TAG,
        operationId: 'addMember',
        summary:
          'Add a user to the workspace, creating the account if the email has none (with a one-time sign-in link when a signed-in owner or admin asks; never for an API key)',
        body: AddMemberBody,
        response: {
          201: AddMemberResponse,
          ...describedErrorResponses(
            {
              403:
                '`forbidden`: the caller is a signed-in user who is not an owner or admin of the workspace (or an admin adding an owner), ' +
                'the workspace is a personal one, or a session check failed (CSRF token, origin, workspace)',
              409:
                '`conflict`: the user is already a member of the workspace, or the account was made by another workspace and no operator has ' +
                'confirmed it (`svc admin user create --confirm`)',
            },
            400,
            403,
            409,
            413,
            415,
          ),
        },
      },
    },
    async (request, reply) => {
      const added = await users.addMember(db, callerOf(request), request.body, { publicUrl });
      return reply.status(201).send({
        member: presentMember(added.member),
        accountCreated: added.accountCreated,
        signInLink: added.signInLink?.url ?? null,
        signInLinkExpiresAt: added.signInLink?.expiresAt.toISOString() ?? null,
      });
    },
  );
};
