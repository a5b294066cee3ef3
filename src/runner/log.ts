/** The daemon's log: one line per thing worth knowing, on stderr (stdout stays for command output). */
export type Log = (message: string) => void;

export const stderrLog: Log = (message) => {
  process.stderr.write(`${new Date().toISOString()} svc runner: ${message}\n`);
};

export const silentLog: Log = () => undefined;

export function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
