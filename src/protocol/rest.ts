/**
 * Wire schemas of the cloud REST API (/api/v1). The server validates with these, the OpenAPI document is
 * generated from them, and the CLI, runner and web app import the same definitions.
 */
import { z } from 'zod';

export const JobStatus = z.enum(['PENDING', 'IN_PROGRESS', 'COMPLETED', 'FAILED', 'CANCELLED']).meta({ id: 'JobStatus' });
export type JobStatus = z.infer<typeof JobStatus>;

/**
 * Task statuses (the spec leaves the set open; see docs/api.md for the state machine).
 * PENDING: a job is queued. IN_PROGRESS: a job runs. AWAITING_INPUT: the agent asked a question.
 * AWAITING_APPROVAL: a plan is READY. IN_REVIEW: pull requests are open. COMPLETED, FAILED, CANCELLED.
 */
export const TaskStatus = z
  .enum(['PENDING', 'IN_PROGRESS', 'AWAITING_INPUT', 'AWAITING_APPROVAL', 'IN_REVIEW', 'COMPLETED', 'FAILED', 'CANCELLED'])
  .meta({ id: 'TaskStatus' });
export type TaskStatus = z.infer<typeof TaskStatus>;

/** Run types a job can have; `userIntent` values name the first four. */
export const JobType = z.enum(['SWE', 'PLAN', 'ASK', 'DEV_ENVIRONMENT', 'GOAL', 'IMPLEMENT_PLAN']).meta({ id: 'JobType' });
export type JobType = z.infer<typeof JobType>;

export const UserIntent = z.enum(['PLAN', 'SWE', 'ASK', 'DEV_ENVIRONMENT', 'GOAL']).meta({ id: 'UserIntent' });
export type UserIntent = z.infer<typeof UserIntent>;

export const TaskMode = z.enum(['agent', 'plan', 'ask', 'goal', 'dev_env']).meta({ id: 'TaskMode' });
export type TaskMode = z.infer<typeof TaskMode>;

export const RoutingMode = z.enum(['agent', 'plan', 'ask', 'goal']).meta({ id: 'RoutingMode' });
export type RoutingMode = z.infer<typeof RoutingMode>;

export const Effort = z.enum(['low', 'medium', 'high', 'xhigh', 'ultracode']).meta({ id: 'Effort' });
export type Effort = z.infer<typeof Effort>;

export const PlanOutcome = z.enum(['READY', 'NATIVE', 'APPROVED']).meta({ id: 'PlanOutcome' });
export type PlanOutcome = z.infer<typeof PlanOutcome>;

export const PullRequestState = z.enum(['open', 'merged', 'closed']);
export type PullRequestState = z.infer<typeof PullRequestState>;

const DateTime = z.iso.datetime({ offset: true });

export const PullRequest = z
  .object({
    repoFullName: z.string(),
    prNumber: z.number().int(),
    prUrl: z.string(),
    title: z.string(),
    state: PullRequestState,
  })
  .meta({ id: 'PullRequest' });
export type PullRequest = z.infer<typeof PullRequest>;

export const Task = z
  .object({
    id: z.uuid(),
    slug: z.string().describe('Human-readable identifier, unique in the workspace; accepted wherever a task id is'),
    title: z.string(),
    url: z.string(),
    status: TaskStatus,
    mode: TaskMode,
    agent: z.string().describe('Complete `<provider>/<model>` id; follow-ups keep it'),
    effort: Effort,
    archived: z.boolean(),
    createdAt: DateTime,
    updatedAt: DateTime,
    prs: z.array(PullRequest),
  })
  .meta({ id: 'Task' });
export type Task = z.infer<typeof Task>;

export const Job = z
  .object({
    id: z.uuid(),
    status: JobStatus,
    type: JobType,
    agentProvider: z.string().nullable(),
    agent: z.string().nullable(),
    input: z.string().nullable().describe('Text extracted from the user message that queued the job'),
    finalAnswer: z.string().nullable(),
    plan: z.string().nullable(),
    planOutcome: PlanOutcome.nullable(),
    error: z.string().nullable(),
    createdAt: DateTime,
    startedAt: DateTime.nullable(),
    completedAt: DateTime.nullable(),
  })
  .meta({ id: 'Job' });
