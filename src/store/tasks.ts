/** Tasks, their thread, jobs and pull requests. Every query is scoped to one workspace by its caller. */
import { and, asc, desc, eq, inArray, isNotNull, isNull, lt, sql } from 'drizzle-orm';
import type { ParsedFile } from '../domain/files.js';
import { isUuid } from '../domain/slugs.js';
import { notify, type Db } from './db.js';
import { jobs, messageFiles, messages, pullRequests, tasks } from './schema.js';

export type TaskRow = typeof tasks.$inferSelect;
export type JobRow = typeof jobs.$inferSelect;
export type PullRequestRow = typeof pullRequests.$inferSelect;
export type NewTask = Omit<typeof tasks.$inferInsert, 'id' | 'seq' | 'slug'>;
export type NewJob = Omit<typeof jobs.$inferInsert, 'id' | 'seq'>;

export interface TaskView {
  task: TaskRow;
  prs: PullRequestRow[];
  latestJob: JobRow | null;
}

/**
 * Who reads tasks: a workspace, and the signed-in user if there is one. Local tasks (run by a desktop
 * runner) are their runner's owner's alone: a workspace API key (no user) never sees one, nor does
 * another member of the workspace.
 */
export interface TaskScope {
  workspaceId: string;
  userId: string | null;
}

/** The visibility rule above as a condition; `userId` may be a placeholder of a prepared statement. */
function visibleTo(userId: string | null | ReturnType<typeof sql.placeholder>) {
  return sql`(${tasks.runnerId} is null or exists (select 1 from runners r where r.id = ${tasks.runnerId} and r.user_id = ${userId}::uuid))`;
}

function byIdOrSlug(scope: TaskScope, idOrSlug: string) {
  return and(
    eq(tasks.workspaceId, scope.workspaceId),
    isUuid(idOrSlug) ? eq(tasks.id, idOrSlug.toLowerCase()) : eq(tasks.slug, idOrSlug),
    visibleTo(scope.userId),
  );
}

const taskViewRelations = {
  jobs: { orderBy: [desc(jobs.seq)], limit: 1 },
  pullRequests: { orderBy: [asc(pullRequests.createdAt), asc(pullRequests.prNumber)] },
};

function toView(row: (TaskRow & { jobs: JobRow[]; pullRequests: PullRequestRow[] }) | undefined): TaskView | null {
  if (!row) return null;
  const { jobs: latest, pullRequests: prs, ...task } = row;
  return { task, prs, latestJob: latest[0] ?? null };
}

/** The task with its pull requests and latest job, in one query (also inside a transaction). */
export async function findTaskView(db: Db, scope: TaskScope, idOrSlug: string): Promise<TaskView | null> {
  return toView(await db.query.tasks.findFirst({ where: byIdOrSlug(scope, idOrSlug), with: taskViewRelations }));
}

function prepareTaskView(db: Db, by: 'id' | 'slug') {
  const key = by === 'id' ? tasks.id : tasks.slug;
  return db.query.tasks
    .findFirst({
      where: and(eq(tasks.workspaceId, sql.placeholder('workspaceId')), eq(key, sql.placeholder('key')), visibleTo(sql.placeholder('userId'))),
      with: taskViewRelations,
    })
    .prepare(`svc_task_view_by_${by}`);
}

const preparedTaskViews = new WeakMap<Db, Record<'id' | 'slug', ReturnType<typeof prepareTaskView>>>();

/**
 * findTaskView as a prepared statement, planned once per connection: for the read path of every
 * request that names a task. Not for use inside a transaction.
 */
export async function readTaskView(db: Db, scope: TaskScope, idOrSlug: string): Promise<TaskView | null> {
  let prepared = preparedTaskViews.get(db);
  if (!prepared) {
    prepared = { id: prepareTaskView(db, 'id'), slug: prepareTaskView(db, 'slug') };
    preparedTaskViews.set(db, prepared);
  }
  const uuid = isUuid(idOrSlug);
  const row = await prepared[uuid ? 'id' : 'slug'].execute({ workspaceId: scope.workspaceId, userId: scope.userId, key: uuid ? idOrSlug.toLowerCase() : idOrSlug });
  return toView(row as Parameters<typeof toView>[0]);
}

