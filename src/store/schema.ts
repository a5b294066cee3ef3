/**
 * The Drizzle schema: the one description of every table. Migrations in drizzle/ are generated from it
 * (`npm run db:generate`) and committed; drizzle/meta holds the resulting schema snapshot for review.
 */
import { relations, sql } from 'drizzle-orm';
import type { CheckProof } from '../protocol/rest.js';
import {
  bigint,
  boolean,
  check,
  customType,
  index,
  integer,
  jsonb,
  pgTable,
  primaryKey,
  text,
  timestamp,
  uniqueIndex,
  uuid,
  type AnyPgColumn,
} from 'drizzle-orm/pg-core';

const bytea = customType<{ data: Buffer; driverData: Buffer | Uint8Array | string }>({
  dataType: () => 'bytea',
  // PGlite answers Uint8Array, node-postgres Buffer, and relational queries (which aggregate rows as
  // JSON) the text form `\x…`: callers always see a Buffer.
  fromDriver: (value) => {
    if (Buffer.isBuffer(value)) return value;
    if (typeof value === 'string') return Buffer.from(value.startsWith('\\x') ? value.slice(2) : value, 'hex');
    return Buffer.from(value);
  },
});

const createdAt = () => timestamp('created_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow();
const updatedAt = () => timestamp('updated_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow();
const optionalTime = (name: string) => timestamp(name, { withTimezone: true, mode: 'date' });

export const workspaces = pgTable(
  'workspaces',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    name: text('name').notNull(),
    plan: text('plan', { enum: ['free', 'pro', 'max'] }).notNull().default('free'),
    /**
     * Set on the one persistent personal workspace of a user (local runners are scoped to it); null for
     * shared workspaces. It belongs to the account, so it goes with it.
     */
    personalUserId: uuid('personal_user_id').references((): AnyPgColumn => users.id, { onDelete: 'cascade' }),
    createdAt: createdAt(),
  },
  (t) => [
    uniqueIndex('workspaces_name_key').on(t.name),
    uniqueIndex('workspaces_personal_user_key').on(t.personalUserId).where(sql`${t.personalUserId} is not null`),
    check('workspaces_plan_check', sql`${t.plan} in ('free', 'pro', 'max')`),
  ],
);

export const users = pgTable(
  'users',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    email: text('email').notNull(),
    name: text('name'),
    passwordHash: text('password_hash'),
    /**
     * The workspace whose POST /members made the account; null when the operator made it. Until the
     * operator confirms the account, only that workspace may add it (nobody has checked that the address
     * belongs to whoever uses the account).
     */
    createdByWorkspaceId: uuid('created_by_workspace_id').references((): AnyPgColumn => workspaces.id, { onDelete: 'set null' }),
    /** When the operator made or confirmed the account (`svc admin user create`): any workspace may add it. */
    confirmedAt: optionalTime('confirmed_at'),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('users_email_key').on(sql`lower(${t.email})`)],
);

export const memberships = pgTable(
  'memberships',
  {
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    role: text('role', { enum: ['owner', 'admin', 'member'] }).notNull().default('member'),
    createdAt: createdAt(),
  },
  (t) => [primaryKey({ columns: [t.workspaceId, t.userId] }), index('memberships_user_idx').on(t.userId)],
);

export const apiKeys = pgTable(
  'api_keys',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    name: text('name').notNull(),
    /** The first characters of the key, shown in listings so a person can tell keys apart. */
    prefix: text('prefix').notNull(),
    /** SHA-256 of the whole key, hex. The key itself is never stored. */
    keyHash: text('key_hash').notNull(),
    createdByUserId: uuid('created_by_user_id').references(() => users.id, { onDelete: 'set null' }),
    createdAt: createdAt(),
    expiresAt: optionalTime('expires_at'),
    revokedAt: optionalTime('revoked_at'),
    lastUsedAt: optionalTime('last_used_at'),
  },
  (t) => [uniqueIndex('api_keys_key_hash_key').on(t.keyHash), index('api_keys_workspace_idx').on(t.workspaceId)],
);

