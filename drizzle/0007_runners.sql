CREATE TABLE "delegations" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"local_task_id" uuid NOT NULL,
	"invocation_id" text NOT NULL,
	"input_digest" text NOT NULL,
	"cloud_task_id" uuid,
	"dispatched_job_id" uuid,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "event_parts" (
	"job_id" uuid NOT NULL,
	"generation" integer NOT NULL,
	"sequence" integer NOT NULL,
	"part" integer NOT NULL,
	"digest" text NOT NULL,
	"size_bytes" integer NOT NULL,
	"data" "bytea" NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "event_parts_job_id_generation_sequence_part_pk" PRIMARY KEY("job_id","generation","sequence","part")
);
--> statement-breakpoint
CREATE TABLE "local_requests" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"job_id" uuid NOT NULL,
	"task_id" uuid NOT NULL,
	"request_id" text NOT NULL,
	"kind" text NOT NULL,
	"tool" text,
	"payload" jsonb NOT NULL,
	"status" text NOT NULL,
	"answer" jsonb,
	"answered_by_user_id" uuid,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"answered_at" timestamp with time zone
);
--> statement-breakpoint
CREATE TABLE "review_requests" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"runner_id" uuid NOT NULL,
	"task_id" uuid NOT NULL,
	"job_id" uuid,
	"path" text NOT NULL,
	"status" text NOT NULL,
	"content" "bytea",
	"message" text,
	"created_by_user_id" uuid,
	"delivered_at" timestamp with time zone,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"answered_at" timestamp with time zone
);
--> statement-breakpoint
CREATE TABLE "run_controls" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "run_controls_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"job_id" uuid NOT NULL,
	"sequence" integer NOT NULL,
	"type" text NOT NULL,
	"message" jsonb NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "runner_enrollments" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"runner_id" uuid NOT NULL,
	"credential_hash" text NOT NULL,
	"receipt" jsonb NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "runner_pairings" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"code_hash" text NOT NULL,
	"challenge" text NOT NULL,
	"user_id" uuid NOT NULL,
	"workspace_id" uuid NOT NULL,
	"name" text,
	"expires_at" timestamp with time zone NOT NULL,
	"used_at" timestamp with time zone,
	"failed_attempts" integer DEFAULT 0 NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "runner_projects" (
	"runner_id" uuid NOT NULL,
	"id" uuid NOT NULL,
	"name" text NOT NULL,
	"repositories" jsonb DEFAULT '[]'::jsonb NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"updated_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "runner_projects_runner_id_id_pk" PRIMARY KEY("runner_id","id")
);
--> statement-breakpoint
CREATE TABLE "runners" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"user_id" uuid NOT NULL,
	"workspace_id" uuid NOT NULL,
	"name" text NOT NULL,
	"platform" text,
	"runner_version" text,
	"credential_hash" text NOT NULL,
	"capabilities" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"work_version" bigint DEFAULT 0 NOT NULL,
	"enrolled_at" timestamp with time zone DEFAULT now() NOT NULL,
	"revoked_at" timestamp with time zone,
	"last_seen_at" timestamp with time zone,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "workspace_ssh_grants" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"token_hash" text NOT NULL,
	"user_id" uuid NOT NULL,
	"workspace_id" uuid NOT NULL,
	"runner_id" uuid,
	"job_id" uuid,
	"expires_at" timestamp with time zone NOT NULL,
	"revoked_at" timestamp with time zone,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "runner_id" uuid;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "runner_state" text;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "resume_parked" boolean DEFAULT false NOT NULL;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "parked" boolean DEFAULT false NOT NULL;--> statement-breakpoint
