/** What a runner registers it can run: agent CLIs found on PATH, providers from its environment, and their models. */
import { chmodSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { discoverCapabilities, findExecutable } from '../src/runner/discovery.js';
import { RunnerHome } from '../src/runner/home.js';
import { startFakeModel, type FakeModel } from './support/fake-model.js';

let model: FakeModel | null = null;
afterEach(async () => {
  await model?.close();
  model = null;
});

function binDir(...programs: string[]): string {
  const dir = mkdtempSync(join(tmpdir(), 'svc-bin-'));
  for (const program of programs) {
    writeFileSync(join(dir, program), '#!/bin/sh\nexit 0\n');
    chmodSync(join(dir, program), 0o755);
  }
  writeFileSync(join(dir, 'not-executable'), 'x');
  return dir;
}

const home = () => new RunnerHome(mkdtempSync(join(tmpdir(), 'svc-discovery-'))).ensure();

describe('discovering capabilities', () => {
  it('finds agent CLIs on PATH (or where their variables point) and gives them the built-in model lists', async () => {
    const bin = binDir('claude', 'my-codex');
    expect(findExecutable('claude', bin)).toBe(join(bin, 'claude'));
    expect(findExecutable('not-executable', bin)).toBeNull();
    const found = await discoverCapabilities(home(), { PATH: bin, SVC_CODEX_COMMAND: join(bin, 'my-codex') });
    expect(found.harnesses).toEqual(['claude-code', 'codex']);
    expect(found.capabilities.modelSource).toBe('fallback');
    expect(found.capabilities.models!['claude-code']!.map((entry) => entry.id)).toContain('claude-sonnet-4-5');
    expect(found.capabilities.nativeControls).toEqual({
      'claude-code': { commands: [], fullAccess: true, questions: false },
      codex: { commands: [], fullAccess: true, questions: false },
    });
    const none = await discoverCapabilities(home(), { PATH: bin, SVC_CLAUDE_CODE_COMMAND: '/nonexistent/claude' });
    expect(none.harnesses).toEqual([]);
    expect(none.capabilities.models).toEqual({});
  });

  it("asks an OpenAI-compatible endpoint for its models, and lets the user's models.json win", async () => {
    model = await startFakeModel([], { models: ['coder-large', 'coder-small'] });
    const discovered = await discoverCapabilities(home(), { PATH: '', OPENAI_COMPATIBLE_BASE_URL: model.baseUrl, OPENAI_API_KEY: 'sk-test' });
    expect(discovered.harnesses).toEqual(['openai', 'openai-compatible']);
    expect(discovered.capabilities.models!['openai-compatible']).toEqual([
      { id: 'coder-large', name: 'coder-large' },
      { id: 'coder-small', name: 'coder-small' },
    ]);
    expect(discovered.capabilities.modelSource).toBe('discovered');
    expect(discovered.capabilities.nativeControls!.openai).toEqual({ commands: ['permission'], fullAccess: true, questions: true });

    const configured = home();
    writeFileSync(configured.modelsFile, JSON.stringify({ 'openai-compatible': ['mine', { id: 'other', name: 'Other model' }] }));
    const chosen = await discoverCapabilities(configured, { PATH: '', OPENAI_COMPATIBLE_BASE_URL: model.baseUrl });
    expect(chosen.capabilities.models).toEqual({ 'openai-compatible': [{ id: 'mine', name: 'mine' }, { id: 'other', name: 'Other model' }] });
    expect(chosen.capabilities.modelSource).toBe('configured');

    // An endpoint that does not answer registers no list: the model is then not checked.
    const silent = await discoverCapabilities(home(), { PATH: '', OPENAI_COMPATIBLE_BASE_URL: 'http://127.0.0.1:9/v1' });
    expect(silent.capabilities.models).toEqual({});
  });
});
