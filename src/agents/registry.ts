/** Which harness runs an agent: the built-in loop for model APIs, an adapter for each agent CLI. */
import type { AgentId } from '../domain/agents.js';
import { assertNever } from '../domain/errors.js';
import { BuiltinHarness } from './builtin.js';
import { ClaudeCodeHarness } from './claude-code.js';
import type { CliCredentials } from './cli-harness.js';
import { CodexHarness } from './codex.js';
import type { CredentialProxy } from './credential-proxy.js';
import { resolveModel } from './models.js';
import type { Harness } from './types.js';

/**
 * How agent CLIs get their provider credentials; exactly one is needed for a CLI agent, and neither is
 * the default, so that no caller hands a CLI the platform key (or nothing) by omission.
 */
export interface HarnessOptions {
  /** The cloud: platform keys stay on the host and each CLI run reaches its provider through a lease. */
  credentialProxy?: CredentialProxy;
  /**
   * A desktop runner on the user's own computer: the CLI runs with its own login and configuration, and
   * no key or endpoint from `env` is passed to it.
   */
  cliOwnLogin?: boolean;
}

/** Throws ModelConfigError when the agent's key (or base URL) is not configured in `env`. */
export function harnessFor(agent: AgentId, env: NodeJS.ProcessEnv, options: HarnessOptions = {}): Harness {
  switch (agent.provider) {
    case 'openai':
    case 'anthropic':
    case 'openai-compatible': {
      const model = resolveModel(agent, env);
      return new BuiltinHarness({ model: () => model });
    }
    case 'claude-code':
      return new ClaudeCodeHarness(agent, env, cliCredentials(agent, options));
    case 'codex':
      return new CodexHarness(agent, env, cliCredentials(agent, options));
    default:
      return assertNever(agent.provider);
  }
}

function cliCredentials(agent: AgentId, { credentialProxy, cliOwnLogin }: HarnessOptions): CliCredentials {
  const id = `${agent.provider}/${agent.model}`;
  if (credentialProxy && cliOwnLogin) throw new Error(`the agent ${id} was given both a credential proxy and its own login; choose one`);
  if (credentialProxy) return { kind: 'proxy', proxy: credentialProxy };
  if (cliOwnLogin) return { kind: 'own-login' };
  throw new Error(`the agent ${id} runs a CLI in the sandbox, which needs a credential proxy (or, on a desktop runner, its own login)`);
}
