/** How every `svc` command ends on an error: one line on stderr and a non-zero exit. */
export class CliError extends Error {
  constructor(
    message: string,
    readonly exitCode = 1,
  ) {
    super(message);
    this.name = 'CliError';
  }
}

export function describeError(error: unknown): string {
  const issues = (error as { details?: { issues?: Array<{ field: string; message: string }> } }).details?.issues;
  if (Array.isArray(issues) && issues.length > 0) {
    return issues.map((issue) => `${issue.field} ${issue.message}`).join('; ');
  }
  if (error instanceof Error) {
    const code = (error as NodeJS.ErrnoException).code;
    if (code === 'ECONNREFUSED') return `cannot connect: ${error.message}`;
    return error.message.split('\n', 1)[0] ?? String(error);
  }
  return String(error);
}

export function fail(error: unknown): never {
  const exitCode = error instanceof CliError ? error.exitCode : 1;
  process.stderr.write(`svc: ${describeError(error)}\n`);
  process.exit(exitCode);
}

export function table(rows: ReadonlyArray<Record<string, string>>): string {
  if (rows.length === 0) return '';
  const headers = Object.keys(rows[0]!);
  const widths = headers.map((header) => Math.max(header.length, ...rows.map((row) => (row[header] ?? '').length)));
  const line = (cells: string[]) => cells.map((cell, i) => cell.padEnd(widths[i]!)).join('  ').trimEnd();
  return [line(headers.map((h) => h.toUpperCase())), ...rows.map((row) => line(headers.map((h) => row[h] ?? '')))].join('\n') + '\n';
}
