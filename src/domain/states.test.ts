import { describe, expect, it } from 'vitest';
import { JobStatus, TaskStatus } from '../protocol/rest.js';
import {
  canTransitionJob,
  canTransitionTask,
  isJobTerminal,
  JOB_TRANSITIONS,
  jobStatesInto,
  TASK_ACTION_FROM,
  TASK_TRANSITIONS,
  taskStatesInto,
  taskStatusAfterJob,
} from './states.js';

const jobStatuses = JobStatus.options;
const taskStatuses = TaskStatus.options;

describe('job state machine', () => {
  it('allows exactly the listed moves', () => {
    const allowed = jobStatuses.flatMap((from) => jobStatuses.filter((to) => canTransitionJob(from, to)).map((to) => `${from}>${to}`));
    expect(allowed.sort()).toEqual(
      ['PENDING>IN_PROGRESS', 'PENDING>CANCELLED', 'IN_PROGRESS>COMPLETED', 'IN_PROGRESS>FAILED', 'IN_PROGRESS>CANCELLED', 'IN_PROGRESS>PENDING'].sort(),
    );
  });

  it('has terminal COMPLETED, FAILED and CANCELLED', () => {
    expect(jobStatuses.filter(isJobTerminal)).toEqual(['COMPLETED', 'FAILED', 'CANCELLED']);
  });

  it('answers the states a job may come from', () => {
    for (const to of jobStatuses) {
      expect(jobStatesInto(to).sort()).toEqual(jobStatuses.filter((from) => JOB_TRANSITIONS[from].includes(to)).sort());
    }
    expect(jobStatesInto('IN_PROGRESS')).toEqual(['PENDING']);
  });
});

describe('task state machine', () => {
  it('refuses every move that is not listed', () => {
    for (const from of taskStatuses) {
      for (const to of taskStatuses) {
        expect(canTransitionTask(from, to), `${from} > ${to}`).toBe(TASK_TRANSITIONS[from].includes(to));
      }
    }
    expect(canTransitionTask('COMPLETED', 'CANCELLED')).toBe(false);
    expect(canTransitionTask('IN_REVIEW', 'COMPLETED')).toBe(true);
    expect(canTransitionTask('CANCELLED', 'PENDING')).toBe(true);
    expect(canTransitionTask('CANCELLED', 'IN_PROGRESS')).toBe(false);
  });

  it('lets every waiting or finished state resume through a follow-up', () => {
    for (const status of ['AWAITING_INPUT', 'AWAITING_APPROVAL', 'IN_REVIEW', 'COMPLETED', 'FAILED', 'CANCELLED'] as const) {
      expect(TASK_ACTION_FROM.message).toContain(status);
      expect(canTransitionTask(status, 'PENDING')).toBe(true);
    }
    expect(taskStatesInto('AWAITING_APPROVAL')).toEqual(['IN_PROGRESS']);
  });

  it('cancels only tasks with active or waiting runs, approves only AWAITING_APPROVAL', () => {
    expect([...TASK_ACTION_FROM.cancel].sort()).toEqual(['AWAITING_APPROVAL', 'AWAITING_INPUT', 'IN_PROGRESS', 'PENDING']);
    expect(TASK_ACTION_FROM.approvePlan).toEqual(['AWAITING_APPROVAL']);
    for (const status of TASK_ACTION_FROM.cancel) expect(canTransitionTask(status, 'CANCELLED')).toBe(true);
    expect(TASK_ACTION_FROM.archive).not.toContain('PENDING');
    expect(TASK_ACTION_FROM.archive).not.toContain('IN_PROGRESS');
  });

  it('derives the status after a job ends', () => {
    const base = { status: 'COMPLETED' as const, planReady: false, awaitingInput: false, hasOpenPullRequests: false, moreQueued: false };
    expect(taskStatusAfterJob(base)).toBe('COMPLETED');
    expect(taskStatusAfterJob({ ...base, hasOpenPullRequests: true })).toBe('IN_REVIEW');
    expect(taskStatusAfterJob({ ...base, planReady: true })).toBe('AWAITING_APPROVAL');
    expect(taskStatusAfterJob({ ...base, awaitingInput: true, planReady: true })).toBe('AWAITING_INPUT');
    expect(taskStatusAfterJob({ ...base, status: 'FAILED', hasOpenPullRequests: true })).toBe('FAILED');
    expect(taskStatusAfterJob({ ...base, status: 'FAILED', moreQueued: true })).toBe('PENDING');
    for (const ending of [base, { ...base, hasOpenPullRequests: true }, { ...base, planReady: true }, { ...base, status: 'FAILED' as const }]) {
      expect(canTransitionTask('IN_PROGRESS', taskStatusAfterJob(ending))).toBe(true);
    }
  });
});