/**
 * A browser (or other client) signed in as a user. The cookie carries a 32-byte random token; only its
 * SHA-256 is stored. Sliding: every use (kept to the minute) moves `expires_at` to a full lifetime ahead.
 */
export const sessions = pgTable(
  'sessions',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    /** SHA-256 of the session token, hex. */
    tokenHash: text('token_hash').notNull(),
    /** Sent back in X-CSRF-Token on unsafe requests; not a credential on its own. */
    csrfToken: text('csrf_token').notNull(),
    createdAt: createdAt(),
    lastSeenAt: timestamp('last_seen_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow(),
    expiresAt: timestamp('expires_at', { withTimezone: true, mode: 'date' }).notNull(),
    revokedAt: optionalTime('revoked_at'),
    userAgent: text('user_agent'),
  },
  (t) => [uniqueIndex('sessions_token_hash_key').on(t.tokenHash), index('sessions_user_idx').on(t.userId)],
);

/** One-time sign-in links (`/auth/sign-in/<token>`): only the token's SHA-256 is stored. */
export const signInLinks = pgTable(
  'sign_in_links',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    tokenHash: text('token_hash').notNull(),
    expiresAt: timestamp('expires_at', { withTimezone: true, mode: 'date' }).notNull(),
    usedAt: optionalTime('used_at'),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('sign_in_links_token_hash_key').on(t.tokenHash), index('sign_in_links_user_idx').on(t.userId)],
);

/**
 * Failed password sign-ins per subject (an email address, or a client's network), for the exponential
 * backoff of src/engine/users.ts (rules in src/store/sessions.ts). `subject` is a SHA-256, so unknown
 * addresses are not stored. A row whose last failure is two days old says nothing any more and goes.
 */
export const signInThrottles = pgTable(
  'sign_in_throttles',
  {
    subject: text('subject').primaryKey(),
    failures: integer('failures').notNull(),
    lastFailureAt: timestamp('last_failure_at', { withTimezone: true, mode: 'date' }).notNull(),
  },
  (t) => [index('sign_in_throttles_last_failure_idx').on(t.lastFailureAt)],
);

/**
 * Request counts in one-second buckets: the sliding-window rate limit, shared by every process.
 * `key_id` names the subject counted, which is not always a key (the column kept its first name): an
 * API key's id, a signed-in user's id or a runner's id. They are random UUIDs, so subjects never
 * collide; with no foreign key, pruning removes what is left of deleted subjects (src/store/rate-limit.ts).
 */
export const rateLimitBuckets = pgTable(
  'rate_limit_buckets',
  {
    keyId: uuid('key_id').notNull(),
    second: bigint('second', { mode: 'number' }).notNull(),
    count: integer('count').notNull(),
  },
  (t) => [primaryKey({ columns: [t.keyId, t.second] })],
);

export const tasks = pgTable(
  'tasks',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    /** Insertion order: the keyset of cursor pagination (no ties, unlike timestamps). */
    seq: bigint('seq', { mode: 'number' }).notNull().generatedAlwaysAsIdentity(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    slug: text('slug').notNull(),
    title: text('title').notNull(),
    status: text('status').notNull(),
    mode: text('mode').notNull(),
    agent: text('agent').notNull(),
    effort: text('effort').notNull(),
    createdByKeyId: uuid('created_by_key_id').references(() => apiKeys.id, { onDelete: 'set null' }),
    /** The signed-in user who created it; null for tasks created with an API key. */
    createdByUserId: uuid('created_by_user_id').references(() => users.id, { onDelete: 'set null' }),
    /**
     * Local work: the desktop runner and project it runs in (null: the cloud). Only its owner (the
     * runner's user) sees a local task; workspace API keys never do.
     */
    runnerId: uuid('runner_id').references((): AnyPgColumn => runners.id, { onDelete: 'set null' }),
    projectId: uuid('project_id'),
    /** `full`, `auto` or `ask`: how much the local harness may do without asking its owner. */
    permissionMode: text('permission_mode'),
    /** `plan` or `default`: the harness mode the task's runs inherit (a message may override it). */
    nativeMode: text('native_mode'),
    /** The harness session of the task's last local run, for the next one to resume. */
    sessionId: text('session_id'),
    /** The cloud task a local task handed its work to (POST /runs/{id}/delegate); later handoffs continue it. */
    linkedTaskId: uuid('linked_task_id').references((): AnyPgColumn => tasks.id, { onDelete: 'set null' }),
    archivedAt: optionalTime('archived_at'),
    createdAt: createdAt(),
    updatedAt: updatedAt(),
  },
  (t) => [
    uniqueIndex('tasks_workspace_slug_key').on(t.workspaceId, t.slug),
    index('tasks_runner_idx').on(t.runnerId).where(sql`${t.runnerId} is not null`),
    index('tasks_workspace_seq_idx').on(t.workspaceId, t.seq),
    index('tasks_workspace_status_seq_idx').on(t.workspaceId, t.status, t.seq),
  ],
);

