/**
 * Review requests: a browser that cannot reach this computer asks to see a file of a local task. The
 * path is relative to the task's folder and must stay inside it (no `..`, no link that leads out); the
 * answer is the file's content, base64, or a one-line reason.
 */
import { existsSync, readFileSync, statSync } from 'node:fs';
import { confinedPath } from '../agents/local-workspace.js';
import { RUNNER_LIMITS, type ReviewAnswerBody, type ReviewRequest } from '../protocol/runner.js';
import type { RunnerHome } from './home.js';
import { errorText } from './log.js';

const refuse = (message: string): ReviewAnswerBody => ({ status: 'error', message: message.slice(0, 2_000) });

export function reviewAnswer(home: RunnerHome, request: Pick<ReviewRequest, 'taskId' | 'path'>): ReviewAnswerBody {
  const folder = home.taskDir(request.taskId);
  if (!existsSync(folder)) return refuse('this task has no files on the computer that runs it');
  let path: string;
  try {
    path = confinedPath(folder, request.path);
  } catch (error) {
    return refuse(errorText(error));
  }
  let size: number;
  try {
    const stat = statSync(path);
    if (!stat.isFile()) return refuse(`${request.path} is not a file`);
    size = stat.size;
  } catch {
    return refuse(`${request.path} does not exist`);
  }
  if (size > RUNNER_LIMITS.reviewAnswerBytes) return refuse(`${request.path} has ${size} bytes; at most ${RUNNER_LIMITS.reviewAnswerBytes} can be shown`);
  return { status: 'ok', content: readFileSync(path).toString('base64') };
}