export type Job = z.infer<typeof Job>;

export const TaskListItem = Task.extend({
  latestJobStatus: JobStatus.nullable(),
}).meta({ id: 'TaskListItem' });
export type TaskListItem = z.infer<typeof TaskListItem>;

/** Attachment limits: documented in docs/api.md. */
export const FILE_LIMITS = {
  maxFiles: 10,
  maxFileBytes: 10 * 1024 * 1024,
  maxTotalBytes: 25 * 1024 * 1024,
  /** Body limit for routes that take files: the decoded total as base64 plus room for the rest. */
  bodyLimitBytes: 36 * 1024 * 1024,
} as const;

export const FileInput = z
  .object({
    name: z.string().trim().min(1).max(255).optional().describe('File name; derived from the URL when absent'),
    url: z
      .string()
      .min(1)
      .describe(
        '`data:` URL with the inlined content (stored), `http(s):` URL (kept as a reference, never fetched) or a ' +
          'browser `blob:` URL (not an uploaded file: the task fails, naming the file)',
      ),
  })
  .meta({ id: 'FileInput' });
export type FileInput = z.infer<typeof FileInput>;

const Files = z.array(FileInput).max(FILE_LIMITS.maxFiles);

export const AgentId = z
  .string()
  .describe('Complete `<provider>/<model>` id, e.g. `anthropic/claude-sonnet-4-5`; a provider alone is rejected');

/** How much a local harness may do without asking its owner (docs/runner-protocol.md). */
export const PermissionMode = z.enum(['full', 'auto', 'ask']).meta({ id: 'PermissionMode' });
export type PermissionMode = z.infer<typeof PermissionMode>;
/** A local harness's own mode: its plan mode, or its default. */
export const NativeMode = z.enum(['plan', 'default']).meta({ id: 'NativeMode' });
export type NativeMode = z.infer<typeof NativeMode>;

export const MessageMetadata = z
  .object({
    nativeMode: NativeMode.optional().describe("Local tasks: the harness mode for this turn, overriding the task's"),
    inputContext: z.string().max(200_000).optional().describe('Reaches the prompt, not the chat (a handoff brief)'),
  })
  .meta({ id: 'MessageMetadata' });
export type MessageMetadata = z.infer<typeof MessageMetadata>;

/** Where a local task runs: a desktop runner of the signed-in user and one of its projects. */
export const LocalTarget = z
  .object({
    runnerId: z.uuid(),
    projectId: z.uuid(),
    permissionMode: PermissionMode.default('ask'),
    nativeMode: NativeMode.optional(),
  })
  .meta({ id: 'LocalTarget' });
export type LocalTarget = z.infer<typeof LocalTarget>;

export const CreateTaskBody = z
  .object({
    command: z.string().describe('The prompt; may start with `/trigger` to select a routing config'),
    userIntent: UserIntent.optional().describe('Sets the initial run type instead of the routing config'),
    agent: AgentId.optional(),
    effort: Effort.optional(),
    title: z.string().trim().min(1).max(200).optional(),
    files: Files.optional(),
    local: LocalTarget.optional().describe('Run it on a desktop runner of the signed-in user (sessions only; docs/runner-protocol.md)'),
  })
  .meta({ id: 'CreateTaskBody' });
export type CreateTaskBody = z.infer<typeof CreateTaskBody>;

export const TaskAndJob = z
  .object({ task: Task, job: Job })
  .meta({ id: 'TaskAndJob', description: 'The task and the job this request queued' });
export type TaskAndJob = z.infer<typeof TaskAndJob>;

export const ListTasksQuery = z.object({
  limit: z.coerce.number().int().min(1).max(100).default(30),
  cursor: z.string().min(1).optional(),
  status: z
    .string()
    .optional()
    .describe('One task status or several separated by commas, e.g. `PENDING,IN_PROGRESS`'),
  archived: z
    .enum(['exclude', 'include', 'only'])
    .default('exclude')
    .describe('Archived tasks are left out unless `include` or `only` is given'),
});
export type ListTasksQuery = z.infer<typeof ListTasksQuery>;

