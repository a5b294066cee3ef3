import type { Effort, JobType, TaskMode, UserIntent, RoutingMode } from '../protocol/rest.js';
import { assertNever } from './errors.js';

/** Harness providers an agent id may name. `claude-code` and `codex` are agent CLIs; the rest are model APIs. */
export const AGENT_PROVIDERS = ['openai', 'anthropic', 'openai-compatible', 'claude-code', 'codex'] as const;
export type AgentProvider = (typeof AGENT_PROVIDERS)[number];

/** The only harness that offers the `ultracode` effort. */
export const ULTRACODE_PROVIDER: AgentProvider = 'claude-code';

/**
 * Whether the provider is an agent CLI: it runs on its own inside the sandbox, and its network reaches
 * only its provider's API through the credential proxy (never the fork's dev servers).
 */
export function isAgentCli(provider: AgentProvider): boolean {
  switch (provider) {
    case 'claude-code':
    case 'codex':
      return true;
    case 'openai':
    case 'anthropic':
    case 'openai-compatible':
      return false;
    default:
      return assertNever(provider);
  }
}

export interface AgentId {
  provider: AgentProvider;
  model: string;
}

/** Parses a complete `<provider>/<model>` id; returns a reason when it is not one. */
export function parseAgentId(value: string): AgentId | { error: string } {
  const slash = value.indexOf('/');
  if (slash < 0) {
    return { error: 'must be a complete <provider>/<model> id; a provider alone is not enough' };
  }
  const provider = value.slice(0, slash);
  const model = value.slice(slash + 1);
  if (!(AGENT_PROVIDERS as readonly string[]).includes(provider)) {
    return { error: `unknown provider "${provider}"; expected one of ${AGENT_PROVIDERS.join(', ')}` };
  }
  if (!/^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$/.test(model)) {
    return { error: 'model must be 1-200 characters of letters, digits and . _ : / @ + -' };
  }
  return { provider: provider as AgentProvider, model };
}

export function effortError(effort: Effort, agent: AgentId): string | null {
  if (effort === 'ultracode' && agent.provider !== ULTRACODE_PROVIDER) {
    return `effort "ultracode" is available only with ${ULTRACODE_PROVIDER}/<model> agents`;
  }
  return null;
}

export function modeOfIntent(intent: UserIntent): TaskMode {
  switch (intent) {
    case 'PLAN':
      return 'plan';
    case 'SWE':
      return 'agent';
    case 'ASK':
      return 'ask';
    case 'DEV_ENVIRONMENT':
      return 'dev_env';
    case 'GOAL':
      return 'goal';
    default:
      return assertNever(intent);
  }
}

/** The mode a job of this type runs in (the inverse of jobTypeOfMode, plus an approved plan's implementation). */
export function modeOfJobType(type: JobType): TaskMode {
  switch (type) {
    case 'SWE':
    case 'IMPLEMENT_PLAN':
      return 'agent';
    case 'PLAN':
      return 'plan';
    case 'ASK':
      return 'ask';
    case 'GOAL':
      return 'goal';
    case 'DEV_ENVIRONMENT':
      return 'dev_env';
    default:
      return assertNever(type);
  }
}

/** Modes that change nothing: the agent gets no write tools and a read-only fork, and nothing is delivered. */
export function isReadOnlyMode(mode: TaskMode): boolean {
  return mode === 'ask' || mode === 'plan';
}

export function jobTypeOfMode(mode: TaskMode | RoutingMode): JobType {
  switch (mode) {
    case 'agent':
      return 'SWE';
    case 'plan':
      return 'PLAN';
    case 'ask':
      return 'ASK';
    case 'goal':
      return 'GOAL';
    case 'dev_env':
      return 'DEV_ENVIRONMENT';
    default:
      return assertNever(mode);
  }
}