/** The task thread: every message a person sent or the agent answered, in order. */
export const messages = pgTable(
  'messages',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    seq: bigint('seq', { mode: 'number' }).notNull().generatedAlwaysAsIdentity(),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    role: text('role', { enum: ['user', 'agent'] }).notNull(),
    body: text('body').notNull(),
    userIntent: text('user_intent'),
    /** `nativeMode` for this turn and `inputContext` (reaches the prompt, not the chat): see MessageMetadata. */
    metadata: jsonb('metadata').$type<{ nativeMode?: 'plan' | 'default'; inputContext?: string }>(),
    createdAt: createdAt(),
  },
  (t) => [index('messages_task_seq_idx').on(t.taskId, t.seq)],
);

export const messageFiles = pgTable(
  'message_files',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    messageId: uuid('message_id').notNull().references(() => messages.id, { onDelete: 'cascade' }),
    position: integer('position').notNull(),
    name: text('name').notNull(),
    /** `inline`: decoded content stored here; `remote`: an http(s) reference, never fetched; `blob`: refused. */
    kind: text('kind', { enum: ['inline', 'remote', 'blob'] }).notNull(),
    mediaType: text('media_type'),
    sizeBytes: integer('size_bytes'),
    sha256: text('sha256'),
    url: text('url'),
    content: bytea('content'),
    createdAt: createdAt(),
  },
  (t) => [index('message_files_message_idx').on(t.messageId, t.position)],
);

export const jobs = pgTable(
  'jobs',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    seq: bigint('seq', { mode: 'number' }).notNull().generatedAlwaysAsIdentity(),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    messageId: uuid('message_id').references(() => messages.id, { onDelete: 'set null' }),
    status: text('status').notNull(),
    type: text('type').notNull(),
    agent: text('agent'),
    agentProvider: text('agent_provider'),
    effort: text('effort'),
    input: text('input'),
    /** Routing-config instructions appended to the task for the agent. */
    instructions: text('instructions'),
    finalAnswer: text('final_answer'),
    plan: text('plan'),
    planOutcome: text('plan_outcome'),
    error: text('error'),
    /** Execution generation: bumped on every claim so a late report from an earlier one is refused. */
    generation: integer('generation').notNull().default(0),
    /** The executor holding the job and until when; an expired lease means the executor is gone. */
    leaseOwner: text('lease_owner'),
    leaseExpiresAt: optionalTime('lease_expires_at'),
    /**
     * A local run: the one runner it is assigned to (never reassigned: losing the network does not let
     * another runner execute it). Null for cloud jobs, which executors claim.
     */
    runnerId: uuid('runner_id').references((): AnyPgColumn => runners.id, { onDelete: 'set null' }),
    /** While IN_PROGRESS on a runner: `executing`, or `syncing` (its process stopped, output pending). */
    runnerState: text('runner_state'),
    /** A wake of a parked session: the runner resumes the kept CLI and sends it nothing. */
    resumeParked: boolean('resume_parked').notNull().default(false),
    /** The run completed while its CLI was kept alive with background work (a later wake resumes it). */
    parked: boolean('parked').notNull().default(false),
    createdAt: createdAt(),
    startedAt: optionalTime('started_at'),
    completedAt: optionalTime('completed_at'),
    updatedAt: updatedAt(),
  },
  (t) => [
    index('jobs_task_seq_idx').on(t.taskId, t.seq),
    index('jobs_pending_idx').on(t.seq).where(sql`${t.status} = 'PENDING'`),
    index('jobs_runner_idx').on(t.runnerId, t.status).where(sql`${t.runnerId} is not null`),
    index('jobs_lease_idx').on(t.leaseExpiresAt).where(sql`${t.status} = 'IN_PROGRESS'`),
  ],
);

