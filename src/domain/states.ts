/**
 * The job and task state machines. Every status change in the store is a conditional UPDATE whose
 * allowed "from" states come from these tables, so a move not listed here cannot happen.
 */
import type { JobStatus, TaskStatus } from '../protocol/rest.js';

export const JOB_TRANSITIONS: Readonly<Record<JobStatus, readonly JobStatus[]>> = {
  // PENDING → IN_PROGRESS when an executor claims it; CANCELLED by cancel.
  PENDING: ['IN_PROGRESS', 'CANCELLED'],
  // IN_PROGRESS → PENDING when a lost lease is requeued under a new generation.
  IN_PROGRESS: ['COMPLETED', 'FAILED', 'CANCELLED', 'PENDING'],
  COMPLETED: [],
  FAILED: [],
  CANCELLED: [],
};

export const ACTIVE_JOB_STATUSES: readonly JobStatus[] = ['PENDING', 'IN_PROGRESS'];

export function isJobTerminal(status: JobStatus): boolean {
  return JOB_TRANSITIONS[status].length === 0;
}

/** Task states that wait for a person or are finished: a follow-up message moves each back to PENDING. */
const RESUMABLE: readonly TaskStatus[] = [
  'AWAITING_INPUT',
  'AWAITING_APPROVAL',
  'IN_REVIEW',
  'COMPLETED',
  'FAILED',
  'CANCELLED',
];

export const TASK_TRANSITIONS: Readonly<Record<TaskStatus, readonly TaskStatus[]>> = {
  PENDING: ['IN_PROGRESS', 'CANCELLED', 'FAILED'],
  IN_PROGRESS: ['AWAITING_INPUT', 'AWAITING_APPROVAL', 'IN_REVIEW', 'COMPLETED', 'FAILED', 'CANCELLED', 'PENDING'],
  // A linked pull request merged completes the task from any state in which no job runs (SPEC.md).
  AWAITING_INPUT: ['PENDING', 'CANCELLED', 'COMPLETED'],
  AWAITING_APPROVAL: ['PENDING', 'CANCELLED'],
  // A merged pull request completes the task; a follow-up asks for more changes.
  IN_REVIEW: ['PENDING', 'COMPLETED'],
  COMPLETED: ['PENDING'],
  FAILED: ['PENDING', 'COMPLETED'],
  CANCELLED: ['PENDING', 'COMPLETED'],
};

/** What each task-level action needs, as the set of statuses it may start from. */
export const TASK_ACTION_FROM = {
  /** A follow-up message queues a job; on an active task it queues behind the running one. */
  message: ['PENDING', 'IN_PROGRESS', ...RESUMABLE] as readonly TaskStatus[],
  cancel: ['PENDING', 'IN_PROGRESS', 'AWAITING_INPUT', 'AWAITING_APPROVAL'] as readonly TaskStatus[],
  approvePlan: ['AWAITING_APPROVAL'] as readonly TaskStatus[],
  archive: ['AWAITING_INPUT', 'AWAITING_APPROVAL', 'IN_REVIEW', 'COMPLETED', 'FAILED', 'CANCELLED'] as readonly TaskStatus[],
} as const;

export function canTransitionJob(from: JobStatus, to: JobStatus): boolean {
  return JOB_TRANSITIONS[from].includes(to);
}

export function canTransitionTask(from: TaskStatus, to: TaskStatus): boolean {
  return TASK_TRANSITIONS[from].includes(to);
}

/** The states a task may be in for it to move to `to`, used as the WHERE of a conditional UPDATE. */
export function taskStatesInto(to: TaskStatus): TaskStatus[] {
  return (Object.keys(TASK_TRANSITIONS) as TaskStatus[]).filter((from) => canTransitionTask(from, to));
}

export function jobStatesInto(to: JobStatus): JobStatus[] {
  return (Object.keys(JOB_TRANSITIONS) as JobStatus[]).filter((from) => canTransitionJob(from, to));
}

export interface JobEnding {
  status: 'COMPLETED' | 'FAILED';
  planReady: boolean;
  awaitingInput: boolean;
  hasOpenPullRequests: boolean;
  /** Another job of the task is already queued behind this one. */
  moreQueued: boolean;
}

/** Where a task goes when one of its jobs ends. */
export function taskStatusAfterJob(ending: JobEnding): TaskStatus {
  if (ending.moreQueued) return 'PENDING';
  if (ending.status === 'FAILED') return 'FAILED';
  if (ending.awaitingInput) return 'AWAITING_INPUT';
  if (ending.planReady) return 'AWAITING_APPROVAL';
  return ending.hasOpenPullRequests ? 'IN_REVIEW' : 'COMPLETED';
}
