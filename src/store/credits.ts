/** The credit ledger of each workspace: allowances, operator grants and metered model usage. */
import { and, eq, sql } from 'drizzle-orm';
import type { AgentId } from '../domain/agents.js';
import { costMicro } from '../domain/pricing.js';
import type { Db } from './db.js';
import { creditEntries } from './schema.js';

export type CreditEntry = typeof creditEntries.$inferSelect;

export async function addCredits(
  db: Db,
  input: { workspaceId: string; amountMicro: number; kind: 'allowance' | 'grant'; description: string },
): Promise<CreditEntry> {
  const [entry] = await db.insert(creditEntries).values(input).returning();
  if (!entry) throw new Error('insert returned no row');
  return entry;
}

/** Prices one model call and charges it to the job's workspace. */
export async function recordUsage(
  db: Db,
  input: { workspaceId: string; jobId: string; agentId: string; agent: AgentId; inputTokens: number; outputTokens: number },
): Promise<CreditEntry> {
  const [entry] = await db
    .insert(creditEntries)
    .values({
      workspaceId: input.workspaceId,
      jobId: input.jobId,
      kind: 'usage',
      amountMicro: -costMicro(input.agent, input),
      agent: input.agentId,
      inputTokens: input.inputTokens,
      outputTokens: input.outputTokens,
    })
    .returning();
  if (!entry) throw new Error('insert returned no row');
  return entry;
}

export async function creditBalance(db: Db, workspaceId: string): Promise<number> {
  const [row] = await db
    .select({ micro: sql<string>`coalesce(sum(${creditEntries.amountMicro}), 0)::text` })
    .from(creditEntries)
    .where(eq(creditEntries.workspaceId, workspaceId));
  return Number(row?.micro ?? 0);
}

export async function jobUsage(db: Db, jobId: string): Promise<{ costMicro: number; inputTokens: number; outputTokens: number }> {
  const [row] = await db
    .select({
      cost: sql<string>`coalesce(-sum(${creditEntries.amountMicro}), 0)::text`,
      input: sql<string>`coalesce(sum(${creditEntries.inputTokens}), 0)::text`,
      output: sql<string>`coalesce(sum(${creditEntries.outputTokens}), 0)::text`,
    })
    .from(creditEntries)
    .where(and(eq(creditEntries.jobId, jobId), eq(creditEntries.kind, 'usage')));
  return { costMicro: Number(row?.cost ?? 0), inputTokens: Number(row?.input ?? 0), outputTokens: Number(row?.output ?? 0) };
}
