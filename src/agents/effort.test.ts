import { describe, expect, it } from 'vitest';
import { parseAgentId, type AgentId } from '../domain/agents.js';
import { EFFORT, modelCallSettings } from './effort.js';

const agent = (id: string) => parseAgentId(id) as AgentId;

describe('the effort table', () => {
  it('keeps the step budgets of the built-in loop', () => {
    expect(Object.fromEntries(Object.entries(EFFORT).map(([effort, budget]) => [effort, budget.steps]))).toEqual({
      low: 10,
      medium: 25,
      high: 50,
      xhigh: 100,
      ultracode: 150,
    });
  });

  it('passes reasoning effort only to OpenAI models that reason, capping xhigh where it does not exist', () => {
    expect(modelCallSettings(agent('openai/gpt-5'), 'medium')).toEqual({ maxOutputTokens: 16_000, providerOptions: { openai: { reasoningEffort: 'medium' } } });
    expect(modelCallSettings(agent('openai/o4-mini'), 'xhigh').providerOptions).toEqual({ openai: { reasoningEffort: 'high' } });
    expect(modelCallSettings(agent('openai/gpt-5.2'), 'xhigh').providerOptions).toEqual({ openai: { reasoningEffort: 'xhigh' } });
    expect(modelCallSettings(agent('openai/gpt-4o'), 'high')).toEqual({ maxOutputTokens: 32_000 });
    expect(modelCallSettings(agent('openai/gpt-5-chat-latest'), 'high').providerOptions).toBeUndefined();
  });

  it('gives Anthropic models with extended thinking a thinking budget, and other providers only the output budget', () => {
    expect(modelCallSettings(agent('anthropic/claude-sonnet-4-5'), 'low')).toEqual({
      maxOutputTokens: 8_000,
      providerOptions: { anthropic: { thinking: { type: 'enabled', budgetTokens: 2_048 } } },
    });
    expect(modelCallSettings(agent('anthropic/claude-3-7-sonnet-20250219'), 'high').providerOptions).toEqual({ anthropic: { thinking: { type: 'enabled', budgetTokens: 16_000 } } });
    expect(modelCallSettings(agent('anthropic/claude-3-5-haiku-latest'), 'high').providerOptions).toBeUndefined();
    expect(modelCallSettings(agent('openai-compatible/gpt-5'), 'high')).toEqual({ maxOutputTokens: 32_000 });
  });
});