export const ListTasksResponse = z
  .object({ tasks: z.array(TaskListItem), nextCursor: z.string().nullable() })
  .meta({ id: 'ListTasksResponse', description: 'A page of tasks, newest first; `nextCursor` is null on the last page' });
export type ListTasksResponse = z.infer<typeof ListTasksResponse>;

export const TaskParams = z.object({
  taskIdOrSlug: z.string().min(1).max(200).describe('Task UUID or slug'),
});

export const GetTaskResponse = z
  .object({ task: Task, latestJob: Job.nullable() })
  .meta({ id: 'GetTaskResponse', description: 'The task and its latest job (null only for a task without jobs)' });
export type GetTaskResponse = z.infer<typeof GetTaskResponse>;

export const ListJobsQuery = z.object({
  limit: z.coerce.number().int().min(1).max(100).default(30),
  cursor: z.string().min(1).optional(),
});
export type ListJobsQuery = z.infer<typeof ListJobsQuery>;

export const ListJobsResponse = z
  .object({
    jobs: z.array(Job).describe('Newest page first; chronological within a page'),
    nextCursor: z.string().nullable().describe('Cursor for the page of older jobs; null when none remain'),
  })
  .meta({ id: 'ListJobsResponse', description: 'A page of jobs: the newest page first, chronological within a page' });
export type ListJobsResponse = z.infer<typeof ListJobsResponse>;

export const SendMessageBody = z
  .object({
    message: z.string().describe('The follow-up text: an answer, a change request or a redirection'),
    userIntent: z.enum(['PLAN', 'SWE', 'ASK', 'DEV_ENVIRONMENT']).optional().describe('Switches the run type'),
    files: Files.optional(),
    metadata: MessageMetadata.optional(),
  })
  .meta({ id: 'SendMessageBody' });
export type SendMessageBody = z.infer<typeof SendMessageBody>;

export const ApprovePlanBody = z
  .object({
    message: z.string().max(100_000).optional().describe('Optional extra instructions for the implementation'),
  })
  .meta({ id: 'ApprovePlanBody' });
export type ApprovePlanBody = z.infer<typeof ApprovePlanBody>;

export const CancelTaskResponse = z
  .object({ task: Task, cancelledJobs: z.array(Job) })
  .meta({ id: 'CancelTaskResponse', description: 'The cancelled task and the jobs this request cancelled (none when it already was)' });
export type CancelTaskResponse = z.infer<typeof CancelTaskResponse>;

export const TaskResponse = z.object({ task: Task }).meta({ id: 'TaskResponse', description: 'The task' });
export type TaskResponse = z.infer<typeof TaskResponse>;

export const RoutingConfig = z
  .object({
    name: z.string(),
    trigger: z.string().nullable().describe('`/name`; null for the `default` config'),
    mode: RoutingMode,
    agent: z.string(),
    effort: Effort,
    instructions: z.string().nullable(),
    createdAt: DateTime,
    updatedAt: DateTime,
  })
  .meta({ id: 'RoutingConfig' });
export type RoutingConfig = z.infer<typeof RoutingConfig>;

export const RoutingConfigParams = z.object({
  name: z.string().describe('Trigger keyword without the slash, or `default`'),
});

export const PutRoutingConfigBody = z
  .object({
    mode: RoutingMode,
    agent: AgentId,
    effort: Effort,
    instructions: z.string().max(20_000).nullable().optional(),
  })
  .meta({ id: 'PutRoutingConfigBody' });
export type PutRoutingConfigBody = z.infer<typeof PutRoutingConfigBody>;

export const ListRoutingConfigsResponse = z
  .object({ routingConfigs: z.array(RoutingConfig) })
  .meta({ id: 'ListRoutingConfigsResponse', description: 'Every routing config of the workspace by name, `default` included' });

export const RoutingConfigResponse = z
  .object({ routingConfig: RoutingConfig })
  .meta({ id: 'RoutingConfigResponse', description: 'The routing config as stored' });

