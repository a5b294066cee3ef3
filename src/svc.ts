#!/usr/bin/env node
import { run } from './cli/index.js';

await run(process.argv);
