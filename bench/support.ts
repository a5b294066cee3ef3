/**
 * What the benchmarks share: latency samples and their percentiles, the table they print, and the
 * PostgreSQL the run may use (DATABASE_URL, or a local server when one answers) in a schema of its own.
 */
import { randomBytes } from 'node:crypto';
import pg from 'pg';

export interface Latency {
  n: number;
  p50: number;
  p99: number;
}

/** Nearest-rank percentiles (with 50 samples, p99 is the largest). */
export function latencyOf(samples: readonly number[]): Latency {
  if (samples.length === 0) throw new Error('no samples');
  const sorted = [...samples].sort((a, b) => a - b);
  const rank = (p: number) => sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
  return { n: sorted.length, p50: rank(50), p99: rank(99) };
}

/** Milliseconds since `start` (a `performance.now()` reading). */
export const since = (start: number): number => performance.now() - start;

export function ms(value: number): string {
  return value >= 100 ? `${value.toFixed(0)} ms` : `${value.toFixed(1)} ms`;
}

/** One printed row: a scenario's latency and its ratio (p50 / baseline p50). */
export function latencyRow(scenario: string, latency: Latency, baseline: Latency | null, note = ''): string {
  const value = baseline ? latency.p50 / baseline.p50 : null;
  const ratio = value === null ? '-' : value < 0.1 ? value.toPrecision(2) : value.toFixed(2);
  return `${scenario.padEnd(44)} n ${String(latency.n).padStart(3)}  p50 ${ms(latency.p50).padStart(9)}  p99 ${ms(latency.p99).padStart(9)}  ratio ${ratio.padStart(6)}${note ? `  ${note}` : ''}`;
}

export function verdict(what: string, value: number, limit: number): string {
  return `target: ${what} < ${ms(limit)}: ${value < limit ? 'PASS' : 'MISSED'} (${ms(value)})`;
}

/** DATABASE_URL, or PostgreSQL on 127.0.0.1:5432 when it answers; null when there is none. */
export async function postgresUrl(): Promise<string | null> {
  const url = process.env.DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/test';
  const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 2000 });
  try {
    await client.connect();
    await client.end();
    return url;
  } catch {
    return null;
  }
}

async function adminQuery(url: string, text: string): Promise<void> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    await client.query(text);
  } finally {
    await client.end();
  }
}

/** A schema for one benchmark run; `drop` removes it with everything in it. */
export async function benchSchema(url: string): Promise<{ name: string; drop(): Promise<void> }> {
  const name = `svc_bench_${randomBytes(6).toString('hex')}`;
  await adminQuery(url, `create schema ${name}`);
  return { name, drop: () => adminQuery(url, `drop schema if exists ${name} cascade`) };
}
