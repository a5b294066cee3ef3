import { describe, expect, it } from 'vitest';
import { costMicro, formatCredits, MICRO, parseCredits, PLAN_ALLOWANCE, priceOf } from './pricing.js';

describe('pricing', () => {
  it('prices known models per million tokens, exactly, in micro-credits', () => {
    // 1,000 input tokens at $3/M + 2,000 output at $15/M = $0.003 + $0.03.
    expect(costMicro({ provider: 'anthropic', model: 'claude-sonnet-4-5' }, { inputTokens: 1000, outputTokens: 2000 })).toBe(33_000);
    expect(costMicro({ provider: 'openai', model: 'gpt-5' }, { inputTokens: 1_000_000, outputTokens: 0 })).toBe(1_250_000);
    expect(costMicro({ provider: 'openai', model: 'gpt-5-nano' }, { inputTokens: 1, outputTokens: 1 })).toBe(1);
  });

  it('bills agent CLIs through their vendor and unknown models at the flagship price', () => {
    expect(priceOf({ provider: 'claude-code', model: 'claude-sonnet-4-5' })).toEqual({ input: 3, output: 15 });
    expect(priceOf({ provider: 'codex', model: 'gpt-5-codex' })).toEqual({ input: 1.25, output: 10 });
    expect(priceOf({ provider: 'anthropic', model: 'claude-next' })).toEqual({ input: 15, output: 75 });
    expect(priceOf({ provider: 'openai-compatible', model: 'llama' })).toEqual({ input: 0, output: 0 });
  });

  it('parses and formats credit amounts', () => {
    expect(parseCredits('25')).toBe(25 * MICRO);
    expect(parseCredits('2.5')).toBe(2_500_000);
    expect(parseCredits('0.000001')).toBe(1);
    for (const bad of ['0', '-1', '1.0000001', 'ten', '', '1e3']) expect(parseCredits(bad)).toBeNull();
    expect(formatCredits(102_500_000)).toBe('102.500000');
    expect(formatCredits(-33_000)).toBe('-0.033000');
    expect(PLAN_ALLOWANCE).toEqual({ free: 5, pro: 100, max: 500 });
  });
});
