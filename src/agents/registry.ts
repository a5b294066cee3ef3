/** Which harness runs an agent: the built-in loop for model APIs, an adapter for each agent CLI. */
import type { AgentId } from '../domain/agents.js';
import { assertNever } from '../domain/errors.js';
import { BuiltinHarness } from './builtin.js';
import { ClaudeCodeHarness } from './claude-code.js';
import { CodexHarness } from './codex.js';
import { resolveModel } from './models.js';
import type { Harness } from './types.js';

/** Throws ModelConfigError when the agent's key (or base URL) is not configured in `env`. */
export function harnessFor(agent: AgentId, env: NodeJS.ProcessEnv): Harness {
  switch (agent.provider) {
    case 'openai':
    case 'anthropic':
    case 'openai-compatible': {
      const model = resolveModel(agent, env);
      return new BuiltinHarness({ model: () => model });
    }
    case 'claude-code':
      return new ClaudeCodeHarness(agent, env);
    case 'codex':
      return new CodexHarness(agent, env);
    default:
      return assertNever(agent.provider);
  }
}
