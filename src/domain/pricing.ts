/**
 * Credits: 1 credit = 1 USD of model compute at cost, kept as integer micro-credits so that sums are
 * exact. Prices are per million tokens; docs/credits.md repeats this table.
 */
import type { AgentId } from './agents.js';

export const MICRO = 1_000_000;

export interface Price {
  /** USD per million input tokens. */
  input: number;
  /** USD per million output tokens. */
  output: number;
}

/** Known models, by the model API they bill through. */
const MODEL_PRICES: Record<'anthropic' | 'openai', Record<string, Price>> = {
  anthropic: {
    'claude-opus-4-1': { input: 15, output: 75 },
    'claude-opus-4': { input: 15, output: 75 },
    'claude-sonnet-4-5': { input: 3, output: 15 },
    'claude-sonnet-4': { input: 3, output: 15 },
    'claude-haiku-4-5': { input: 1, output: 5 },
  },
  openai: {
    'gpt-5': { input: 1.25, output: 10 },
    'gpt-5-codex': { input: 1.25, output: 10 },
    'gpt-5-mini': { input: 0.25, output: 2 },
    'gpt-5-nano': { input: 0.05, output: 0.4 },
    'gpt-4.1': { input: 2, output: 8 },
  },
};

/** An unknown model of a billed provider costs what that provider's flagship does, never nothing. */
const PROVIDER_DEFAULT: Record<'anthropic' | 'openai', Price> = {
  anthropic: { input: 15, output: 75 },
  openai: { input: 1.25, output: 10 },
};

/** Agent CLIs bill through the model API of their vendor. */
function billingProvider(agent: AgentId): 'anthropic' | 'openai' | null {
  switch (agent.provider) {
    case 'anthropic':
    case 'claude-code':
      return 'anthropic';
    case 'openai':
    case 'codex':
      return 'openai';
    case 'openai-compatible':
      // A self-hosted or third-party endpoint: the platform pays nothing for it.
      return null;
  }
}

export function priceOf(agent: AgentId): Price {
  const provider = billingProvider(agent);
  if (provider === null) return { input: 0, output: 0 };
  return MODEL_PRICES[provider][agent.model] ?? PROVIDER_DEFAULT[provider];
}

/** The cost of one model call in micro-credits, rounded up. */
export function costMicro(agent: AgentId, usage: { inputTokens: number; outputTokens: number }): number {
  const price = priceOf(agent);
  // price per million tokens × tokens = micro-USD exactly.
  return Math.ceil(price.input * usage.inputTokens + price.output * usage.outputTokens);
}

/** Monthly model-compute allowance of each plan, in credits. */
export const PLAN_ALLOWANCE: Record<'free' | 'pro' | 'max', number> = { free: 5, pro: 100, max: 500 };

/** Parses an operator's credit amount (`25`, `2.5`, up to six decimals) into micro-credits. */
export function parseCredits(value: string): number | null {
  const match = /^(\d{1,9})(?:\.(\d{1,6}))?$/.exec(value.trim());
  if (!match?.[1]) return null;
  const micro = Number(match[1]) * MICRO + Number((match[2] ?? '').padEnd(6, '0'));
  return micro > 0 ? micro : null;
}

export function formatCredits(micro: number): string {
  const sign = micro < 0 ? '-' : '';
  const abs = Math.abs(micro);
  return `${sign}${Math.floor(abs / MICRO)}.${String(abs % MICRO).padStart(6, '0')}`;
}
