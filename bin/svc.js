#!/usr/bin/env node
// The `svc` binary: server, worker, admin and client commands. Runs the compiled build (`npm run build`).
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const entry = new URL('../dist/svc.js', import.meta.url);
if (!existsSync(fileURLToPath(entry))) {
  process.stderr.write('svc: the build is missing; run `npm run build` in the svc package first\n');
  process.exit(1);
}
await import(entry.href);
