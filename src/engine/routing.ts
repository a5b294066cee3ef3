/** Routing config management: the `default` config can be edited but never deleted. */
import { effortError, parseAgentId } from '../domain/agents.js';
import { ConflictError, NotFoundError, ValidationError } from '../domain/errors.js';
import { DEFAULT_ROUTING_NAME, routingNameError } from '../domain/routing.js';
import type { Effort, PutRoutingConfigBody } from '../protocol/rest.js';
import type { ValidationIssue } from '../protocol/errors.js';
import type { Db } from '../store/db.js';
import { deleteRoutingConfig, listRoutingConfigs, upsertRoutingConfig, type RoutingConfigRow } from '../store/routing.js';
import type { Caller } from './tasks.js';

export function listConfigs(db: Db, caller: Caller): Promise<RoutingConfigRow[]> {
  return listRoutingConfigs(db, caller.workspaceId);
}

export async function putConfig(db: Db, caller: Caller, name: string, body: PutRoutingConfigBody): Promise<RoutingConfigRow> {
  const issues: ValidationIssue[] = [];
  const nameProblem = routingNameError(name);
  if (nameProblem) issues.push({ field: 'name', message: nameProblem });
  const agent = parseAgentId(body.agent);
  if ('error' in agent) issues.push({ field: 'agent', message: agent.error });
  else {
    const problem = effortError(body.effort as Effort, agent);
    if (problem) issues.push({ field: 'effort', message: problem });
  }
  if (issues.length > 0) throw new ValidationError(issues);
  return upsertRoutingConfig(db, caller.workspaceId, name, {
    mode: body.mode,
    agent: body.agent,
    effort: body.effort,
    instructions: body.instructions?.trim() ? body.instructions : null,
  });
}

export async function deleteConfig(db: Db, caller: Caller, name: string): Promise<void> {
  if (name === DEFAULT_ROUTING_NAME) throw new ConflictError('The default routing config cannot be deleted');
  if (!(await deleteRoutingConfig(db, caller.workspaceId, name))) throw new NotFoundError('Routing config not found');
}
