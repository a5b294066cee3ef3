/**
 * A run's durable outbox: the journal entries the runner wrote and the server has not acknowledged.
 *
 *   events.jsonl   append-only, one entry `{"sequence":N,"event":E}` per line, each written and fsynced
 *                  before anything uploads it; the line's bytes are the entry's bytes (parts.ts)
 *   acked.json     the acknowledged sequence: entries up to it are the server's, and are dropped
 *
 * Entries leave only once acknowledged: the marker is written first (atomically), then the file is
 * compacted, so a crash in between leaves lines that the marker already skips. A new run's first sequence
 * follows the manifest's `eventsStored`.
 *
 * Torn lines. An append that fails part-way (ENOSPC) is cut back to where it began; should that fail
 * too, the outbox refuses further appends until it is reopened. On reopening, every line is checked
 * (its exact prefix and its event's JSON): a torn last line (a crash while it was written: never fsynced,
 * never uploaded) is cut off, and so is a torn write's leftover in front of the whole entry written after
 * it. Anything else invalid before the last line is damage: OutboxCorruptError, and the daemon moves
 * that run aside (daemon.ts). A read or write that fails (too many open files, a full disk) is not
 * damage: it is thrown as it is, and may pass.
 */
import { mkdirSync, readFileSync, rmSync } from 'node:fs';
import { open, type FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import { z } from 'zod';
import type { RunnerEvent } from '../protocol/runner.js';
import { readJsonFile, syncDir, writeFileAtomic } from './home.js';
import { entryPrefix, eventJsonOf, sendableEntry } from './parts.js';

export interface OutboxEntry {
  sequence: number;
  /** The entry's JSON text, exactly as written (and as its bytes are sent and hashed). */
  line: string;
  /** Its size in UTF-8 bytes. */
  bytes: number;
}

export interface OutboxBacklog {
  acknowledgedSequence: number;
  lastSequence: number;
  entries: number;
  bytes: number;
}

/** Once this many acknowledged bytes sit before the pending ones, the file is rewritten without them. */
/** acked.json: the last sequence the server acknowledged. */
const AckedMarker = z.object({ acknowledged: z.number().int().min(0) });

const COMPACT_AFTER_BYTES = 4 * 1024 * 1024;

const EVENTS = 'events.jsonl';
const ACKED = 'acked.json';

export class OutboxCorruptError extends Error {
  constructor(
    readonly path: string,
    reason: string,
  ) {
    super(`the outbox ${path} is damaged (${reason}); move it away to let the runner go on`);
    this.name = 'OutboxCorruptError';
  }
}

/** An append failed and its bytes could not be cut back: nothing more is written until a reopen repairs it. */
export class OutboxBrokenError extends Error {
  constructor(dir: string, cause: unknown) {
    super(`the outbox in ${dir} could not undo a failed write; it takes no more events until the runner starts again`, { cause });
    this.name = 'OutboxBrokenError';
  }
}

interface Loaded {
  acknowledged: number;
  /** Every valid entry in the file, in order. */
  entries: OutboxEntry[];
  /** Bytes of the file up to the end of the last valid entry; anything after them is a torn line. */
  keptBytes: number;
  fileBytes: number;
  /** A torn write's leftover stood in front of an entry: the file must be written again without it. */
  repaired: boolean;
}

/** The entry `line` holds when it is one (its exact prefix, and its event JSON that parses); else null. */
function entryOf(line: string): OutboxEntry | null {
  const match = /^\{"sequence":(\d+),"event":/.exec(line);
  if (!match || !line.endsWith('}')) return null;
  const sequence = Number(match[1]);
  if (!line.startsWith(entryPrefix(sequence))) return null;
  try {
    const event: unknown = JSON.parse(eventJsonOf(line, sequence));
    if (typeof event !== 'object' || event === null || Array.isArray(event)) return null;
  } catch {
    return null;
  }
  return { sequence, line, bytes: Buffer.byteLength(line) };
}

/**
 * A line whose start was left by a torn write and whose end is the whole entry written after it (the old
 * runner appended the retry right behind the torn bytes): that entry. Null when the line is no such thing.
 */
function entryAfterTornWrite(line: string): OutboxEntry | null {
  for (let at = line.lastIndexOf('{"sequence":'); at > 0; at = line.lastIndexOf('{"sequence":', at - 1)) {
    const entry = entryOf(line.slice(at));
    if (entry) return entry;
  }
  return null;
}

/** The file that holds exactly `entries`. */
const fileText = (entries: readonly OutboxEntry[]): string => entries.map((entry) => `${entry.line}\n`).join('');

/** The acknowledged sequence on disk; null when there is no marker. A marker that cannot be read as one is damage; a read that fails (too many open files, a failing disk) is only that, and is thrown as it is. */
function readAcked(dir: string): number | null {
  const path = join(dir, ACKED);
  const marker = readJsonFile(path, AckedMarker, (problem) => new OutboxCorruptError(path, `no acknowledged sequence (${problem})`));
  return marker?.acknowledged ?? null;
}

function load(dir: string, fallbackAcknowledged: number): Loaded {
  const path = join(dir, EVENTS);
  let content: Buffer;
  try {
    content = readFileSync(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
    content = Buffer.alloc(0);
  }
  const acknowledged = readAcked(dir) ?? fallbackAcknowledged;
  const lines = content.subarray(0, content.lastIndexOf(0x0a) + 1).toString('utf8').split('\n');
  // The text after the last newline (empty when the file ends with one) is a torn line.
  lines.pop();
  const entries: OutboxEntry[] = [];
  let keptBytes = 0;
  let repaired = false;
  for (const [index, line] of lines.entries()) {
    let entry = entryOf(line);
    if (!entry) {
      entry = entryAfterTornWrite(line);
      // A torn last line, with nothing whole after it: a crash while it was written.
      if (!entry && index === lines.length - 1) break;
      if (!entry) throw new OutboxCorruptError(path, `line ${index + 1} is not a whole {"sequence":N,"event":…} entry, and entries follow it`);
      repaired = true;
    }
    const previous = entries.at(-1)?.sequence;
    if (previous !== undefined && entry.sequence !== previous + 1) throw new OutboxCorruptError(path, `sequence ${entry.sequence} follows ${previous}`);
    entries.push(entry);
    keptBytes += Buffer.byteLength(line) + 1;
  }
  return { acknowledged, entries, keptBytes, fileBytes: content.length, repaired };
}

export class RunOutbox {
  private queue: Promise<unknown> = Promise.resolve();
  private closed = false;
  /** Set when a failed append could not be undone: appends are refused until a reopen. */
  private broken: OutboxBrokenError | null = null;

  private constructor(
    readonly dir: string,
    private handle: FileHandle,
    private entries: OutboxEntry[],
    private acknowledged: number,
    private last: number,
    /** Bytes of acknowledged lines still in the file. */
    private staleBytes: number,
    /** The file's length: where a failed append is cut back to. */
    private fileBytes: number,
  ) {}

  /** Opens (or creates) the outbox in `dir`; a new one starts after `eventsStored`. */
  static async open(dir: string, eventsStored: number): Promise<RunOutbox> {
    mkdirSync(dir, { recursive: true, mode: 0o700 });
    const loaded = load(dir, eventsStored);
    if (readAcked(dir) === null) writeFileAtomic(join(dir, ACKED), JSON.stringify({ acknowledged: loaded.acknowledged }));
    let fileBytes = loaded.keptBytes;
    if (loaded.repaired) {
      const repaired = fileText(loaded.entries);
      writeFileAtomic(join(dir, EVENTS), repaired);
      fileBytes = Buffer.byteLength(repaired);
    }
    const handle = await open(join(dir, EVENTS), 'a+', 0o600);
    if (!loaded.repaired && loaded.fileBytes > loaded.keptBytes) {
      await handle.truncate(loaded.keptBytes);
      await handle.sync();
    }
    syncDir(dir);
    const pending = loaded.entries.filter((entry) => entry.sequence > loaded.acknowledged);
    const staleBytes = loaded.entries.filter((entry) => entry.sequence <= loaded.acknowledged).reduce((sum, entry) => sum + entry.bytes + 1, 0);
    const last = Math.max(loaded.acknowledged, loaded.entries.at(-1)?.sequence ?? 0);
    return new RunOutbox(dir, handle, pending, loaded.acknowledged, last, staleBytes, fileBytes);
  }

  /** What an outbox in `dir` holds, read without opening (or repairing) it: for `svc runner status`. */
  static inspect(dir: string, eventsStored = 0): OutboxBacklog {
    const loaded = load(dir, eventsStored);
    const pending = loaded.entries.filter((entry) => entry.sequence > loaded.acknowledged);
    return {
      acknowledgedSequence: loaded.acknowledged,
      lastSequence: Math.max(loaded.acknowledged, loaded.entries.at(-1)?.sequence ?? 0),
      entries: pending.length,
      bytes: pending.reduce((sum, entry) => sum + entry.bytes, 0),
    };
  }

  get acknowledgedSequence(): number {
    return this.acknowledged;
  }

  /** The last sequence written (the acknowledged one when nothing is pending). */
  get lastSequence(): number {
    return this.last;
  }

  /** Entries not acknowledged yet, in order. */
  pending(): readonly OutboxEntry[] {
    return this.entries;
  }

  backlog(): OutboxBacklog {
    return {
      acknowledgedSequence: this.acknowledged,
      lastSequence: this.last,
      entries: this.entries.length,
      bytes: this.entries.reduce((sum, entry) => sum + entry.bytes, 0),
    };
  }

  /**
   * Writes `event` as the next entry and resolves with its sequence once it is on disk. An event over the
   * 32 MiB a logical event may have is replaced by a truncated one first (parts.ts).
   */
  append(event: RunnerEvent): Promise<number> {
    return this.exclusive(async () => {
      if (this.broken) throw this.broken;
      const sequence = this.last + 1;
      const { line } = sendableEntry(sequence, event);
      const before = this.fileBytes;
      try {
        await this.handle.appendFile(`${line}\n`, 'utf8');
        await this.handle.datasync();
      } catch (error) {
        // Part of the line may be in the file: cut it off, or the next entry would be written behind it.
        await this.handle.truncate(before).catch((failure: unknown) => {
          this.broken = new OutboxBrokenError(this.dir, failure);
        });
        throw error;
      }
      this.fileBytes = before + Buffer.byteLength(line) + 1;
      this.last = sequence;
      this.entries.push({ sequence, line, bytes: Buffer.byteLength(line) });
      return sequence;
    });
  }

  /** The server holds every entry up to `sequence`: they are dropped here. */
  acknowledge(sequence: number): Promise<void> {
    return this.exclusive(async () => {
      const upTo = Math.min(sequence, this.last);
      if (upTo <= this.acknowledged) return;
      writeFileAtomic(join(this.dir, ACKED), JSON.stringify({ acknowledged: upTo }));
      this.acknowledged = upTo;
      const dropped = this.entries.filter((entry) => entry.sequence <= upTo);
      this.entries = this.entries.filter((entry) => entry.sequence > upTo);
      this.staleBytes += dropped.reduce((sum, entry) => sum + entry.bytes + 1, 0);
      if (this.entries.length === 0) {
        await this.handle.truncate(0);
        await this.handle.sync();
        this.staleBytes = 0;
        this.fileBytes = 0;
      } else if (this.staleBytes > COMPACT_AFTER_BYTES) {
        await this.rewrite();
      }
    });
  }

  async close(): Promise<void> {
    if (this.closed) return;
    await this.exclusive(async () => {
      this.closed = true;
      await this.handle.close();
    });
  }

  /** Closes the outbox and deletes it: the run is finished or gone. */
  async remove(): Promise<void> {
    if (!this.closed) await this.close();
    rmSync(join(this.dir, EVENTS), { force: true });
    rmSync(join(this.dir, ACKED), { force: true });
  }

  /** The file with only the pending lines, swapped in whole. */
  private async rewrite(): Promise<void> {
    const path = join(this.dir, EVENTS);
    const text = fileText(this.entries);
    writeFileAtomic(path, text);
    await this.handle.close();
    this.handle = await open(path, 'a+', 0o600);
    this.staleBytes = 0;
    this.fileBytes = Buffer.byteLength(text);
  }

  private exclusive<T>(work: () => Promise<T>): Promise<T> {
    const next = this.queue.then(() => {
      if (this.closed) throw new Error(`the outbox ${this.dir} is closed`);
      return work();
    });
    this.queue = next.catch(() => undefined);
    return next;
  }
}
