/**
 * What this computer can run, as the runner registers it (`capabilities`):
 *
 * - agent CLIs found on PATH: `claude` (harness `claude-code`) and `codex` (`codex`), or the programs
 *   SVC_CLAUDE_CODE_COMMAND / SVC_CODEX_COMMAND name; they run with the user's own login;
 * - the built-in loop's providers that the runner's environment configures: `openai` (OPENAI_API_KEY),
 *   `anthropic` (ANTHROPIC_API_KEY), `openai-compatible` (OPENAI_COMPATIBLE_BASE_URL).
 *
 * Models per harness: the user's `models.json` in the home wins; an OpenAI-compatible endpoint is asked
 * (`GET <base>/models`); otherwise a small built-in list. One `modelSource` describes them all: the
 * protocol has one field, so it names the most specific source used (configured > discovered > fallback).
 * An OpenAI-compatible endpoint that neither answers nor is configured registers no list, which leaves
 * the model unchecked rather than refusing every model.
 */
import { accessSync, constants, statSync } from 'node:fs';
import { delimiter, join, resolve } from 'node:path';
import { z } from 'zod';
import { RUNNER_LIMITS, type Capabilities, type ModelEntry, type NativeControls } from '../protocol/runner.js';
import type { RunnerHome } from './home.js';

type Model = z.infer<typeof ModelEntry>;

/** Harnesses of the built-in loop: the runner asks for permissions and questions itself (execute.ts). */
export const BUILTIN_HARNESSES = ['openai', 'anthropic', 'openai-compatible'] as const;
export const CLI_HARNESSES = ['claude-code', 'codex'] as const;

const FALLBACK_MODELS: Record<string, string[]> = {
  'claude-code': ['claude-sonnet-4-5', 'claude-opus-4-1', 'claude-haiku-4-5'],
  codex: ['gpt-5-codex', 'gpt-5'],
  openai: ['gpt-5', 'gpt-5-mini', 'gpt-5-nano'],
  anthropic: ['claude-sonnet-4-5', 'claude-opus-4-1', 'claude-haiku-4-5'],
};

/**
 * What each harness really does here: the built-in loop asks before tools as the permission mode says and
 * waits for answers to its questions; an agent CLI in print mode can do neither (it runs with full
 * access, and a question ends its run).
 */
const NATIVE_CONTROLS: Record<string, NativeControls> = {
  builtin: { commands: ['permission'], fullAccess: true, questions: true },
  cli: { commands: [], fullAccess: true, questions: false },
};

export interface Discovery {
  capabilities: Capabilities;
  /** The harnesses found, for the log and `svc runner status`. */
  harnesses: string[];
}

function isExecutable(path: string): boolean {
  try {
    if (!statSync(path).isFile()) return false;
    accessSync(path, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/** The program `command` resolves to on `path` (a name), or the path itself when it names one. */
export function findExecutable(command: string, path: string = process.env.PATH ?? ''): string | null {
  if (command.includes('/')) return isExecutable(command) ? resolve(command) : null;
  for (const dir of path.split(delimiter)) {
    if (!dir) continue;
    const candidate = join(dir, command);
    if (isExecutable(candidate)) return candidate;
  }
  return null;
}

const ModelsAnswer = z.object({ data: z.array(z.object({ id: z.string().min(1).max(200) })) });

/** The models an OpenAI-compatible endpoint lists (`GET <base>/models`), or null when it does not answer. */
export async function listEndpointModels(baseUrl: string, apiKey: string | undefined, timeoutMs = 5_000): Promise<Model[] | null> {
  try {
    const response = await fetch(`${baseUrl.replace(/\/+$/, '')}/models`, {
      headers: { accept: 'application/json', ...(apiKey ? { authorization: `Bearer ${apiKey}` } : {}) },
      signal: AbortSignal.timeout(timeoutMs),
    });
    if (!response.ok) return null;
    const parsed = ModelsAnswer.safeParse(await response.json());
    if (!parsed.success) return null;
    return [...new Set(parsed.data.data.map((model) => model.id))].map((id) => ({ id, name: id }));
  } catch {
    return null;
  }
}

export async function discoverCapabilities(home: RunnerHome, env: NodeJS.ProcessEnv): Promise<Discovery> {
  const configured = home.readModelsConfig();
  const harnesses: string[] = [];
  if (findExecutable(env.SVC_CLAUDE_CODE_COMMAND || 'claude', env.PATH ?? '')) harnesses.push('claude-code');
  if (findExecutable(env.SVC_CODEX_COMMAND || 'codex', env.PATH ?? '')) harnesses.push('codex');
  if (env.OPENAI_API_KEY) harnesses.push('openai');
  if (env.ANTHROPIC_API_KEY) harnesses.push('anthropic');
  if (env.OPENAI_COMPATIBLE_BASE_URL) harnesses.push('openai-compatible');

  const models: Record<string, Model[]> = {};
  const nativeControls: Record<string, NativeControls> = {};
  const sources = new Set<'configured' | 'discovered' | 'fallback'>();
  for (const harness of harnesses) {
    nativeControls[harness] = (BUILTIN_HARNESSES as readonly string[]).includes(harness) ? NATIVE_CONTROLS.builtin! : NATIVE_CONTROLS.cli!;
    const own = configured?.[harness];
    if (own) {
      models[harness] = own;
      sources.add('configured');
      continue;
    }
    if (harness === 'openai-compatible') {
      const listed = await listEndpointModels(env.OPENAI_COMPATIBLE_BASE_URL!, env.OPENAI_COMPATIBLE_API_KEY);
      if (listed) {
        models[harness] = listed;
        sources.add('discovered');
      }
      continue;
    }
    const fallback = FALLBACK_MODELS[harness];
    if (fallback) {
      models[harness] = fallback.map((id) => ({ id, name: id }));
      sources.add('fallback');
    }
  }
  for (const [harness, list] of Object.entries(models)) models[harness] = list.slice(0, RUNNER_LIMITS.modelsPerHarness);
  const modelSource = sources.has('configured') ? 'configured' : sources.has('discovered') ? 'discovered' : 'fallback';
  return { capabilities: { models, modelSource, nativeControls }, harnesses };
}