/** Locks the task row for the rest of the transaction; actions on one task serialise on it. */
export async function lockTask(tx: Db, scope: TaskScope, idOrSlug: string): Promise<TaskRow | null> {
  const [row] = await tx.select().from(tasks).where(byIdOrSlug(scope, idOrSlug)).for('update');
  return row ?? null;
}

export interface TaskListFilter {
  limit: number;
  beforeSeq: number | null;
  statuses: string[] | null;
  archived: 'exclude' | 'include' | 'only';
}

export interface TaskListRow {
  task: TaskRow;
  prs: PullRequestRow[];
  latestJobStatus: string | null;
}

/** Newest first, keyset-paginated on `seq`; fetches one row more than asked to tell whether more exist. */
export async function listTasks(db: Db, scope: TaskScope, filter: TaskListFilter): Promise<{ rows: TaskListRow[]; hasMore: boolean }> {
  const conditions = [eq(tasks.workspaceId, scope.workspaceId), visibleTo(scope.userId)];
  if (filter.beforeSeq !== null) conditions.push(lt(tasks.seq, filter.beforeSeq));
  if (filter.statuses) conditions.push(inArray(tasks.status, filter.statuses));
  if (filter.archived === 'exclude') conditions.push(isNull(tasks.archivedAt));
  if (filter.archived === 'only') conditions.push(isNotNull(tasks.archivedAt));
  const rows = await db.query.tasks.findMany({
    where: and(...conditions),
    orderBy: [desc(tasks.seq)],
    limit: filter.limit + 1,
    with: {
      jobs: { columns: { status: true }, orderBy: [desc(jobs.seq)], limit: 1 },
      pullRequests: { orderBy: [asc(pullRequests.createdAt), asc(pullRequests.prNumber)] },
    },
  });
  const hasMore = rows.length > filter.limit;
  return {
    hasMore,
    rows: rows.slice(0, filter.limit).map(({ jobs: latest, pullRequests: prs, ...task }) => ({
      task,
      prs,
      latestJobStatus: latest[0]?.status ?? null,
    })),
  };
}

/** Inserts a task under a fresh slug, drawing another slug on the (rare) collision. */
export async function insertTask(tx: Db, values: NewTask, makeSlug: () => string): Promise<TaskRow> {
  for (let attempt = 0; attempt < 5; attempt++) {
    const [row] = await tx
      .insert(tasks)
      .values({ ...values, slug: makeSlug() })
      .onConflictDoNothing({ target: [tasks.workspaceId, tasks.slug] })
      .returning();
    if (row) return row;
  }
  throw new Error('could not draw a unique task slug in 5 attempts');
}

export async function insertMessage(
  tx: Db,
  input: {
    taskId: string;
    role: 'user' | 'agent';
    body: string;
    userIntent?: string | null;
    files?: readonly ParsedFile[];
    metadata?: (typeof messages.$inferInsert)['metadata'];
  },
): Promise<typeof messages.$inferSelect> {
  const [message] = await tx
    .insert(messages)
    .values({ taskId: input.taskId, role: input.role, body: input.body, userIntent: input.userIntent ?? null, metadata: input.metadata ?? null })
    .returning();
  if (!message) throw new Error('insert returned no row');
  const files = input.files ?? [];
  if (files.length > 0) {
    await tx.insert(messageFiles).values(
      files.map((file, position) =>
        file.kind === 'inline'
          ? {
              messageId: message.id,
              position,
              name: file.name,
              kind: file.kind,
              mediaType: file.mediaType,
              sizeBytes: file.sizeBytes,
              sha256: file.sha256,
              content: file.content,
            }
          : { messageId: message.id, position, name: file.name, kind: file.kind, url: file.url },
      ),
    );
  }
  return message;
}

/** The channel executors LISTEN on; a NOTIFY on it means a job may have become runnable. */
export const JOBS_CHANNEL = 'svc_jobs';

/** Inserts a job; a pending one wakes the executors when the transaction commits. */
export async function insertJob(tx: Db, values: NewJob): Promise<JobRow> {
  const [row] = await tx.insert(jobs).values(values).returning();
  if (!row) throw new Error('insert returned no row');
  if (row.status === 'PENDING') await notify(tx, JOBS_CHANNEL, row.id);
  return row;
}

