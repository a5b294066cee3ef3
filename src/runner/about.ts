/** What the runner says about itself when it registers: its version and platform. */
import { readFileSync } from 'node:fs';
import { platform } from 'node:os';

let version: string | null | undefined;

/** The package's version (package.json sits two levels above both src/runner and dist/runner). */
export function runnerVersion(): string | undefined {
  if (version === undefined) {
    try {
      const pkg = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version?: unknown };
      version = typeof pkg.version === 'string' ? pkg.version : null;
    } catch {
      version = null;
    }
  }
  return version ?? undefined;
}

export function runnerPlatform(): string {
  return `${platform()}-${process.arch}`;
}
