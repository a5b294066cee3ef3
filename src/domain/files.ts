/**
 * Attachments on task creation and follow-ups (SPEC.md "POST /tasks" `files`): `data:` URLs are decoded and
 * stored, `http(s):` URLs are kept as references and never fetched, and a browser `blob:` URL is not an
 * uploaded file, so it makes the task fail with an error naming the file.
 */
import { createHash } from 'node:crypto';
import { FILE_LIMITS, type FileInput } from '../protocol/rest.js';
import type { ValidationIssue } from '../protocol/errors.js';

export type ParsedFile =
  | { kind: 'inline'; name: string; mediaType: string; content: Buffer; sizeBytes: number; sha256: string }
  | { kind: 'remote'; name: string; url: string }
  | { kind: 'blob'; name: string; url: string };

export interface ParsedFiles {
  files: ParsedFile[];
  issues: ValidationIssue[];
}

function nameFromUrl(url: string, index: number): string {
  try {
    const last = new URL(url).pathname.split('/').filter(Boolean).pop();
    // Control characters (a decoded %00, say) have no place in a file name.
    if (last) return decodeURIComponent(last).replace(/[\u0000-\u001f\u007f]/g, '').slice(0, 255) || `file-${index + 1}`;
  } catch {
    // fall through to the positional name
  }
  return `file-${index + 1}`;
}

function decodeDataUrl(url: string): { mediaType: string; content: Buffer } | { error: string } {
  const comma = url.indexOf(',');
  if (comma < 0) return { error: 'is not a valid data: URL (no comma before the data)' };
  const header = url.slice('data:'.length, comma);
  const payload = url.slice(comma + 1);
  const params = header.split(';');
  const isBase64 = params[params.length - 1]?.toLowerCase() === 'base64';
  const mediaType = (params[0] ?? '').trim().toLowerCase() || 'text/plain';
  if (!/^[a-z0-9!#$&^_.+-]+\/[a-z0-9!#$&^_.+-]+$/.test(mediaType)) {
    return { error: `has an invalid media type "${mediaType}"` };
  }
  if (isBase64) {
    const compact = payload.replace(/\s+/g, '');
    if (!/^[A-Za-z0-9+/_-]*={0,2}$/.test(compact) || compact.length % 4 === 1) {
      return { error: 'is not valid base64' };
    }
    return { mediaType, content: Buffer.from(compact, compact.includes('-') || compact.includes('_') ? 'base64url' : 'base64') };
  }
  try {
    return { mediaType, content: Buffer.from(decodeURIComponent(payload), 'utf8') };
  } catch {
    return { error: 'has invalid percent-encoding' };
  }
}

/** Decodes and checks a request's files; `fieldPrefix` names them in validation issues (`files`). */
export function parseFiles(inputs: readonly FileInput[] | undefined, fieldPrefix = 'files'): ParsedFiles {
  const files: ParsedFile[] = [];
  const issues: ValidationIssue[] = [];
  let total = 0;
  (inputs ?? []).forEach((input, index) => {
    const field = `${fieldPrefix}.${index}.url`;
    const url = input.url.trim();
    const scheme = /^([a-z][a-z0-9+.-]*):/i.exec(url)?.[1]?.toLowerCase();
    const name = input.name ?? (scheme === 'http' || scheme === 'https' ? nameFromUrl(url, index) : `file-${index + 1}`);
    switch (scheme) {
      case 'data': {
        const decoded = decodeDataUrl(url);
        if ('error' in decoded) {
          issues.push({ field, message: `file "${name}" ${decoded.error}` });
          return;
        }
        const sizeBytes = decoded.content.length;
        if (sizeBytes > FILE_LIMITS.maxFileBytes) {
          issues.push({ field, message: `file "${name}" is ${sizeBytes} bytes; the limit is ${FILE_LIMITS.maxFileBytes}` });
          return;
        }
        total += sizeBytes;
        const sha256 = createHash('sha256').update(decoded.content).digest('hex');
        files.push({ kind: 'inline', name, mediaType: decoded.mediaType, content: decoded.content, sizeBytes, sha256 });
        return;
      }
      case 'http':
      case 'https':
        try {
          new URL(url);
        } catch {
          issues.push({ field, message: `file "${name}" has an invalid URL` });
          return;
        }
        files.push({ kind: 'remote', name, url });
        return;
      case 'blob':
        files.push({ kind: 'blob', name, url });
        return;
      default:
        issues.push({ field, message: `file "${name}" must be a data:, http: or https: URL` });
    }
  });
  if (total > FILE_LIMITS.maxTotalBytes) {
    issues.push({ field: fieldPrefix, message: `files total ${total} bytes; the limit is ${FILE_LIMITS.maxTotalBytes}` });
  }
  return { files, issues };
}

/** The error a task fails with when it was given browser `blob:` URLs. */
export function blobFilesError(files: readonly ParsedFile[]): string | null {
  const blobs = files.filter((file) => file.kind === 'blob');
  if (blobs.length === 0) return null;
  const names = blobs.map((file) => `"${file.name}"`).join(', ');
  return `File ${names} is a browser blob: URL, not an uploaded file; attach its content as a data: URL`;
}
