CREATE TABLE "sign_in_throttles" (
	"subject" text PRIMARY KEY NOT NULL,
	"failures" integer NOT NULL,
	"last_failure_at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
ALTER TABLE "users" ADD COLUMN "created_by_workspace_id" uuid;--> statement-breakpoint
ALTER TABLE "users" ADD COLUMN "confirmed_at" timestamp with time zone;--> statement-breakpoint
CREATE INDEX "sign_in_throttles_last_failure_idx" ON "sign_in_throttles" USING btree ("last_failure_at");--> statement-breakpoint
ALTER TABLE "users" ADD CONSTRAINT "users_created_by_workspace_id_workspaces_id_fk" FOREIGN KEY ("created_by_workspace_id") REFERENCES "workspaces"("id") ON DELETE set null ON UPDATE no action;