/**
 * One LISTEN on the journal's channel per server process, fanned out to the log streams that follow a
 * task. Started with the first follower, stopped with the server.
 */
import type { Database } from '../store/db.js';
import { EVENTS_CHANNEL } from '../store/journal.js';

export class EventHub {
  private readonly followers = new Map<string, Set<() => void>>();
  private listening: Promise<() => Promise<void>> | null = null;

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

  async close(): Promise<void> {
    const listening = this.listening;
    this.listening = null;
    this.followers.clear();
    if (listening) await (await listening)();
  }
}
