import { describe, expect, it } from 'vitest';
import { effortError, jobTypeOfMode, modeOfIntent, parseAgentId } from './agents.js';
import { displayPrefix, generateApiKey, hashApiKey, isWellFormedApiKey, parseDuration } from './api-keys.js';
import { decodeCursor, encodeCursor } from './cursor.js';
import { ValidationError } from './errors.js';
import { blobFilesError, parseFiles } from './files.js';
import { routingNameError, splitTrigger } from './routing.js';
import { isUuid, makeSlug, titleFromMessage } from './slugs.js';
import { FILE_LIMITS, TaskMode, UserIntent } from '../protocol/rest.js';

describe('splitTrigger', () => {
  it.each([
    ['/plan fix it', 'plan', 'fix it'],
    ['  /Plan\n\nfix it', 'plan', 'fix it'],
    ['/ask', 'ask', ''],
    ['/my_flow-2 go', 'my_flow-2', 'go'],
    ['/usr/bin/env is broken', null, '/usr/bin/env is broken'],
    ['fix /plan later', null, 'fix /plan later'],
    ['/ leading slash', null, '/ leading slash'],
    ['/plan: colon', null, '/plan: colon'],
  ])('%j → trigger %j, rest %j', (message, trigger, rest) => {
    expect(splitTrigger(message)).toEqual({ trigger, rest });
  });

  it('names valid trigger keywords', () => {
    expect(routingNameError('default')).toBeNull();
    expect(routingNameError('fix-it_2')).toBeNull();
    expect(routingNameError('Fix')).toMatch(/lowercase/);
    expect(routingNameError('_x')).not.toBeNull();
    expect(routingNameError('a'.repeat(41))).not.toBeNull();
  });
});

describe('agent ids', () => {
  it('parses complete ids and refuses the rest', () => {
    expect(parseAgentId('openai/gpt-5')).toEqual({ provider: 'openai', model: 'gpt-5' });
    expect(parseAgentId('openai-compatible/meta/llama:3.1')).toEqual({ provider: 'openai-compatible', model: 'meta/llama:3.1' });
    expect(parseAgentId('openai')).toEqual({ error: expect.stringContaining('provider alone') });
    expect(parseAgentId('acme/model')).toEqual({ error: expect.stringContaining('unknown provider') });
    expect(parseAgentId('anthropic/')).toEqual({ error: expect.stringContaining('model') });
    expect(parseAgentId('anthropic/ spaced')).toHaveProperty('error');
  });

  it('offers ultracode only on claude-code', () => {
    expect(effortError('ultracode', { provider: 'claude-code', model: 'opus' })).toBeNull();
    expect(effortError('ultracode', { provider: 'openai', model: 'gpt-5' })).toMatch(/claude-code/);
    expect(effortError('xhigh', { provider: 'openai', model: 'gpt-5' })).toBeNull();
  });

  it('maps every intent and mode', () => {
    expect(UserIntent.options.map(modeOfIntent)).toEqual(['plan', 'agent', 'ask', 'dev_env', 'goal']);
    expect(TaskMode.options.map(jobTypeOfMode)).toEqual(['SWE', 'PLAN', 'ASK', 'GOAL', 'DEV_ENVIRONMENT']);
  });
});

describe('files', () => {
  it('decodes base64, base64url and percent-encoded data URLs', () => {
    const { files, issues } = parseFiles([
      { name: 'a.txt', url: 'data:text/plain;base64,aGk/Pz8=' },
      { url: 'data:application/octet-stream;base64,aGk_Pz8' },
      { url: 'data:,hello%20world' },
    ]);
    expect(issues).toEqual([]);
    expect(files.map((file) => (file.kind === 'inline' ? [file.name, file.mediaType, file.content.toString()] : null))).toEqual([
      ['a.txt', 'text/plain', 'hi???'],
      ['file-2', 'application/octet-stream', 'hi???'],
      ['file-3', 'text/plain', 'hello world'],
    ]);
  });

  it('names each bad file in its issue', () => {
    const { issues } = parseFiles([
      { name: 'nocomma', url: 'data:text/plain;base64' },
      { name: 'media', url: 'data:not a type;base64,aGk=' },
      { name: 'b64', url: 'data:text/plain;base64,***' },
      { name: 'pct', url: 'data:text/plain,%E0%A4%A' },
      { name: 'ftp', url: 'ftp://host/file' },
      { name: 'rel', url: 'relative/path' },
      { name: 'badhttp', url: 'http://' },
    ]);
    expect(issues.map((issue) => issue.field)).toEqual([0, 1, 2, 3, 4, 5, 6].map((i) => `files.${i}.url`));
    expect(issues[0]?.message).toContain('"nocomma"');
  });

  it('enforces the per-file and total limits', () => {
    const justOver = Buffer.alloc(FILE_LIMITS.maxFileBytes + 1).toString('base64');
    expect(parseFiles([{ url: `data:application/octet-stream;base64,${justOver}` }]).issues[0]?.message).toMatch(/limit/);
    const nine = Buffer.alloc(9 * 1024 * 1024).toString('base64');
    const total = parseFiles([1, 2, 3].map(() => ({ url: `data:application/octet-stream;base64,${nine}` })));
    expect(total.issues).toEqual([{ field: 'files', message: expect.stringMatching(/total/) }]);
  });

  it('keeps http(s) references and reports every blob: file', () => {
    const { files } = parseFiles([
      { url: 'https://example.com/a/screen%20shot.png?x=1' },
      { url: 'blob:http://localhost/1' },
      { name: 'two.png', url: 'blob:http://localhost/2' },
    ]);
    expect(files.map((file) => [file.kind, file.name])).toEqual([['remote', 'screen shot.png'], ['blob', 'file-2'], ['blob', 'two.png']]);
    expect(blobFilesError(files)).toBe('File "file-2", "two.png" is a browser blob: URL, not an uploaded file; attach its content as a data: URL');
    expect(blobFilesError(files.slice(0, 1))).toBeNull();
  });
});