/**
 * A repository connected to a workspace. Its origin is the built-in code host's bare repository
 * (`codehost/<workspace id>/<full name>.git` in the data dir); its working copy lives in the workspace
 * environment at `dir`.
 */
export const repositories = pgTable(
  'repositories',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    /** `owner/repo`. */
    fullName: text('full_name').notNull(),
    /** The directory of the working copy inside the environment (one path segment). */
    dir: text('dir').notNull(),
    defaultBranch: text('default_branch').notNull(),
    /** Where the operator connected it from (a git URL or a path), for the record. */
    source: text('source').notNull(),
    /** The last pull request number handed out; numbers count per repository from 1. */
    lastPrNumber: integer('last_pr_number').notNull().default(0),
    createdAt: createdAt(),
  },
  (t) => [
    uniqueIndex('repositories_workspace_full_name_key').on(t.workspaceId, t.fullName),
    uniqueIndex('repositories_workspace_dir_key').on(t.workspaceId, t.dir),
  ],
);

/** A check's run as a pull request's proof records it: the wire shape, stored as it is. */
export type { CheckProof };

export const pullRequests = pgTable(
  'pull_requests',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    /** Set for pull requests on the built-in code host; null for ones reported from elsewhere (runners). */
    repositoryId: uuid('repository_id').references(() => repositories.id, { onDelete: 'set null' }),
    repoFullName: text('repo_full_name').notNull(),
    prNumber: integer('pr_number').notNull(),
    prUrl: text('pr_url').notNull(),
    title: text('title').notNull(),
    state: text('state', { enum: ['open', 'merged', 'closed'] }).notNull(),
    /** Markdown: what changed and the proof. */
    body: text('body'),
    headBranch: text('head_branch'),
    baseBranch: text('base_branch'),
    headSha: text('head_sha'),
    baseSha: text('base_sha'),
    /** The checks that ran on the head commit (the proof). */
    checks: jsonb('checks').$type<CheckProof[]>(),
    /** The job that last pushed to it. */
    jobId: uuid('job_id').references(() => jobs.id, { onDelete: 'set null' }),
    mergedAt: optionalTime('merged_at'),
    closedAt: optionalTime('closed_at'),
    createdAt: createdAt(),
    updatedAt: updatedAt(),
  },
  (t) => [
    uniqueIndex('pull_requests_task_repo_number_key').on(t.taskId, t.repoFullName, t.prNumber),
    uniqueIndex('pull_requests_repository_number_key').on(t.repositoryId, t.prNumber),
  ],
);

/**
 * A task's sandbox fork on one host: kept between the task's jobs, then stopped, archived and deleted
 * by the fork lifecycle (SPEC.md "Sandbox fork lifecycle"). Forks live on the disk of the host that ran
 * the job, so each host's lifecycle ticker handles its own.
 */
