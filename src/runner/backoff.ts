/**
 * How long the runner waits before trying again: `Retry-After` when the server says, otherwise
 * exponential backoff with full jitter (a random wait between 0 and min(cap, base·2^attempt)), so that
 * many runners that lost the same server do not come back in step.
 */
export const BACKOFF_BASE_MS = 250;
export const BACKOFF_CAP_MS = 30_000;
/** A Retry-After beyond this is taken as this: a runner never goes quiet for longer. */
const RETRY_AFTER_CAP_MS = 10 * 60_000;

/** The wait before retry number `attempt` (0 for the first retry); `random` is in [0, 1). */
export function backoffDelay(attempt: number, random: () => number = Math.random): number {
  const ceiling = Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** Math.min(attempt, 30));
  return Math.floor(random() * ceiling);
}

/** A `Retry-After` header in milliseconds (seconds or an HTTP date), or null when absent or unreadable. */
export function retryAfterMs(header: string | null, now: number = Date.now()): number | null {
  if (header === null) return null;
  const value = header.trim();
  if (/^\d+$/.test(value)) return Math.min(Number(value) * 1000, RETRY_AFTER_CAP_MS);
  const date = Date.parse(value);
  if (Number.isNaN(date)) return null;
  return Math.min(Math.max(0, date - now), RETRY_AFTER_CAP_MS);
}

/** Waits `ms`, or rejects with the signal's reason as soon as it is aborted. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason as Error);
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason as Error);
    };
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}
