CREATE TABLE "forks" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"workspace_id" uuid NOT NULL,
	"task_id" uuid,
	"name" text NOT NULL,
	"host" text NOT NULL,
	"mode" text NOT NULL,
	"state" text NOT NULL,
	"job_id" uuid,
	"last_used_at" timestamp with time zone DEFAULT now() NOT NULL,
	"state_changed_at" timestamp with time zone DEFAULT now() NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "repositories" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"workspace_id" uuid NOT NULL,
	"full_name" text NOT NULL,
	"dir" text NOT NULL,
	"default_branch" text NOT NULL,
	"source" text NOT NULL,
	"last_pr_number" integer DEFAULT 0 NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "repository_id" uuid;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "body" text;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "head_branch" text;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "base_branch" text;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "head_sha" text;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "base_sha" text;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "checks" jsonb;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "job_id" uuid;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "merged_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD COLUMN "closed_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "forks" ADD CONSTRAINT "forks_workspace_id_workspaces_id_fk" FOREIGN KEY ("workspace_id") REFERENCES "workspaces"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "forks" ADD CONSTRAINT "forks_task_id_tasks_id_fk" FOREIGN KEY ("task_id") REFERENCES "tasks"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "forks" ADD CONSTRAINT "forks_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "repositories" ADD CONSTRAINT "repositories_workspace_id_workspaces_id_fk" FOREIGN KEY ("workspace_id") REFERENCES "workspaces"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "forks_host_workspace_name_key" ON "forks" USING btree ("host","workspace_id","name");--> statement-breakpoint
CREATE INDEX "forks_host_state_idx" ON "forks" USING btree ("host","state","state_changed_at");--> statement-breakpoint
CREATE INDEX "forks_task_idx" ON "forks" USING btree ("task_id");--> statement-breakpoint
CREATE UNIQUE INDEX "repositories_workspace_full_name_key" ON "repositories" USING btree ("workspace_id","full_name");--> statement-breakpoint
CREATE UNIQUE INDEX "repositories_workspace_dir_key" ON "repositories" USING btree ("workspace_id","dir");--> statement-breakpoint
ALTER TABLE "pull_requests" ADD CONSTRAINT "pull_requests_repository_id_repositories_id_fk" FOREIGN KEY ("repository_id") REFERENCES "repositories"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "pull_requests" ADD CONSTRAINT "pull_requests_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "pull_requests_repository_number_key" ON "pull_requests" USING btree ("repository_id","pr_number");