export const forks = pgTable(
  'forks',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    taskId: uuid('task_id').references(() => tasks.id, { onDelete: 'set null' }),
    /** Letters, digits, `-` and `_`; unique per workspace and host (a task's fork is named by its slug). */
    name: text('name').notNull(),
    host: text('host').notNull(),
    /** `overlay` or `clone` (the fallback copy). */
    mode: text('mode').notNull(),
    /** `active` (a job runs in it), `idle`, `stopped`, `archived`, `deleted`. */
    state: text('state').notNull(),
    /** The job running in it, while active. */
    jobId: uuid('job_id').references(() => jobs.id, { onDelete: 'set null' }),
    lastUsedAt: timestamp('last_used_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow(),
    stateChangedAt: timestamp('state_changed_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow(),
    createdAt: createdAt(),
  },
  (t) => [
    uniqueIndex('forks_host_workspace_name_key').on(t.host, t.workspaceId, t.name),
    index('forks_host_state_idx').on(t.host, t.state, t.stateChangedAt),
    index('forks_task_idx').on(t.taskId),
  ],
);

export const routingConfigs = pgTable(
  'routing_configs',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    /** `default`, or the trigger keyword without its slash. */
    name: text('name').notNull(),
    mode: text('mode').notNull(),
    agent: text('agent').notNull(),
    effort: text('effort').notNull(),
    instructions: text('instructions'),
    createdAt: createdAt(),
    updatedAt: updatedAt(),
  },
  (t) => [uniqueIndex('routing_configs_workspace_name_key').on(t.workspaceId, t.name)],
);

export const tasksRelations = relations(tasks, ({ many }) => ({
  jobs: many(jobs),
  pullRequests: many(pullRequests),
  messages: many(messages),
}));

export const jobsRelations = relations(jobs, ({ one }) => ({
  task: one(tasks, { fields: [jobs.taskId], references: [tasks.id] }),
}));

export const pullRequestsRelations = relations(pullRequests, ({ one }) => ({
  task: one(tasks, { fields: [pullRequests.taskId], references: [tasks.id] }),
  repository: one(repositories, { fields: [pullRequests.repositoryId], references: [repositories.id] }),
}));

export const messagesRelations = relations(messages, ({ one, many }) => ({
  task: one(tasks, { fields: [messages.taskId], references: [tasks.id] }),
  files: many(messageFiles),
}));

export const messageFilesRelations = relations(messageFiles, ({ one }) => ({
  message: one(messages, { fields: [messageFiles.messageId], references: [messages.id] }),
}));

/**
 * The job journal: every run's events, in order, stored once. `sequence` counts per job from 1; `id`
 * orders the whole journal (a task's jobs run one at a time, so it is also each task's commit order) and
 * is the SSE event id of the logs stream. `digest` is the SHA-256 of the event as it was submitted, so
 * a retried batch can be checked for identical content.
 */
export const jobEvents = pgTable(
  'job_events',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    jobId: uuid('job_id').notNull().references(() => jobs.id, { onDelete: 'cascade' }),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    sequence: integer('sequence').notNull(),
    kind: text('kind').notNull(),
    data: jsonb('data').notNull(),
    digest: text('digest').notNull(),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('job_events_job_sequence_key').on(t.jobId, t.sequence), index('job_events_task_id_idx').on(t.taskId, t.id)],
);

/**
 * The credit ledger: allowances and grants add, model usage subtracts; a workspace's balance is the sum.
 * Amounts are micro-credits (1 credit = 1 USD = 1,000,000).
 */
export const creditEntries = pgTable(
  'credit_entries',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    jobId: uuid('job_id').references(() => jobs.id, { onDelete: 'set null' }),
    kind: text('kind', { enum: ['allowance', 'grant', 'usage'] }).notNull(),
    amountMicro: bigint('amount_micro', { mode: 'number' }).notNull(),
    agent: text('agent'),
    inputTokens: integer('input_tokens'),
    outputTokens: integer('output_tokens'),
    description: text('description'),
    createdAt: createdAt(),
  },
  (t) => [index('credit_entries_workspace_idx').on(t.workspaceId), index('credit_entries_job_idx').on(t.jobId)],
);

/**
 * A desktop runner: one connected computer of one user, in the workspace its heartbeats name (the user's
 * personal workspace to start with). Authenticated by `service_runner_…` credentials the runner makes
 * itself; only the current one's SHA-256 is kept. `work_version` changes whenever the runner's runs do,
 * which is what signals answers compare.
 */
