/**
 * One LISTEN on the journal's channel per server process, fanned out to the log streams that follow a
 * task. Started with the first follower, stopped with the server.
 */
import type { Database } from '../store/db.js';
import { EVENTS_CHANNEL } from '../store/journal.js';

export class EventHub {
  private readonly followers = new Map<string, Set<() => void>>();
  private listening: Promise<() => Promise<void>> | null = null;
  /** Set when the server starts closing: followers end their streams. */
  closed = false;

  constructor(private readonly database: Database) {}

  /** Calls `wake` whenever events of `taskId` are appended; resolves once notifications flow. */
  async follow(taskId: string, wake: () => void): Promise<() => void> {
    let set = this.followers.get(taskId);
    if (!set) this.followers.set(taskId, (set = new Set()));
    set.add(wake);
    this.listening ??= this.database.listen(EVENTS_CHANNEL, (payload) => {
      for (const follower of this.followers.get(payload) ?? []) follower();
    });
    try {
      await this.listening;
    } catch (error) {
      // Let the next follower try again rather than keep a failed LISTEN forever.
      this.listening = null;
      set.delete(wake);
      throw error;
    }
    return () => {
      set.delete(wake);
      if (set.size === 0) this.followers.delete(taskId);
    };
  }

  /** Wakes every follower so that its stream ends, and stops listening. Safe to call twice. */
  async close(): Promise<void> {
    this.closed = true;
    for (const followers of this.followers.values()) for (const wake of followers) wake();
    this.followers.clear();
    const listening = this.listening;
    this.listening = null;
    if (listening) await (await listening.catch(() => async () => undefined))();
  }
}
