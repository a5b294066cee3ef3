/**
 * A task's kept fork on an older environment version is replaced with a fresh one only when that loses
 * nothing: not a stash, not a branch the code host lacks, not work set aside from a closed pull request
 * (svc-closed/*), not an ignored file outside dependency and build directories, not refs git cannot read,
 * not the work of a repository whose HEAD is unborn, any more than uncommitted changes or unpushed commits
 * on HEAD (delivery.test.ts).
 */
import { describe, expect, it } from 'vitest';
import { testDrivers } from './support/db.js';
import { journal, useTestEngine, type TestEngine } from './support/engine.js';
import { sampleRepository } from './support/repos.js';

const GIT = 'git -c user.name=a -c user.email=a@a';
const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');

describe.each(testDrivers)('renewing a task fork on %s', (driver) => {
  let engine: TestEngine;
  useTestEngine(driver, (ready) => (engine = ready));

  const events = async (taskId: string) => journal((await engine.tenant.request('GET', `/api/v1/tasks/${taskId}/logs`)).body);

  it('keeps the fork when it holds a stash, a branch the code host lacks, a set-aside branch, an ignored file or unreadable refs, and renews one that holds nothing', async () => {
    // Each task leaves its work somewhere a check of the working tree and HEAD alone does not see.
    const cases = [
      { dir: 'stashed', command: `cd stashed && echo wip > wip.txt && git add wip.txt && ${GIT} stash -q`, kept: 'stash', shows: 'stash@{0}' },
      { dir: 'branched', command: `cd branched && git checkout -qb side && echo s > s.txt && git add s.txt && ${GIT} commit -qm s && git checkout -q main`, kept: 'branch side', shows: 'side' },
      { dir: 'aside', command: 'cd aside && git branch svc-closed/7', kept: 'set-aside branch svc-closed/7', shows: 'svc-closed/7' },
      // An unborn HEAD (an orphan branch, its files staged) hides neither its files nor the other branches.
      {
        dir: 'unborn',
        command: `cd unborn && git checkout -qb side && echo s > s.txt && git add s.txt && ${GIT} commit -qm s && git checkout -q --orphan fresh`,
        kept: 'uncommitted changes, branch side',
        shows: 'side',
      },
      // Refs git cannot list (a broken packed-refs) are not taken for no refs.
      { dir: 'unreadable', command: 'cd unreadable && git pack-refs --all && echo garbage >> .git/packed-refs', kept: 'refs that could not be read', shows: '' },
      // An ignored file the agent wrote is lost with the fork; what an install or build makes again is not.
      {
        dir: 'ignored',
        command: 'cd ignored && printf ".env.local\\nnode_modules/\\ndist/\\n" >> .git/info/exclude && echo SECRET=1 > .env.local && mkdir -p node_modules/a dist && touch node_modules/a/i.js dist/x.js',
        kept: 'ignored file .env.local',
        shows: '',
      },
      {
        dir: 'rebuilt',
        command: 'cd rebuilt && printf "node_modules/\\nbuild/\\n__pycache__/\\n" >> .git/info/exclude && mkdir -p node_modules/a build sub/__pycache__ && touch node_modules/a/i.js build/x.js sub/__pycache__/m.pyc',
        kept: null,
        shows: '',
      },
      { dir: 'clean', command: 'cd clean && git status --short', kept: null, shows: '' },
    ];
    const tasks: Array<{ id: string; dir: string; kept: string | null; shows: string }> = [];
    for (const { dir, command, kept, shows } of cases) {
      await engine.connect(sampleRepository(dir, { expected: 'hi' }), `acme/${dir}`);
      engine.script.push({ toolCalls: [{ name: 'run_command', arguments: { command } }] }, { toolCalls: [{ name: 'ask_user', arguments: { question: 'Go on?' } }] });
      const task = await engine.create({ command: `Work in ${dir}` });
      const settled = await engine.settled(task.id);
      expect(settled.task.status, JSON.stringify(settled.latestJob)).toBe('AWAITING_INPUT');
      tasks.push({ id: task.id, dir, kept, shows });
    }

    // Another task's change is merged: the environment moves on to a new version.
    await engine.connect(sampleRepository('moved', { expected: 'hello' }), 'acme/moved');
    engine.script.push({ toolCalls: [{ name: 'write_file', arguments: { path: 'moved/greeting.txt', content: 'hello\n' } }] }, { toolCalls: [{ name: 'finish', arguments: { summary: 'Moved.' } }] });
    const mover = await engine.create({ command: 'Move the environment on' });
    expect((await engine.settled(mover.id)).task.status).toBe('IN_REVIEW');
    expect((await engine.tenant.request('POST', '/api/v1/repos/acme/moved/pulls/1/merge')).statusCode).toBe(200);

    for (const { id, dir, kept, shows } of tasks) {
      engine.script.push(
        { toolCalls: [{ name: 'run_command', arguments: { command: `cat moved/greeting.txt; git -C ${dir} stash list; git -C ${dir} branch --list` } }] },
        { toolCalls: [{ name: 'ask_user', arguments: { question: 'Anything else?' } }] },
      );
      await engine.tenant.request('POST', `/api/v1/tasks/${id}/messages`, { message: 'Go on' });
      expect((await engine.settled(id)).task.status).toBe('AWAITING_INPUT');
      const journaled = await events(id);
      const notes = journaled.filter((event) => event.kind === 'message').map((event) => String(event.data.text));
      const output = String(journaled.filter((event) => event.kind === 'tool_result' && event.data.name === 'run_command').at(-1)!.data.output);
      if (kept) {
        // The task goes on in its own fork, on the environment it had, and the journal says what it kept.
        const said = `but the fork holds work that is in no pull request yet (acme/${dir}), so the task goes on in it as it is: acme/${dir} has ${kept}.`;
        expect(notes, dir).toContainEqual(expect.stringMatching(new RegExp(`^The environment changed since this task's fork was made \\(version \\d+, now \\d+\\), ${escape(said)}$`)));
        // acme/moved was connected after its fork was made.
        expect(output, dir).toContain('moved/greeting.txt: No such file');
        expect(output, dir).toContain(shows);
      } else {
        // Nothing to lose: a fresh fork of the new version.
        expect(notes.filter((text) => text.startsWith("The environment changed")), dir).toEqual([]);
        expect(output, dir).toMatch(/^exit code 0\nhello\n/);
      }
    }
  }, 180_000);
});