export const runners = pgTable(
  'runners',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    name: text('name').notNull(),
    platform: text('platform'),
    runnerVersion: text('runner_version'),
    /** SHA-256 (hex) of the connection's current credential. */
    credentialHash: text('credential_hash').notNull(),
    capabilities: jsonb('capabilities').notNull().default({}),
    workVersion: bigint('work_version', { mode: 'number' }).notNull().default(0),
    enrolledAt: timestamp('enrolled_at', { withTimezone: true, mode: 'date' }).notNull().defaultNow(),
    revokedAt: optionalTime('revoked_at'),
    lastSeenAt: optionalTime('last_seen_at'),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('runners_credential_hash_key').on(t.credentialHash), index('runners_user_idx').on(t.userId)],
);

/**
 * A pairing code issued through the signed-in setup flow, bound to the runner's challenge, the user and
 * the workspace. Only the code's SHA-256 is stored; it works once, briefly, and a few wrong verifiers
 * burn it.
 */
export const runnerPairings = pgTable(
  'runner_pairings',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    codeHash: text('code_hash').notNull(),
    challenge: text('challenge').notNull(),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    name: text('name'),
    expiresAt: timestamp('expires_at', { withTimezone: true, mode: 'date' }).notNull(),
    usedAt: optionalTime('used_at'),
    failedAttempts: integer('failed_attempts').notNull().default(0),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('runner_pairings_code_hash_key').on(t.codeHash)],
);

/** Enrollment receipts by the credential they enrolled: a retry with that credential gets the same one. */
export const runnerEnrollments = pgTable(
  'runner_enrollments',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    runnerId: uuid('runner_id').notNull().references(() => runners.id, { onDelete: 'cascade' }),
    credentialHash: text('credential_hash').notNull(),
    receipt: jsonb('receipt').notNull(),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('runner_enrollments_credential_hash_key').on(t.credentialHash)],
);

/** Local projects a runner registered: stable ids the runner made, never native paths. */
export const runnerProjects = pgTable(
  'runner_projects',
  {
    runnerId: uuid('runner_id').notNull().references(() => runners.id, { onDelete: 'cascade' }),
    id: uuid('id').notNull(),
    name: text('name').notNull(),
    /** `[{ name: owner/repo, remoteUrl?, defaultBranch? }]`; empty for the projectless environment. */
    repositories: jsonb('repositories').notNull().default([]),
    createdAt: createdAt(),
    updatedAt: updatedAt(),
  },
  (t) => [primaryKey({ columns: [t.runnerId, t.id] })],
);

/** Controls for a run, in order: permission answers, async question answers, finish_background_wait. */
export const runControls = pgTable(
  'run_controls',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    jobId: uuid('job_id').notNull().references(() => jobs.id, { onDelete: 'cascade' }),
    sequence: integer('sequence').notNull(),
    type: text('type').notNull(),
    message: jsonb('message').notNull(),
    createdAt: createdAt(),
  },
  (t) => [
    uniqueIndex('run_controls_job_sequence_key').on(t.jobId, t.sequence),
    // SPEC.md: finish_background_wait is sent at most once per run.
    uniqueIndex('run_controls_finish_once_key').on(t.jobId).where(sql`${t.type} = 'finish_background_wait'`),
  ],
);

/**
 * Parts of a large event being staged (SPEC.md "Large events"): held until the event's reference arrives
 * in a batch and the whole entry checks out, then dropped. Readers never see them.
 */
export const eventParts = pgTable(
  'event_parts',
  {
    jobId: uuid('job_id').notNull().references(() => jobs.id, { onDelete: 'cascade' }),
    generation: integer('generation').notNull(),
    sequence: integer('sequence').notNull(),
    part: integer('part').notNull(),
    digest: text('digest').notNull(),
    sizeBytes: integer('size_bytes').notNull(),
    data: bytea('data').notNull(),
    createdAt: createdAt(),
  },
  (t) => [primaryKey({ columns: [t.jobId, t.generation, t.sequence, t.part] })],
);