export const Repository = z
  .object({
    fullName: z.string().describe('`owner/repo`; `svc/environment` is the environment\'s own repository'),
    dir: z.string().describe('Its directory in the workspace environment (`.` for the environment repository)'),
    defaultBranch: z.string(),
    createdAt: DateTime,
  })
  .meta({ id: 'Repository' });
export type Repository = z.infer<typeof Repository>;

export const ListRepositoriesResponse = z
  .object({ repositories: z.array(Repository) })
  .meta({ id: 'ListRepositoriesResponse', description: 'The repositories connected to the workspace' });

export const ConnectRepositoryBody = z
  .object({
    source: z
      .string()
      .trim()
      .min(1)
      .max(2048)
      .describe(
        'A git URL (`https://`, `http://`, `ssh://`, `git://` or `user@host:owner/repo`) or, where the operator allows it ' +
          '(SVC_REPO_PATHS), an absolute path of a repository on the server',
      ),
    name: z.string().optional().describe('`owner/repo`; derived from a URL, or `local/<directory>` for a path, when absent'),
    setup: z.boolean().default(true).describe("Run the setup commands detected for it now (the request waits for them)"),
  })
  .meta({ id: 'ConnectRepositoryBody' });
export type ConnectRepositoryBody = z.infer<typeof ConnectRepositoryBody>;

export const SetupResult = z
  .object({
    repository: z.string(),
    command: z.string(),
    passed: z.boolean(),
    exitCode: z.number().int().nullable(),
    outputTail: z.string().describe('The last lines of its output'),
  })
  .meta({ id: 'SetupResult' });
export type SetupResult = z.infer<typeof SetupResult>;

export const ConnectRepositoryResponse = z
  .object({ repository: Repository, setup: z.array(SetupResult).describe('Each setup command run, in order; empty when none ran') })
  .meta({ id: 'ConnectRepositoryResponse', description: 'The connected repository and its setup' });

export const CheckProof = z
  .object({
    name: z.string(),
    command: z.string(),
    passed: z.boolean(),
    exitCode: z.number().int().nullable(),
    timedOut: z.boolean(),
    durationMs: z.number().int(),
    outputTail: z.string().describe('The last lines of its output'),
  })
  .meta({ id: 'CheckProof' });
export type CheckProof = z.infer<typeof CheckProof>;

export const PullRequestDetail = PullRequest.extend({
  taskId: z.uuid(),
  body: z.string().nullable().describe('Markdown: what changed and the proof'),
  headBranch: z.string().nullable(),
  baseBranch: z.string().nullable(),
  headSha: z.string().nullable(),
  baseSha: z.string().nullable(),
  checks: z.array(CheckProof).describe('The checks that ran on the head commit'),
  createdAt: DateTime,
  updatedAt: DateTime,
  mergedAt: DateTime.nullable(),
  closedAt: DateTime.nullable(),
}).meta({ id: 'PullRequestDetail' });
export type PullRequestDetail = z.infer<typeof PullRequestDetail>;

export const PullRequestParams = z.object({
  owner: z.string().min(1).max(100),
  repo: z.string().min(1).max(100),
  number: z.coerce.number().int().min(1).max(2_147_483_647),
});

export const RepositoryParams = PullRequestParams.omit({ number: true });

export const ListPullRequestsQuery = z.object({
  state: PullRequestState.optional(),
  limit: z.coerce.number().int().min(1).max(100).default(30),
});

export const ListPullRequestsResponse = z
  .object({ pullRequests: z.array(PullRequestDetail) })
  .meta({ id: 'ListPullRequestsResponse', description: 'Pull requests, newest first' });

export const PullRequestResponse = z
  .object({ pullRequest: PullRequestDetail })
  .meta({ id: 'PullRequestResponse', description: 'The pull request as stored' });

export const PullRequestWithDiffResponse = z
  .object({ pullRequest: PullRequestDetail, diff: z.string().describe('Unified diff of the head against its base') })
  .meta({ id: 'PullRequestWithDiffResponse', description: 'The pull request and its diff' });
