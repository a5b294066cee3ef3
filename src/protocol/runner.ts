/**
 * Wire schemas of the local runner protocol (SPEC.md "Local runner protocol", docs/runner-protocol.md):
 * what a desktop runner sends to `{base_url}/runners/…` and what it gets back, plus the signed-in user's
 * side of local work under /api/v1. The server validates with these and `svc runner` speaks them.
 */
import { z } from 'zod';
import { Effort, JobStatus, JobType, NativeMode, PermissionMode, PlanOutcome, PullRequest, PullRequestState, TaskMode } from './rest.js';

export { LocalTarget, MessageMetadata, NativeMode, PermissionMode } from './rest.js';

const KiB = 1024;
const MiB = 1024 * KiB;

/** Every bound of the protocol in one place (SPEC.md "Limits"; the rest decided in docs/runner-protocol.md). */
export const RUNNER_LIMITS = {
  modelsPerHarness: 2_000,
  /** Registration (enroll) and heartbeat request bodies. */
  registrationBytes: 4 * MiB,
  /** A POST /events request, all batches together. */
  eventBatchBytes: 4 * MiB,
  maxWaitMs: 10_000,
  /** An event whose journal entry `{ sequence, event }` is larger than this goes in parts. */
  inlineEventBytes: 240 * KiB,
  /** The decoded data of one part. */
  partDataBytes: 192 * KiB,
  /** One logical event, staged in parts. */
  logicalEventBytes: 32 * MiB,
  pullRequestsPerReport: 50,
  commandInventory: 500,
  delegateBytes: 256 * KiB,
  delegationTitle: 100,
  /** A pairing code lives this long (SPEC.md leaves it open). */
  pairingCodeTtlMs: 10 * 60_000,
  /** Wrong verifiers a pairing code takes before it is burnt. */
  pairingAttempts: 5,
  /** Temporary workspace SSH access (SPEC.md: 60 minutes). */
  sshAccessTtlMs: 60 * 60_000,
  /** Runs a signals request may name. */
  signalRuns: 200,
  /**
   * Runs one GET /runs lists at the most, and runs a runner may hold at once (claimed, or cancelled before
   * their receipt): held runs are always listed, so a claim past this is refused.
   */
  listedRuns: 100,
  projectsPerRunner: 200,
  repositoriesPerProject: 50,
  /** A review request's answer (file content). */
  reviewAnswerBytes: 4 * MiB,
  /** What one workspace shell command may read on stdin, and keeps of each of its outputs. */
  shellStdinBytes: 1 * MiB,
  shellOutputBytes: 1 * MiB,
  /** The longest a workspace shell command may run (also its grant's fork outlives the grant by this). */
  shellTimeoutSeconds: 600,
} as const;

/** The largest sequence, generation, cursor or part number: each is stored as a PostgreSQL `integer`. */
export const MAX_COUNTER = 2_147_483_647;
/** A non-negative whole number up to MAX_COUNTER, at least `min`. */
const Counter = (min: 0 | 1) => z.number().int().min(min).max(MAX_COUNTER);