/**
 * What a local run asks its owner: permissions (some of them questions) and async questions, kept apart
 * from the trace with their answers. A permission is pending until answered or cleared (syncing clears
 * what is still pending).
 */
export const localRequests = pgTable(
  'local_requests',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    jobId: uuid('job_id').notNull().references(() => jobs.id, { onDelete: 'cascade' }),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    /** The runner's id for the request (a permission's, or the native message item of an async question). */
    requestId: text('request_id').notNull(),
    kind: text('kind', { enum: ['permission', 'question', 'async_question'] }).notNull(),
    tool: text('tool'),
    /** `{ questions, input }` as the runner sent them. */
    payload: jsonb('payload').notNull(),
    status: text('status', { enum: ['pending', 'answered', 'cleared'] }).notNull(),
    answer: jsonb('answer'),
    answeredByUserId: uuid('answered_by_user_id').references(() => users.id, { onDelete: 'set null' }),
    createdAt: createdAt(),
    answeredAt: optionalTime('answered_at'),
  },
  (t) => [uniqueIndex('local_requests_job_request_key').on(t.jobId, t.requestId), index('local_requests_task_idx').on(t.taskId)],
);

/** A browser that cannot reach the computer asks the runner for a file of a local task. */
export const reviewRequests = pgTable(
  'review_requests',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    runnerId: uuid('runner_id').notNull().references(() => runners.id, { onDelete: 'cascade' }),
    taskId: uuid('task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    jobId: uuid('job_id').references(() => jobs.id, { onDelete: 'set null' }),
    path: text('path').notNull(),
    status: text('status', { enum: ['pending', 'answered', 'failed'] }).notNull(),
    content: bytea('content'),
    message: text('message'),
    createdByUserId: uuid('created_by_user_id').references(() => users.id, { onDelete: 'set null' }),
    /** When a signals answer last carried it: a pending request wakes long polls again only after a while. */
    deliveredAt: optionalTime('delivered_at'),
    createdAt: createdAt(),
    answeredAt: optionalTime('answered_at'),
  },
  (t) => [index('review_requests_runner_status_idx').on(t.runnerId, t.status)],
);

/** Cloud delegations of local runs, deduplicated by the local task and the model's invocation id. */
export const delegations = pgTable(
  'delegations',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    localTaskId: uuid('local_task_id').notNull().references(() => tasks.id, { onDelete: 'cascade' }),
    invocationId: text('invocation_id').notNull(),
    /** SHA-256 of the request's input: a retry must repeat it exactly. */
    inputDigest: text('input_digest').notNull(),
    cloudTaskId: uuid('cloud_task_id').references(() => tasks.id, { onDelete: 'set null' }),
    /** The queued job of the cloud task, once dispatched. */
    dispatchedJobId: uuid('dispatched_job_id').references(() => jobs.id, { onDelete: 'set null' }),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('delegations_task_invocation_key').on(t.localTaskId, t.invocationId)],
);

/** Temporary workspace SSH access (60 minutes): a token scoped to one workspace, issued to a local run. */
export const workspaceSshGrants = pgTable(
  'workspace_ssh_grants',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    tokenHash: text('token_hash').notNull(),
    userId: uuid('user_id').notNull().references(() => users.id, { onDelete: 'cascade' }),
    workspaceId: uuid('workspace_id').notNull().references(() => workspaces.id, { onDelete: 'cascade' }),
    runnerId: uuid('runner_id').references(() => runners.id, { onDelete: 'set null' }),
    jobId: uuid('job_id').references(() => jobs.id, { onDelete: 'set null' }),
    expiresAt: timestamp('expires_at', { withTimezone: true, mode: 'date' }).notNull(),
    revokedAt: optionalTime('revoked_at'),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex('workspace_ssh_grants_token_hash_key').on(t.tokenHash)],
);