describe('slugs and titles', () => {
  it('makes readable ASCII slugs that are never UUIDs', () => {
    const slug = makeSlug('Fix the Café login — now!');
    expect(slug).toMatch(/^fix-the-cafe-login-now-[a-z0-9]{6}$/);
    expect(makeSlug('!!!')).toMatch(/^task-[a-z0-9]{6}$/);
    const long = makeSlug('word '.repeat(40));
    expect(long.length).toBeLessThanOrEqual(48 + 7);
    expect(long).not.toMatch(/--/);
    expect(isUuid(makeSlug('0f0e0d0c 0b0a 4000 8000 0a0b0c0d0e0f'))).toBe(false);
    expect(isUuid('0f0e0d0c-0b0a-4000-8000-0a0b0c0d0e0f')).toBe(true);
    expect(new Set(Array.from({ length: 50 }, () => makeSlug('same'))).size).toBe(50);
  });

  it('titles a task by the first line of its message', () => {
    expect(titleFromMessage('  First line\nsecond')).toBe('First line');
    expect(titleFromMessage(' \n ')).toBe('Untitled task');
    const title = titleFromMessage('x'.repeat(200));
    expect(title).toHaveLength(80);
    expect(title.endsWith('…')).toBe(true);
  });
});

describe('cursors', () => {
  it('round-trips and refuses other listings and garbage', () => {
    expect(decodeCursor('tasks', encodeCursor('tasks', 42))).toBe(42);
    expect(decodeCursor('jobs', undefined)).toBeNull();
    for (const cursor of [encodeCursor('jobs', 42), 'garbage', Buffer.from('{"k":"tasks","s":1.5}').toString('base64url'), '']) {
      expect(() => decodeCursor('tasks', cursor)).toThrow(ValidationError);
    }
  });
});

describe('API keys', () => {
  it('are service_ plus 43 URL-safe characters, hashed and shown by prefix', () => {
    const keys = Array.from({ length: 20 }, generateApiKey);
    for (const key of keys) {
      expect(key).toMatch(/^service_[A-Za-z0-9_-]{43}$/);
      expect(isWellFormedApiKey(key)).toBe(true);
    }
    expect(new Set(keys).size).toBe(20);
    expect(hashApiKey(keys[0]!)).toMatch(/^[0-9a-f]{64}$/);
    expect(hashApiKey(keys[0]!)).not.toBe(hashApiKey(keys[1]!));
    expect(displayPrefix(keys[0]!)).toBe(keys[0]!.slice(0, 14));
    expect(isWellFormedApiKey('service_short')).toBe(false);
    expect(isWellFormedApiKey(`sk_${'a'.repeat(43)}`)).toBe(false);
    expect(isWellFormedApiKey(`service_${'a'.repeat(42)}!`)).toBe(false);
  });

  it('parses expiry durations', () => {
    expect(parseDuration('30s')).toBe(30_000);
    expect(parseDuration('15m')).toBe(900_000);
    expect(parseDuration('1h')).toBe(3_600_000);
    expect(parseDuration('7d')).toBe(604_800_000);
    expect(parseDuration('2w')).toBe(1_209_600_000);
    expect(parseDuration('1y')).toBe(31_536_000_000);
    for (const bad of ['0d', '7x', 'd', '', '-1h', '1.5h']) expect(parseDuration(bad)).toBeNull();
  });
});