/** Updates the task if its status is one of `from` (when given); null when it was not. */
export async function updateTask(
  tx: Db,
  taskId: string,
  set: Partial<Pick<TaskRow, 'status' | 'archivedAt' | 'title'>>,
  from?: readonly string[],
): Promise<TaskRow | null> {
  const where = from ? and(eq(tasks.id, taskId), inArray(tasks.status, [...from])) : eq(tasks.id, taskId);
  const [row] = await tx
    .update(tasks)
    .set({ ...set, updatedAt: sql`now()` })
    .where(where)
    .returning();
  return row ?? null;
}

/** Moves a job between statuses if it is in one of `from`; null when it was not (someone else moved it). */
export async function updateJob(
  tx: Db,
  jobId: string,
  set: Partial<Omit<JobRow, 'id' | 'seq' | 'taskId' | 'workspaceId' | 'createdAt'>>,
  from: readonly string[],
): Promise<JobRow | null> {
  const [row] = await tx
    .update(jobs)
    .set({ ...set, updatedAt: sql`now()` })
    .where(and(eq(jobs.id, jobId), inArray(jobs.status, [...from])))
    .returning();
  return row ?? null;
}

export async function cancelActiveJobs(tx: Db, taskId: string, activeStatuses: readonly string[]): Promise<JobRow[]> {
  return tx
    .update(jobs)
    .set({ status: 'CANCELLED', completedAt: sql`now()`, updatedAt: sql`now()` })
    .where(and(eq(jobs.taskId, taskId), inArray(jobs.status, [...activeStatuses])))
    .returning();
}

export async function findLatestJob(tx: Db, taskId: string): Promise<JobRow | null> {
  const [row] = await tx.select().from(jobs).where(eq(jobs.taskId, taskId)).orderBy(desc(jobs.seq)).limit(1);
  return row ?? null;
}

export async function countJobs(tx: Db, taskId: string, statuses: readonly string[]): Promise<number> {
  const [row] = await tx
    .select({ n: sql<number>`count(*)::int` })
    .from(jobs)
    .where(and(eq(jobs.taskId, taskId), inArray(jobs.status, [...statuses])));
  return row?.n ?? 0;
}

/** A page of a task's jobs: the newest `limit` older than `beforeSeq`, returned oldest first. */
export async function listJobs(
  db: Db,
  taskId: string,
  page: { limit: number; beforeSeq: number | null },
): Promise<{ rows: JobRow[]; hasMore: boolean }> {
  const conditions = [eq(jobs.taskId, taskId)];
  if (page.beforeSeq !== null) conditions.push(lt(jobs.seq, page.beforeSeq));
  const rows = await db
    .select()
    .from(jobs)
    .where(and(...conditions))
    .orderBy(desc(jobs.seq))
    .limit(page.limit + 1);
  const hasMore = rows.length > page.limit;
  return { rows: rows.slice(0, page.limit).reverse(), hasMore };
}

export async function findJob(db: Db, jobId: string): Promise<JobRow | null> {
  const [row] = await db.select().from(jobs).where(eq(jobs.id, jobId));
  return row ?? null;
}

export async function listMessages(db: Db, taskId: string) {
  return db.query.messages.findMany({
    where: eq(messages.taskId, taskId),
    orderBy: [asc(messages.seq)],
    with: { files: { orderBy: [asc(messageFiles.position)] } },
  });
}

/** Inserts or refreshes the task's pull requests, keyed by repository and number. */
export async function upsertPullRequests(
  tx: Db,
  taskId: string,
  prs: ReadonlyArray<{ repoFullName: string; prNumber: number; prUrl: string; title: string; state: 'open' | 'merged' | 'closed' }>,
): Promise<PullRequestRow[]> {
  if (prs.length === 0) return [];
  return tx
    .insert(pullRequests)
    .values(prs.map((pr) => ({ taskId, ...pr })))
    .onConflictDoUpdate({
      target: [pullRequests.taskId, pullRequests.repoFullName, pullRequests.prNumber],
      set: {
        prUrl: sql`excluded.pr_url`,
        title: sql`excluded.title`,
        state: sql`excluded.state`,
        updatedAt: sql`now()`,
      },
    })
    .returning();
}
