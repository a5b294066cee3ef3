/**
 * What each effort buys, in one table that every harness reads: the built-in loop's step budget and
 * per-call output tokens, the reasoning effort of models that reason, and Anthropic's thinking budget.
 * CLI harnesses map the same rows onto their own flags (Claude Code `--max-turns`, Codex
 * `model_reasoning_effort`).
 */
import type { JSONValue } from 'ai';
import type { AgentId } from '../domain/agents.js';
import type { Effort } from '../protocol/rest.js';

export type ReasoningEffort = 'low' | 'medium' | 'high' | 'xhigh';

export interface EffortBudget {
  /** Model steps of the built-in loop (a step is one model call and its tool calls); CLI turns. */
  steps: number;
  /** Output tokens one model call may produce (thinking comes on top, see `thinkingTokens`). */
  maxOutputTokens: number;
  reasoning: ReasoningEffort;
  /** Anthropic extended-thinking budget per call. */
  thinkingTokens: number;
  /** Rounds of a `goal` run: the agent, then the goal's check. */
  goalIterations: number;
}

export const EFFORT: Record<Effort, EffortBudget> = {
  low: { steps: 10, maxOutputTokens: 8_000, reasoning: 'low', thinkingTokens: 2_048, goalIterations: 2 },
  medium: { steps: 25, maxOutputTokens: 16_000, reasoning: 'medium', thinkingTokens: 8_000, goalIterations: 3 },
  high: { steps: 50, maxOutputTokens: 32_000, reasoning: 'high', thinkingTokens: 16_000, goalIterations: 5 },
  xhigh: { steps: 100, maxOutputTokens: 32_000, reasoning: 'xhigh', thinkingTokens: 32_000, goalIterations: 8 },
  // Only claude-code offers it (domain/agents.ts); the row still exists so that lookups stay total.
  ultracode: { steps: 150, maxOutputTokens: 64_000, reasoning: 'xhigh', thinkingTokens: 48_000, goalIterations: 10 },
};

/**
 * OpenAI models that take `reasoningEffort`, by name: the o-series and GPT-5 onwards, except the
 * `-chat` variants, which do not reason. `xhigh` exists from GPT-5.1 on; older reasoning models get `high`.
 */
export function openAIReasoningEffort(model: string, effort: Effort): ReasoningEffort | null {
  const name = model.toLowerCase();
  if (!/^(o\d|gpt-([5-9]|\d\d))/.test(name) || name.includes('-chat')) return null;
  const reasoning = EFFORT[effort].reasoning;
  const hasXHigh = /^gpt-(5\.[1-9]|[6-9]|\d\d)/.test(name);
  return reasoning === 'xhigh' && !hasXHigh ? 'high' : reasoning;
}

/**
 * Anthropic models with extended thinking, by name: Claude 3.7 and every family from 4 on. Models that
 * only think adaptively (Opus 4.6 and later) get the budget too: @ai-sdk/anthropic turns it into
 * adaptive thinking for them, with a warning.
 */
export function anthropicThinkingTokens(model: string, effort: Effort): number | null {
  return /^claude-(3-7-|[a-z]+-([4-9]|\d\d))/.test(model.toLowerCase()) ? EFFORT[effort].thinkingTokens : null;
}

/** The per-call settings of the built-in loop's model calls: output budget and, where the model has it, reasoning. */
export function modelCallSettings(agent: AgentId, effort: Effort): { maxOutputTokens: number; providerOptions?: Record<string, Record<string, JSONValue>> } {
  const maxOutputTokens = EFFORT[effort].maxOutputTokens;
  if (agent.provider === 'openai') {
    const reasoningEffort = openAIReasoningEffort(agent.model, effort);
    if (reasoningEffort) return { maxOutputTokens, providerOptions: { openai: { reasoningEffort } } };
  }
  if (agent.provider === 'anthropic') {
    const budgetTokens = anthropicThinkingTokens(agent.model, effort);
    if (budgetTokens) return { maxOutputTokens, providerOptions: { anthropic: { thinking: { type: 'enabled', budgetTokens } } } };
  }
  return { maxOutputTokens };
}
