/**
 * Wire schemas of signed-in users: sign-in, sessions, passwords and workspace members (/api/v1/auth,
 * /api/v1/members). docs/api.md "Users and sessions" explains the rules behind them.
 */
import { z } from 'zod';

const DateTime = z.iso.datetime({ offset: true });

/** Addresses compare without regard to case; they are stored as given. */
export const Email = z.email().max(320).describe('An email address; case does not matter');

/**
 * Passwords are checked by the service (12 to 1,024 characters, counted as Unicode code points); the
 * schema only bounds the text so that nothing enormous reaches the hash.
 */
const PasswordText = z.string().max(4096);

export const Role = z.enum(['owner', 'admin', 'member']).meta({ id: 'Role' });
export type Role = z.infer<typeof Role>;

export const User = z
  .object({
    id: z.uuid(),
    email: z.string(),
    name: z.string().nullable(),
  })
  .meta({ id: 'User' });
export type User = z.infer<typeof User>;

export const SignInBody = z
  .object({
    email: Email,
    password: PasswordText.describe('The account\'s password'),
  })
  .meta({ id: 'SignInBody' });
export type SignInBody = z.infer<typeof SignInBody>;

export const SignInLinkBody = z
  .object({
    token: z.string().min(1).max(200).describe('The last path segment of a one-time sign-in link (`…/auth/sign-in/<token>`)'),
  })
  .meta({ id: 'SignInLinkBody' });
export type SignInLinkBody = z.infer<typeof SignInLinkBody>;

export const SignInResponse = z
  .object({
    user: User,
    csrfToken: z.string().describe('Send it as `X-CSRF-Token` on every POST, PUT, PATCH and DELETE made with the session cookie'),
    expiresAt: DateTime.describe('When the session ends unless used; every use moves it a full lifetime (30 days) ahead'),
  })
  .meta({ id: 'SignInResponse', description: 'The user signed in; the session cookie `svc_session` is in `Set-Cookie`' });
export type SignInResponse = z.infer<typeof SignInResponse>;

export const SessionWorkspace = z
  .object({
    id: z.uuid().describe('Send it as `X-Svc-Workspace` to act in this workspace'),
    name: z.string(),
    plan: z.enum(['free', 'pro', 'max']),
    role: Role,
    personal: z.boolean().describe('Whether it is the user\'s personal workspace, where session requests act by default'),
  })
  .meta({ id: 'SessionWorkspace' });
export type SessionWorkspace = z.infer<typeof SessionWorkspace>;

export const SessionResponse = z
  .object({
    user: User,
    workspaces: z.array(SessionWorkspace).describe('Every workspace the user is a member of, the personal one first'),
    csrfToken: z.string(),
    expiresAt: DateTime,
  })
  .meta({ id: 'SessionResponse', description: 'The signed-in user, their workspaces and the session' });
export type SessionResponse = z.infer<typeof SessionResponse>;

export const ChangePasswordBody = z
  .object({
    currentPassword: PasswordText.optional().describe('Required once the account has a password'),
    newPassword: PasswordText.describe('12 to 1,024 characters'),
  })
  .meta({ id: 'ChangePasswordBody' });
export type ChangePasswordBody = z.infer<typeof ChangePasswordBody>;

export const Member = z
  .object({
    userId: z.uuid(),
    email: z.string(),
    name: z.string().nullable(),
    role: Role,
    createdAt: DateTime.describe('When the user joined the workspace'),
  })
  .meta({ id: 'Member' });
export type Member = z.infer<typeof Member>;

export const AddMemberBody = z
  .object({
    email: Email,
    name: z.string().trim().min(1).max(200).optional().describe('Only used when the account is new'),
    role: Role.default('member'),
  })
  .meta({ id: 'AddMemberBody' });
export type AddMemberBody = z.infer<typeof AddMemberBody>;

export const AddMemberResponse = z
  .object({
    member: Member,
    accountCreated: z.boolean().describe('Whether this request created the account'),
    signInLink: z
      .string()
      .nullable()
      .describe(
        'A one-time sign-in link for the new account (valid 24 hours, works once), answered to a signed-in owner or admin; null when the account existed before, and always for an API key',
      ),
    signInLinkExpiresAt: DateTime.nullable(),
  })
  .meta({ id: 'AddMemberResponse', description: 'The new member of the workspace' });
export type AddMemberResponse = z.infer<typeof AddMemberResponse>;

export const ListMembersResponse = z
  .object({ members: z.array(Member) })
  .meta({ id: 'ListMembersResponse', description: 'The members of the workspace, in the order they joined' });
export type ListMembersResponse = z.infer<typeof ListMembersResponse>;