/** NUL and unpaired surrogates: characters PostgreSQL cannot store (jsonb refuses both, text NUL). */
export const UNSTORABLE_CHARACTERS = /\u0000|[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;

/** Text the server stores and hands back exactly: an identifier, which a replaced character would change. */
export const StorableText = (min: number, max: number) =>
  z
    .string()
    .min(min)
    .max(max)
    .refine((value) => !UNSTORABLE_CHARACTERS.test(value), 'must not contain NUL characters or unpaired surrogates');

/** Runner credentials: `service_runner_` and at least 43 URL-safe characters (256 bits), made by the runner. */
export const RUNNER_CREDENTIAL_PREFIX = 'service_runner_';
export const RunnerCredential = z
  .string()
  .regex(/^service_runner_[A-Za-z0-9_-]{43,128}$/, 'must be service_runner_ and 43-128 URL-safe characters');

/** The runner's private verifier (43-128 URL-safe characters); its challenge is base64url(SHA-256(verifier)). */
export const PairingVerifier = z.string().regex(/^[A-Za-z0-9_-]{43,128}$/, 'must be 43-128 URL-safe characters');
export const PairingChallenge = z.string().regex(/^[A-Za-z0-9_-]{43}$/, 'must be base64url(SHA-256(verifier)): 43 characters');
/** Eight characters from an alphabet without look-alikes, shown as `ABCD-EFGH`; dashes and case are ignored. */
export const PairingCode = z.string().trim().min(8).max(16);

/** Harness ids as the runner names them: `claude-code`, `codex`, `openai`, `anthropic`, `openai-compatible`. */
export const HarnessId = z.string().regex(/^[a-z0-9][a-z0-9-]{0,63}$/, 'lower-case letters, digits and -');

/** A model of a harness, by its native id (no harness prefix). */
export const ModelEntry = z.object({ id: z.string().min(1).max(200), name: z.string().min(1).max(200) });

export const CommandEntry = z.object({
  name: z.string().min(1).max(200),
  description: z.string().max(2_000).optional(),
  argumentHint: z.string().max(500).optional(),
  source: z.enum(['builtin', 'skill', 'custom', 'plugin', 'mcp']),
});
export type CommandEntry = z.infer<typeof CommandEntry>;

export const NativeControls = z.object({
  /** The control types this harness takes (`permission`, `async_question_answer`, `finish_background_wait`). */
  commands: z.array(z.string().min(1).max(100)).max(100).default([]),
  fullAccess: z.boolean().default(false),
  questions: z.boolean().default(false),
  harnessCommands: z.array(CommandEntry).max(RUNNER_LIMITS.commandInventory).optional(),
  sessionFork: z.boolean().optional(),
  finishBackgroundWait: z.boolean().optional(),
  asyncQuestions: z.boolean().optional(),
});
export type NativeControls = z.infer<typeof NativeControls>;

/**
 * What a runner can do. `models` per harness: an absent `models` (or an absent harness in it) keeps
 * compatibility with older runners (no catalog: dispatch does not check); an explicit empty list means
 * the harness has no models.
 */
export const Capabilities = z.object({
  models: z.record(HarnessId, z.array(ModelEntry).max(RUNNER_LIMITS.modelsPerHarness)).optional(),
  modelSource: z.enum(['discovered', 'configured', 'fallback']).optional(),
  nativeControls: z.record(HarnessId, NativeControls).optional(),
});
export type Capabilities = z.infer<typeof Capabilities>;

/** A text that must not be (or hold) an absolute native path: project registrations never carry one. */
const NotAPath = (max: number) =>
  z
    .string()
    .min(1)
    .max(max)
    .refine((value) => !/^(\/|~|[A-Za-z]:[\\/]|\\\\)/.test(value.trim()), 'must not be a native path');

export const ProjectRepository = z.object({
  /** `owner/repo`, from its code-host remote. */
  name: z.string().regex(/^[A-Za-z0-9_.-]{1,100}\/[A-Za-z0-9_.-]{1,100}$/, 'must be owner/repo'),
  /** The remote's URL (never a local path). */
  remoteUrl: z
    .string()
    .max(2_000)
    .regex(/^(?:(?:https?|ssh|git):\/\/|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:)/, 'must be a network git URL')
    .optional(),
  defaultBranch: z.string().min(1).max(255).optional(),
});
export type ProjectRepository = z.infer<typeof ProjectRepository>;

/**
 * A local project as the runner registers it: a stable id the runner made, a display name, and its
 * repositories. An empty `repositories` array is the runner's projectless environment.
 */
export const ProjectRegistration = z.object({
  id: z.uuid(),
  name: NotAPath(200),
  repositories: z.array(ProjectRepository).max(RUNNER_LIMITS.repositoriesPerProject),
});
export type ProjectRegistration = z.infer<typeof ProjectRegistration>;

const Projects = z.array(ProjectRegistration).max(RUNNER_LIMITS.projectsPerRunner);

export const EnrollBody = z
  .object({
    pairingCode: PairingCode,
    verifier: PairingVerifier,
    /** The connection's new credential, made by the runner; only its hash is stored. */
    credential: RunnerCredential,
    /** The computer's name as the user sees it. */
    name: NotAPath(100),
    platform: z.string().max(100).optional(),
    runnerVersion: z.string().max(100).optional(),
    capabilities: Capabilities.optional(),
    projects: Projects.optional(),
    /** Reconnecting a connection the user revoked: the previous credential, with every process group stopped. */
    reconnect: z.object({ runnerId: z.uuid(), credential: RunnerCredential, stopped: z.literal(true) }).optional(),
  })
  .meta({ id: 'RunnerEnrollBody' });
export type EnrollBody = z.infer<typeof EnrollBody>;

/** The enrollment receipt: the same answer for a retry with the same credential. */
export const EnrollmentReceipt = z
  .object({
    runnerId: z.uuid(),
    userId: z.uuid(),
    workspaceId: z.uuid(),
    name: z.string(),
    enrolledAt: z.iso.datetime({ offset: true }),
    reconnected: z.boolean(),
    /** Runs of the old connection that the reconnect finalized (each once). */
    finalizedRuns: z.array(z.uuid()),
    heartbeatIntervalMs: z.number().int(),
  })
  .meta({ id: 'RunnerEnrollmentReceipt', description: 'The enrollment receipt; a retry with the same credential gets this same receipt' });
export type EnrollmentReceipt = z.infer<typeof EnrollmentReceipt>;

export const Identity = z
  .object({ runnerId: z.uuid(), workspaceId: z.uuid(), userId: z.uuid(), revoked: z.boolean() })
  .meta({ id: 'RunnerIdentity', description: 'The connection the presented credential belongs to, revoked or not' });
export type Identity = z.infer<typeof Identity>;

export const HeartbeatBody = z
  .object({
    workspaceId: z.uuid(),
    capabilities: Capabilities.optional(),
    projects: Projects.optional(),
    runnerVersion: z.string().max(100).optional(),
  })
  .meta({ id: 'RunnerHeartbeatBody' });
export type HeartbeatBody = z.infer<typeof HeartbeatBody>;

export const HeartbeatResponse = z
  .object({
    runnerId: z.uuid(),
    workspaceId: z.uuid(),
    /** The runner's work version: list /runs again when it differs from the last one listed. */
    version: z.string(),
    heartbeatIntervalMs: z.number().int(),
    serverTime: z.iso.datetime({ offset: true }),
  })
  .meta({ id: 'RunnerHeartbeatResponse', description: 'The workspace the runner works for now, its work version, and when to beat again' });
export type HeartbeatResponse = z.infer<typeof HeartbeatResponse>;


/** Run states as the runner sees them. */
export const RunState = z.enum(['queued', 'executing', 'syncing', 'cancelled', 'completed', 'failed']);
export type RunState = z.infer<typeof RunState>;


/** A run as the runner lists and claims it: everything it needs to execute it, and nothing of the server's. */
export const RunManifest = z
  .object({
    runId: z.uuid(),
    taskId: z.uuid(),
    taskSlug: z.string(),
    title: z.string(),
    state: RunState,
    /** The execution generation; 0 until claimed. Every later request names it. */
    generation: Counter(0),
    type: JobType,
    mode: TaskMode,
    projectId: z.uuid(),
    harness: HarnessId,
    model: z.string(),
    effort: Effort,
    permissionMode: PermissionMode,
    nativeMode: NativeMode.nullable(),
    /** The message that queued the run (for a parked wake, a marker: nothing is sent). */
    input: z.string(),
    /** The message's metadata (`MessageMetadata`): the turn's `nativeMode`, a handoff's `inputContext`. */
    metadata: z.object({ nativeMode: NativeMode.optional(), inputContext: z.string().optional() }).nullable(),
    /** Earlier turns of the task's thread, oldest first. */
    history: z.array(z.object({ role: z.enum(['user', 'assistant']), content: z.string() })),
    /** The harness session of the task's previous run, to resume (null: a new session). */
    sessionId: z.string().nullable(),
    /** Resume a parked CLI in its kept process (a wake); its input is a marker and nothing is sent. */
    resumeParked: z.boolean(),
    /** Events the journal already holds for this run: the next one is this plus one. */
    eventsStored: Counter(0),
    createdAt: z.iso.datetime({ offset: true }),
  })
  .meta({ id: 'RunManifest' });
export type RunManifest = z.infer<typeof RunManifest>;

export const ListRunsResponse = z
  .object({ runs: z.array(RunManifest), version: z.string() })
  .meta({ id: 'ListRunsResponse', description: "The runner's queued, executing and syncing runs (and cancelled ones it still holds), oldest first, and its work version" });
export type ListRunsResponse = z.infer<typeof ListRunsResponse>;

export const ClaimResponse = z.object({ run: RunManifest }).meta({ id: 'RunClaimResponse', description: 'The claimed run under its new generation' });
export type ClaimResponse = z.infer<typeof ClaimResponse>;

export const GenerationBody = z.object({ generation: Counter(1) }).meta({ id: 'RunGenerationBody' });
export type GenerationBody = z.infer<typeof GenerationBody>;

export const QuestionOption = z.object({ label: z.string().min(1).max(500), description: z.string().max(2_000).optional() });
export const Question = z.object({
  /** Answers name it: kept exactly (StorableText). */
  id: StorableText(1, 200),
  question: z.string().min(1).max(10_000),
  header: z.string().max(200).optional(),
  options: z.array(QuestionOption).max(50),
  multiple: z.boolean(),
  allowCustom: z.boolean(),
});
export type Question = z.infer<typeof Question>;

/** Answers to questions: per question, the selected labels or a custom response. */
export const QuestionAnswer = z.object({ questionId: z.string().min(1).max(200), values: z.array(z.string().min(1).max(10_000)).min(1).max(50) });
export type QuestionAnswer = z.infer<typeof QuestionAnswer>;

/** Controls flowing to the runner, ordered per run (SPEC.md "Events": controls). */
export const ControlMessage = z.discriminatedUnion('type', [
  z.object({
    type: z.literal('permission'),
    requestId: z.string(),
    decision: z.enum(['allow', 'deny']),
    answers: z.array(QuestionAnswer).optional(),
  }),
  z.object({ type: z.literal('async_question_answer'), id: z.string(), requestId: z.string(), text: z.string() }),
  z.object({ type: z.literal('finish_background_wait') }),
]);
export type ControlMessage = z.infer<typeof ControlMessage>;

export const Control = z.object({ runId: z.uuid(), sequence: Counter(1), message: ControlMessage }).meta({ id: 'RunControl' });
export type Control = z.infer<typeof Control>;

export const ReviewRequest = z
  .object({ id: z.uuid(), runId: z.uuid().nullable(), taskId: z.uuid(), path: z.string(), createdAt: z.iso.datetime({ offset: true }) })
  .meta({ id: 'ReviewRequest' });
export type ReviewRequest = z.infer<typeof ReviewRequest>;

export const SignalsBody = z
  .object({
    runs: z.array(z.object({ runId: z.uuid(), after: Counter(0) })).max(RUNNER_LIMITS.signalRuns),
    version: z.string().max(40).nullable(),
    waitMs: z.number().int().min(0).max(RUNNER_LIMITS.maxWaitMs),
  })
  .meta({ id: 'SignalsBody' });
export type SignalsBody = z.infer<typeof SignalsBody>;

export const SignalsResponse = z
  .object({
    controls: z.array(Control),
    /** Runs named in the request that no longer exist for this runner: stop them, treat them as deleted. */
    missing: z.array(z.uuid()),
    reviewRequests: z.array(ReviewRequest),
    version: z.string(),
  })
  .meta({ id: 'SignalsResponse', description: 'What changed for the runner: controls after its cursors, missing runs, review requests, its work version' });
export type SignalsResponse = z.infer<typeof SignalsResponse>;

export const ControlsResponse = z.object({ controls: z.array(Control) }).meta({ id: 'RunControlsResponse', description: "The run's controls after the cursor, in order" });
export const ReviewRequestsResponse = z.object({ reviewRequests: z.array(ReviewRequest) }).meta({ id: 'ReviewRequestsResponse', description: 'Pending review requests of the runner' });

export const ReviewAnswerBody = z
  .object({
    status: z.enum(['ok', 'error']),
    /** The file's content, base64 (status ok). */
    content: z.string().max(Math.ceil((RUNNER_LIMITS.reviewAnswerBytes * 4) / 3) + 4).optional(),
    message: z.string().max(2_000).optional(),
  })
  .meta({ id: 'ReviewAnswerBody' });
export type ReviewAnswerBody = z.infer<typeof ReviewAnswerBody>;

/** A journal event as the runner uploads it: `permission`, `async_question`, `commands`, the agent's trace… */
export const RunnerEvent = z.object({ kind: z.string().regex(/^[a-z][a-z0-9_]{0,63}$/), data: z.unknown().optional() });
export type RunnerEvent = z.infer<typeof RunnerEvent>;

/** Stands for a large event staged in parts: the sole item of its batch. */
export const EventRef = z.object({
  type: z.literal('event_ref'),
  /** SHA-256 (hex) of the UTF-8 JSON journal entry `{ sequence, event }`. */
  digest: z.string().regex(/^[0-9a-f]{64}$/),
  sizeBytes: z.number().int().min(1).max(RUNNER_LIMITS.logicalEventBytes),
});
export type EventRef = z.infer<typeof EventRef>;

export const EventBatch = z.object({
  runId: z.uuid(),
  generation: Counter(1),
  firstSequence: Counter(1),
  events: z.array(z.union([EventRef, RunnerEvent])).min(1),
});
export type EventBatch = z.infer<typeof EventBatch>;

export const EventsBody = z.object({ batches: z.array(EventBatch).min(1).max(RUNNER_LIMITS.signalRuns) }).meta({ id: 'RunnerEventsBody' });
export type EventsBody = z.infer<typeof EventsBody>;

export const BatchError = z.object({ status: z.number().int(), message: z.string(), details: z.unknown().optional() });
export const BatchResult = z.union([
  z.object({ runId: z.uuid(), acknowledgedSequence: Counter(0) }),
  z.object({ runId: z.uuid(), error: BatchError }),
]);
export type BatchResult = z.infer<typeof BatchResult>;
export const EventsResponse = z.object({ results: z.array(BatchResult) }).meta({ id: 'RunnerEventsResponse', description: "One result per batch, in order: the sequence acknowledged, or the batch's error" });
export type EventsResponse = z.infer<typeof EventsResponse>;

export const EventPartBody = z
  .object({
    generation: Counter(1),
    /** The logical event's sequence: the next one the journal expects. */
    sequence: Counter(1),
    part: Counter(0),
    /** At most 192 KiB once decoded. */
    data: z.string().max(Math.ceil((RUNNER_LIMITS.partDataBytes * 4) / 3) + 4),
    ref: EventRef,
  })
  .meta({ id: 'EventPartBody' });
export type EventPartBody = z.infer<typeof EventPartBody>;

export const EventPartResponse = z
  .object({ runId: z.uuid(), sequence: Counter(1), part: Counter(0), receivedBytes: z.number().int() })
  .meta({ id: 'EventPartResponse', description: 'The part is staged; `receivedBytes` of the event so far' });
export type EventPartResponse = z.infer<typeof EventPartResponse>;

export const RunOutcome = z.object({
  status: z.enum(['completed', 'failed', 'cancelled']),
  finalAnswer: z.string().max(1_000_000).optional(),
  /** The run ended asking the person a question (the task then waits for input). */
  question: z.string().max(1_000_000).optional(),
  plan: z.string().max(1_000_000).optional(),
  planOutcome: PlanOutcome.optional(),
  error: z.string().max(100_000).optional(),
  nativeMode: NativeMode.optional(),
  /** The harness session, for the task's next run to resume. */
  sessionId: z.string().max(500).optional(),
  /** The CLI stays alive with background work: the task is idle, and a later `wake` resumes it. */
  parked: z.boolean().optional(),
});
export type RunOutcome = z.infer<typeof RunOutcome>;

export const CompleteBody = z
  .object({
    generation: Counter(1),
    /** The last sequence the runner delivered; the server must hold exactly that many events. */
    lastSequence: Counter(0),
    /** The run's process group has stopped (or is parked, for `parked`). */
    processStopped: z.literal(true),
    outcome: RunOutcome,
  })
  .meta({ id: 'RunCompleteBody' });
export type CompleteBody = z.infer<typeof CompleteBody>;

export const RunStatusResponse = z
  .object({ runId: z.uuid(), state: RunState, status: JobStatus, generation: Counter(0) })
  .meta({ id: 'RunStatusResponse', description: "The run's state after the request" });
export type RunStatusResponse = z.infer<typeof RunStatusResponse>;

export const WakeResponse = z
  .union([z.object({ started: z.literal(true), jobId: z.uuid() }), z.object({ started: z.literal(false), reason: z.string(), retry: z.boolean() })])
  .meta({ id: 'WakeResponse', description: 'Whether a run resuming the parked session was queued' });
export type WakeResponse = z.infer<typeof WakeResponse>;

export const PullRequestReportBody = z
  .object({
    pullRequests: z
      .array(z.object({ prUrl: z.url().max(2_000), title: z.string().min(1).max(500), state: PullRequestState }))
      .max(RUNNER_LIMITS.pullRequestsPerReport),
  })
  .meta({ id: 'PullRequestReportBody' });
export type PullRequestReportBody = z.infer<typeof PullRequestReportBody>;

export const PullRequestReportResponse = z.object({ pullRequests: z.array(PullRequest) }).meta({ id: 'PullRequestReportResponse', description: "The task's pull request records after the report" });

export const DelegateBody = z
  .object({
    generation: Counter(1),
    invocationId: z.string().min(1).max(200),
    input: z.object({
      title: z.string().max(10_000).optional(),
      instructions: z.string().max(200_000),
      repositories: z
        .array(z.object({ repository: z.string().regex(/^[A-Za-z0-9_.-]{1,100}\/[A-Za-z0-9_.-]{1,100}$/, 'must be owner/repo'), branch: z.string().min(1).max(255) }))
        .max(RUNNER_LIMITS.repositoriesPerProject),
      agent: z.string().max(300).optional(),
      workspaceId: z.uuid().optional(),
    }),
  })
  .meta({ id: 'DelegateBody' });
export type DelegateBody = z.infer<typeof DelegateBody>;

export const WorkspaceChoice = z.object({ id: z.uuid(), name: z.string() });

export const DelegateResponse = z
  .union([
    z.object({ ok: z.literal(true), taskId: z.uuid(), url: z.string(), markdown: z.string() }),
    z.object({
      ok: z.literal(false),
      message: z.string(),
      workspaces: z.array(WorkspaceChoice).optional(),
      markdown: z.string().optional(),
      taskId: z.uuid().optional(),
      url: z.string().optional(),
    }),
  ])
  .meta({ id: 'DelegateResponse', description: 'The cloud task, or why none was made (with guidance)' });
export type DelegateResponse = z.infer<typeof DelegateResponse>;

export const WorkspaceSshBody = z
  .object({ generation: Counter(1), input: z.object({ workspaceId: z.uuid().optional() }) })
  .meta({ id: 'WorkspaceSshBody' });
export type WorkspaceSshBody = z.infer<typeof WorkspaceSshBody>;

export const WorkspaceSshResponse = z
  .union([
    z.object({
      ok: z.literal(true),
      workspaceId: z.uuid(),
      expiresAt: z.iso.datetime({ offset: true }),
      ssh: z.object({
        /** Where the temporary credential works: the workspace shell endpoint. */
        url: z.string(),
        /** `service_ssh_…`, valid until `expiresAt`, for this workspace only. */
        token: z.string(),
      }),
      markdown: z.string(),
    }),
    z.object({ ok: z.literal(false), message: z.string(), choices: z.array(WorkspaceChoice).optional(), markdown: z.string().optional() }),
  ])
  .meta({ id: 'WorkspaceSshResponse', description: 'Temporary workspace access, or why none was granted' });
export type WorkspaceSshResponse = z.infer<typeof WorkspaceSshResponse>;

/** Temporary workspace shell tokens: `service_ssh_` and 43 URL-safe characters (32 random bytes); only the SHA-256 is kept. */
export const SSH_TOKEN_PREFIX = 'service_ssh_';

export const WorkspaceShellBody = z
  .object({
    command: z.string().min(1).max(100_000).refine((value) => !value.includes('\u0000'), 'must not contain NUL characters').describe('Run with `sh -c` in /workspace'),
    stdin: z
      .string()
      .refine((value) => new TextEncoder().encode(value).length <= RUNNER_LIMITS.shellStdinBytes, `must be at most ${RUNNER_LIMITS.shellStdinBytes} bytes`)
      .optional()
      .describe('Standard input, at most 1 MiB (UTF-8)'),
    timeoutSeconds: z.number().int().min(1).max(RUNNER_LIMITS.shellTimeoutSeconds).default(60).describe('The command is killed after this long (default 60, at most 600)'),
  })
  .meta({ id: 'WorkspaceShellBody' });
export type WorkspaceShellBody = z.infer<typeof WorkspaceShellBody>;

export const WorkspaceShellResponse = z
  .object({
    exitCode: z.number().int().nullable().describe('Null when a signal ended it (a timeout, say)'),
    stdout: z.string(),
    stderr: z.string(),
    timedOut: z.boolean(),
    stdoutTruncated: z.boolean().describe('Standard output went past 1 MiB: the rest was read and dropped'),
    stderrTruncated: z.boolean().describe('Standard error went past 1 MiB: the rest was read and dropped'),
  })
  .meta({ id: 'WorkspaceShellResponse', description: "The command ran in the grant's fork of the workspace environment" });
export type WorkspaceShellResponse = z.infer<typeof WorkspaceShellResponse>;

// ---- The signed-in user's side (under /api/v1, session only) ----

export const CreatePairingBody = z
  .object({ challenge: PairingChallenge, name: z.string().min(1).max(100).optional() })
  .meta({ id: 'CreatePairingBody' });
export type CreatePairingBody = z.infer<typeof CreatePairingBody>;

export const PairingResponse = z
  .object({ pairingCode: z.string(), expiresAt: z.iso.datetime({ offset: true }) })
  .meta({ id: 'PairingResponse', description: 'The pairing code, shown once (only its hash is kept), and when it expires' });
export type PairingResponse = z.infer<typeof PairingResponse>;

export const RunnerProject = z
  .object({ id: z.uuid(), name: z.string(), repositories: z.array(ProjectRepository), projectless: z.boolean() })
  .meta({ id: 'RunnerProject' });

export const RunnerSummary = z
  .object({
    id: z.uuid(),
    name: z.string(),
    workspaceId: z.uuid(),
    revoked: z.boolean(),
    online: z.boolean().describe('Seen within the last two heartbeat intervals'),
    lastSeenAt: z.iso.datetime({ offset: true }).nullable(),
    platform: z.string().nullable(),
    runnerVersion: z.string().nullable(),
    capabilities: Capabilities,
    projects: z.array(RunnerProject).describe('Projects to start local work in (the projectless environment is left out of the picker)'),
  })
  .meta({ id: 'RunnerSummary', description: 'A runner connection of the user' });
export type RunnerSummary = z.infer<typeof RunnerSummary>;

export const ListRunnersResponse = z.object({ runners: z.array(RunnerSummary) }).meta({ id: 'ListRunnersResponse', description: "The user's runner connections in every workspace, oldest first" });


export const PermissionAnswerBody = z
  .object({ decision: z.enum(['allow', 'deny']), answers: z.array(QuestionAnswer).optional() })
  .meta({ id: 'PermissionAnswerBody' });
export type PermissionAnswerBody = z.infer<typeof PermissionAnswerBody>;

export const AsyncAnswerBody = z.object({ text: z.string().min(1).max(100_000) }).meta({ id: 'AsyncAnswerBody' });

export const LocalRequest = z
  .object({
    requestId: z.string(),
    runId: z.uuid(),
    kind: z.enum(['permission', 'question', 'async_question']),
    status: z.enum(['pending', 'answered', 'cleared']),
    tool: z.string().nullable(),
    questions: z.array(Question),
    createdAt: z.iso.datetime({ offset: true }),
  })
  .meta({ id: 'LocalRequest' });
export type LocalRequest = z.infer<typeof LocalRequest>;

export const LocalRequestResponse = z.object({ request: LocalRequest }).meta({ id: 'LocalRequestResponse', description: 'The request after the answer' });
export const ListLocalRequestsResponse = z.object({ requests: z.array(LocalRequest) }).meta({ id: 'ListLocalRequestsResponse', description: "The requests of the task's runs, oldest first" });

export const CreateReviewRequestBody = z.object({ path: z.string().min(1).max(4_096) }).meta({ id: 'CreateReviewRequestBody' });
export const ReviewRequestDetail = z
  .object({
    id: z.uuid(),
    path: z.string(),
    status: z.enum(['pending', 'answered', 'failed']),
    content: z.string().nullable().describe('The file, base64, once answered'),
    message: z.string().nullable(),
    createdAt: z.iso.datetime({ offset: true }),
    answeredAt: z.iso.datetime({ offset: true }).nullable(),
  })
  .meta({ id: 'ReviewRequestDetail' });
export const ReviewRequestResponse = z.object({ reviewRequest: ReviewRequestDetail }).meta({ id: 'ReviewRequestResponse', description: 'The review request and its answer, once there is one' });
