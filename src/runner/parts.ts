/**
 * The journal entry as bytes, and large entries as parts (docs/runner-protocol.md, "Large events").
 *
 * An entry is the UTF-8 JSON `{"sequence":N,"event":E}`, serialized once when it is written: the outbox
 * keeps those very bytes, an inline batch carries E as it is, and a large entry's parts, size and digest
 * are cut from and computed over the same bytes, so every retry matches its original.
 */
import { createHash } from 'node:crypto';
import { RUNNER_LIMITS, type EventRef, type RunnerEvent } from '../protocol/runner.js';

export function entryPrefix(sequence: number): string {
  return `{"sequence":${sequence},"event":`;
}

/** The entry's JSON text (one line: JSON.stringify escapes every newline). */
export function entryLine(sequence: number, event: RunnerEvent): string {
  return `${entryPrefix(sequence)}${JSON.stringify(event)}}`;
}

/** The event's own JSON inside an entry line: what an inline batch sends. */
export function eventJsonOf(line: string, sequence: number): string {
  return line.slice(entryPrefix(sequence).length, -1);
}

/** Over 240 KiB inline, an entry goes in parts. */
export function needsParts(entryBytes: number): boolean {
  return entryBytes > RUNNER_LIMITS.inlineEventBytes;
}

/** The entry cut into parts of at most 192 KiB each. */
export function partsOf(entry: Buffer): Buffer[] {
  const parts: Buffer[] = [];
  for (let offset = 0; offset < entry.length; offset += RUNNER_LIMITS.partDataBytes) {
    parts.push(entry.subarray(offset, Math.min(entry.length, offset + RUNNER_LIMITS.partDataBytes)));
  }
  return parts;
}

/** The reference that stands for a staged entry: SHA-256 (hex) and size of its bytes. */
export function eventRefOf(entry: Buffer): EventRef {
  return { type: 'event_ref', digest: createHash('sha256').update(entry).digest('hex'), sizeBytes: entry.length };
}

/** Strings longer than this are cut when an event must shrink to be sendable at all. */
const KEPT_CHARACTERS = 64 * 1024;

function shorten(value: unknown): unknown {
  if (typeof value === 'string') {
    return value.length <= KEPT_CHARACTERS
      ? value
      : `${value.slice(0, KEPT_CHARACTERS)}\n… (${value.length - KEPT_CHARACTERS} more characters cut: the event was over the 32 MiB limit of one event)`;
  }
  if (Array.isArray(value)) return value.map(shorten);
  if (typeof value === 'object' && value !== null) return Object.fromEntries(Object.entries(value).map(([key, inner]) => [key, shorten(inner)]));
  return value;
}

function serialize(sequence: number, event: RunnerEvent): string | null {
  try {
    return entryLine(sequence, event);
  } catch (error) {
    // Beyond what one string can hold: certainly over the limit.
    if (error instanceof RangeError) return null;
    throw error;
  }
}

/**
 * The entry for `event` at `sequence`, within the 32 MiB a logical event may have: an event over it is
 * not sendable, so it is replaced before it is written by one whose long strings are cut (its shape kept,
 * `truncated: true` added), or, if that is still too large, by a note that says what was left out.
 */
export function sendableEntry(sequence: number, event: RunnerEvent): { event: RunnerEvent; line: string } {
  const line = serialize(sequence, event);
  if (line !== null && Buffer.byteLength(line) <= RUNNER_LIMITS.logicalEventBytes) return { event, line };
  const size = line === null ? null : Buffer.byteLength(line);
  const data = shorten(event.data);
  const shortened: RunnerEvent = {
    kind: event.kind,
    data: typeof data === 'object' && data !== null && !Array.isArray(data) ? { ...data, truncated: true } : { value: data, truncated: true },
  };
  const shortLine = serialize(sequence, shortened);
  if (shortLine !== null && Buffer.byteLength(shortLine) <= RUNNER_LIMITS.logicalEventBytes) return { event: shortened, line: shortLine };
  const note: RunnerEvent = {
    kind: event.kind,
    data: {
      truncated: true,
      ...(size === null ? {} : { sizeBytes: size }),
      message: `this ${event.kind} event was over the 32 MiB limit of one event and was left out`,
    },
  };
  return { event: note, line: entryLine(sequence, note) };
}