ALTER TABLE "messages" ADD COLUMN "metadata" jsonb;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "runner_id" uuid;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "project_id" uuid;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "permission_mode" text;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "native_mode" text;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "session_id" text;--> statement-breakpoint
ALTER TABLE "tasks" ADD COLUMN "linked_task_id" uuid;--> statement-breakpoint
ALTER TABLE "delegations" ADD CONSTRAINT "delegations_local_task_id_tasks_id_fk" FOREIGN KEY ("local_task_id") REFERENCES "tasks"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "delegations" ADD CONSTRAINT "delegations_cloud_task_id_tasks_id_fk" FOREIGN KEY ("cloud_task_id") REFERENCES "tasks"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "delegations" ADD CONSTRAINT "delegations_dispatched_job_id_jobs_id_fk" FOREIGN KEY ("dispatched_job_id") REFERENCES "jobs"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "event_parts" ADD CONSTRAINT "event_parts_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "local_requests" ADD CONSTRAINT "local_requests_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "local_requests" ADD CONSTRAINT "local_requests_task_id_tasks_id_fk" FOREIGN KEY ("task_id") REFERENCES "tasks"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "local_requests" ADD CONSTRAINT "local_requests_answered_by_user_id_users_id_fk" FOREIGN KEY ("answered_by_user_id") REFERENCES "users"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "review_requests" ADD CONSTRAINT "review_requests_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "review_requests" ADD CONSTRAINT "review_requests_task_id_tasks_id_fk" FOREIGN KEY ("task_id") REFERENCES "tasks"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "review_requests" ADD CONSTRAINT "review_requests_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "review_requests" ADD CONSTRAINT "review_requests_created_by_user_id_users_id_fk" FOREIGN KEY ("created_by_user_id") REFERENCES "users"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "run_controls" ADD CONSTRAINT "run_controls_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runner_enrollments" ADD CONSTRAINT "runner_enrollments_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runner_pairings" ADD CONSTRAINT "runner_pairings_user_id_users_id_fk" FOREIGN KEY ("user_id") REFERENCES "users"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runner_pairings" ADD CONSTRAINT "runner_pairings_workspace_id_workspaces_id_fk" FOREIGN KEY ("workspace_id") REFERENCES "workspaces"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runner_projects" ADD CONSTRAINT "runner_projects_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runners" ADD CONSTRAINT "runners_user_id_users_id_fk" FOREIGN KEY ("user_id") REFERENCES "users"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "runners" ADD CONSTRAINT "runners_workspace_id_workspaces_id_fk" FOREIGN KEY ("workspace_id") REFERENCES "workspaces"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "workspace_ssh_grants" ADD CONSTRAINT "workspace_ssh_grants_user_id_users_id_fk" FOREIGN KEY ("user_id") REFERENCES "users"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "workspace_ssh_grants" ADD CONSTRAINT "workspace_ssh_grants_workspace_id_workspaces_id_fk" FOREIGN KEY ("workspace_id") REFERENCES "workspaces"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "workspace_ssh_grants" ADD CONSTRAINT "workspace_ssh_grants_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "workspace_ssh_grants" ADD CONSTRAINT "workspace_ssh_grants_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "jobs"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "delegations_task_invocation_key" ON "delegations" USING btree ("local_task_id","invocation_id");--> statement-breakpoint
CREATE UNIQUE INDEX "local_requests_job_request_key" ON "local_requests" USING btree ("job_id","request_id");--> statement-breakpoint
CREATE INDEX "local_requests_task_idx" ON "local_requests" USING btree ("task_id");--> statement-breakpoint
CREATE INDEX "review_requests_runner_status_idx" ON "review_requests" USING btree ("runner_id","status");--> statement-breakpoint
CREATE UNIQUE INDEX "run_controls_job_sequence_key" ON "run_controls" USING btree ("job_id","sequence");--> statement-breakpoint
CREATE UNIQUE INDEX "run_controls_finish_once_key" ON "run_controls" USING btree ("job_id") WHERE "run_controls"."type" = 'finish_background_wait';--> statement-breakpoint
CREATE UNIQUE INDEX "runner_enrollments_credential_hash_key" ON "runner_enrollments" USING btree ("credential_hash");--> statement-breakpoint
CREATE UNIQUE INDEX "runner_pairings_code_hash_key" ON "runner_pairings" USING btree ("code_hash");--> statement-breakpoint
CREATE UNIQUE INDEX "runners_credential_hash_key" ON "runners" USING btree ("credential_hash");--> statement-breakpoint
CREATE INDEX "runners_user_idx" ON "runners" USING btree ("user_id");--> statement-breakpoint
CREATE UNIQUE INDEX "workspace_ssh_grants_token_hash_key" ON "workspace_ssh_grants" USING btree ("token_hash");--> statement-breakpoint
ALTER TABLE "jobs" ADD CONSTRAINT "jobs_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "tasks" ADD CONSTRAINT "tasks_runner_id_runners_id_fk" FOREIGN KEY ("runner_id") REFERENCES "runners"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "tasks" ADD CONSTRAINT "tasks_linked_task_id_tasks_id_fk" FOREIGN KEY ("linked_task_id") REFERENCES "tasks"("id") ON DELETE set null ON UPDATE no action;--> statement-breakpoint
CREATE INDEX "jobs_runner_idx" ON "jobs" USING btree ("runner_id","status") WHERE "jobs"."runner_id" is not null;--> statement-breakpoint
CREATE INDEX "tasks_runner_idx" ON "tasks" USING btree ("runner_id") WHERE "tasks"."runner_id" is not null;