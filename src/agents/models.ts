/**
 * Model API providers of the built-in harness, configured from the environment: platform keys
 * (OPENAI_API_KEY, ANTHROPIC_API_KEY, OPENAI_COMPATIBLE_API_KEY) and optional base URLs
 * (OPENAI_BASE_URL, ANTHROPIC_BASE_URL, OPENAI_COMPATIBLE_BASE_URL, the last one required).
 */
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import type { LanguageModel } from 'ai';
import type { AgentId } from '../domain/agents.js';

export class ModelConfigError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ModelConfigError';
  }
}

/** A variable the agent cannot run without (its key, mostly); a missing one fails the run naming it. */
export function requireEnv(env: NodeJS.ProcessEnv, name: string, agentId: string): string {
  const value = env[name];
  if (!value) throw new ModelConfigError(`${name} is not set: the agent ${agentId} needs it`);
  return value;
}

export function resolveModel(agent: AgentId, env: NodeJS.ProcessEnv = process.env): LanguageModel {
  const id = `${agent.provider}/${agent.model}`;
  const need = (name: string): string => requireEnv(env, name, id);
  switch (agent.provider) {
    case 'openai':
      return createOpenAI({ apiKey: need('OPENAI_API_KEY'), ...(env.OPENAI_BASE_URL ? { baseURL: env.OPENAI_BASE_URL } : {}) }).chat(agent.model);
    case 'anthropic':
      return createAnthropic({ apiKey: need('ANTHROPIC_API_KEY'), ...(env.ANTHROPIC_BASE_URL ? { baseURL: env.ANTHROPIC_BASE_URL } : {}) })(agent.model);
    case 'openai-compatible':
      return createOpenAICompatible({
        name: 'openai-compatible',
        baseURL: need('OPENAI_COMPATIBLE_BASE_URL'),
        ...(env.OPENAI_COMPATIBLE_API_KEY ? { apiKey: env.OPENAI_COMPATIBLE_API_KEY } : {}),
        includeUsage: true,
      }).chatModel(agent.model);
    case 'claude-code':
    case 'codex':
      throw new ModelConfigError(`${id} runs through its CLI harness, not the built-in agent loop`);
  }
}
