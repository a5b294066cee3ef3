-- Rate-limit counters need no crash safety: losing the last seconds of counts on a crash is harmless,
-- while WAL for them would make every API request wait on a log write. Written by hand (drizzle-kit does
-- not model UNLOGGED); the schema in src/store/schema.ts is unchanged.
ALTER TABLE "rate_limit_buckets" SET UNLOGGED;
