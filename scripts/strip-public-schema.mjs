// drizzle-kit writes `"public".` into foreign keys; svc's migrations must apply in any schema
// (tests give each file a schema of its own, operators may use search_path), so it is removed.
import { readdirSync, readFileSync, writeFileSync } from 'node:fs';

for (const file of readdirSync('drizzle').filter((name) => name.endsWith('.sql'))) {
  const path = `drizzle/${file}`;
  const text = readFileSync(path, 'utf8');
  const stripped = text.replaceAll('"public".', '');
  if (stripped !== text) writeFileSync(path, stripped);
}
