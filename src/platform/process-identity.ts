/**
 * Which process a recorded pid names. A pid alone names whatever process has that number now: after a
 * reboot, or once the recorded process exited and the number came round again, it is someone else's (the
 * user's terminal, an editor). So a record of a process (a lock file's owner, the leader of a process group)
 * holds its identity next to its pid, and the pid is acted on (its group killed, its lock respected) only
 * while the identity still matches.
 *
 * - Linux: the boot id (`/proc/sys/kernel/random/boot_id`) and the start time in clock ticks since boot
 *   (`/proc/<pid>/stat`, field 22). Both together name one process of one boot.
 * - Elsewhere (macOS, the BSDs): no /proc; `ps -o lstart= -p <pid>` gives the start as a wall-clock time
 *   to the second (in UTC, C locale), which differs across reboots too. There is no boot id.
 * - Where neither answers, a process's identity is unknown and callers do not act on the pid.
 *
 * A record that names a process by its pid alone (written by an older version, or by a writer that could
 * not tell the identity) is checked by time instead (`matchStartedBy`): the process ran when the record was
 * written, so a process that has the pid now but started after that is another one.
 *
 * A record may be written by another program in the same terms (the group records of
 * src/agents/local-workspace.ts are written by the group's own shell, which reads the same /proc files, or
 * runs the same `ps`): what it wrote compares with `processIdentity`.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';

export interface ProcessIdentity {
  pid: number;
  /** The boot's id (Linux); absent where the platform has none. */
  boot?: string;
  /** The process's start: clock ticks since boot (Linux), or `ps`'s `lstart` text. */
  start: string;
}

/**
 * `running`: the recorded process is the one with that pid now. `gone`: it is not (no process has the
 * pid, or another one does, or the machine rebooted since). `unknown`: this platform cannot tell.
 */
export type ProcessMatch = 'running' | 'gone' | 'unknown';

const BOOT_ID = '/proc/sys/kernel/random/boot_id';

/** Whether this platform has the /proc files the Linux identity is made of. */
const hasProc = (): boolean => existsSync('/proc/self/stat') && existsSync(BOOT_ID);

/** The fields of `/proc/<pid>/stat` from the third on (after `(comm)`, which may hold spaces); null when absent. */
function statFields(pid: number): string[] | null {
  let text: string;
  try {
    text = readFileSync(`/proc/${pid}/stat`, 'utf8');
  } catch {
    return null;
  }
  return text.slice(text.lastIndexOf(')') + 2).trim().split(' ');
}

/** `ps -o <field>= -p <pid>`: its text, null when no such process, undefined when there is no `ps`. */
function psField(pid: number, field: string): string | null | undefined {
  try {
    const text = execFileSync('ps', ['-o', `${field}=`, '-p', String(pid)], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'ignore'],
      env: { ...process.env, LC_ALL: 'C', TZ: 'UTC' },
      timeout: 5_000,
    });
    return normalizeSpaces(text) || null;
  } catch (error) {
    // `ps -p` exits 1 when the process does not exist.
    return (error as { status?: unknown }).status === 1 ? null : undefined;
  }
}

const normalizeSpaces = (text: string): string => text.trim().replace(/\s+/g, ' ');

/** What names process `pid` now; null when no such process runs, undefined when this platform cannot tell. */
export function processIdentity(pid: number): ProcessIdentity | null | undefined {
  if (!Number.isInteger(pid) || pid < 1) return null;
  if (hasProc()) {
    // Field 22 (starttime) is the 20th after `(comm)`.
    const start = statFields(pid)?.[19];
    if (!start) return null;
    return { pid, boot: readFileSync(BOOT_ID, 'utf8').trim(), start };
  }
  const start = psField(pid, 'lstart');
  if (start === undefined) return undefined;
  return start === null ? null : { pid, start };
}

/** Whether the process `recorded` names is still the one with its pid. */
export function matchProcess(recorded: ProcessIdentity): ProcessMatch {
  const now = processIdentity(recorded.pid);
  if (now === undefined) return 'unknown';
  if (now === null) return 'gone';
  // A record from the other kind of platform (a home moved between machines) names nothing here.
  if ((recorded.boot === undefined) !== (now.boot === undefined)) return 'gone';
  return recorded.boot === now.boot && normalizeSpaces(recorded.start) === now.start ? 'running' : 'gone';
}

/** Clock ticks per second of /proc's times (USER_HZ: 100 on every common architecture). */
let ticksPerSecond: number | undefined;
function clockTicks(): number {
  if (ticksPerSecond === undefined) {
    try {
      ticksPerSecond = Number(execFileSync('getconf', ['CLK_TCK'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'], timeout: 5_000 }).trim());
    } catch {
      ticksPerSecond = 100;
    }
    if (!Number.isFinite(ticksPerSecond) || ticksPerSecond <= 0) ticksPerSecond = 100;
  }
  return ticksPerSecond;
}

/** When process `pid` started, in ms since the epoch; null when no such process runs, undefined when this platform cannot tell. */
export function processStartedAt(pid: number): number | null | undefined {
  if (!Number.isInteger(pid) || pid < 1) return null;
  if (hasProc()) {
    const ticks = Number(statFields(pid)?.[19]);
    if (!Number.isFinite(ticks)) return null;
    const uptimeSeconds = Number(readFileSync('/proc/uptime', 'utf8').split(' ')[0]);
    return Date.now() - (uptimeSeconds - ticks / clockTicks()) * 1000;
  }
  const start = psField(pid, 'lstart');
  if (start === undefined) return undefined;
  if (start === null) return null;
  const parsed = Date.parse(`${start} UTC`);
  return Number.isNaN(parsed) ? undefined : parsed;
}

/**
 * How far a process's start, read now, may lie after the moment a record it wrote says: /proc's times
 * are counted since boot and turned into wall-clock time here (rounding, a coarse file clock, the wall
 * clock's slewing since), `ps` rounds to the second. A pid that came round within this much of the
 * record's writing would pass for the recorded process; nothing else does.
 */
const START_TOLERANCE_MS = 1_000;

/**
 * Whether process `pid` runs and started no later than `writtenAtMs`, when a record naming it by its pid
 * alone was written while it ran (see the header).
 */
export function matchStartedBy(pid: number, writtenAtMs: number): ProcessMatch {
  const startedAt = processStartedAt(pid);
  if (startedAt === undefined) return 'unknown';
  if (startedAt === null) return 'gone';
  return startedAt <= writtenAtMs + START_TOLERANCE_MS ? 'running' : 'gone';
}

/** The process group this process belongs to; null when this platform cannot tell. */
export function ownProcessGroup(): number | null {
  const pgrp = hasProc() ? statFields(process.pid)?.[2] : psField(process.pid, 'pgid');
  const value = Number(pgrp);
  return Number.isInteger(value) && value > 0 ? value : null;
}
