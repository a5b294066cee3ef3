/**
 * What a runner tells the server of a repository's remote: never a password (an ssh:// URL may carry one
 * as well as an https:// one), never a token as an https user, never a path of this computer.
 */
import { randomUUID } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { publicRemoteUrl, registrationOf } from '../src/runner/projects.js';

describe('the remote URL a runner registers', () => {
  it('drops the password of ssh:// and git:// URLs and keeps their user, host, port and path as written', () => {
    expect(publicRemoteUrl('ssh://git:hunter2@github.com/acme/widgets.git')).toBe('ssh://git@github.com/acme/widgets.git');
    expect(publicRemoteUrl('ssh://deploy:p%40ss:word@git.example.com:2222/~team/Widgets.git')).toBe('ssh://deploy@git.example.com:2222/~team/Widgets.git');
    expect(publicRemoteUrl('ssh://:secret@git.example.com/acme/widgets')).toBe('ssh://git.example.com/acme/widgets');
    expect(publicRemoteUrl('git://anon:secret@git.example.com/widgets')).toBe('git://anon@git.example.com/widgets');
    expect(publicRemoteUrl('ssh://git@github.com/acme/widgets.git')).toBe('ssh://git@github.com/acme/widgets.git');
    expect(publicRemoteUrl('ssh://github.com/acme/widgets.git')).toBe('ssh://github.com/acme/widgets.git');
    expect(publicRemoteUrl('git@github.com:acme/widgets.git')).toBe('git@github.com:acme/widgets.git');
  });

  it('drops the user and password of https:// URLs, and refuses paths', () => {
    expect(publicRemoteUrl('https://alice:ghp_secret@github.com/acme/widgets.git')).toBe('https://github.com/acme/widgets.git');
    expect(publicRemoteUrl('https://ghp_token@github.com/acme/widgets')).toBe('https://github.com/acme/widgets');
    expect(publicRemoteUrl('/home/alice/widgets')).toBeNull();
    expect(publicRemoteUrl('file:///home/alice/widgets')).toBeNull();
  });

  it('strips a password that a project list of an older runner still holds before registering it', () => {
    const project = {
      id: randomUUID(),
      name: 'acme',
      path: '/home/alice/acme',
      repositories: [
        { name: 'acme/widgets', remoteUrl: 'ssh://git:hunter2@github.com/acme/widgets.git', defaultBranch: 'main', path: '/home/alice/acme/widgets', dir: 'widgets' },
        { name: 'acme/gadgets', remoteUrl: 'https://bob:ghp_secret@github.com/acme/gadgets.git', path: '/home/alice/acme/gadgets', dir: 'gadgets' },
      ],
    };
    const sent = registrationOf(project);
    expect(sent.repositories).toEqual([
      { name: 'acme/widgets', remoteUrl: 'ssh://git@github.com/acme/widgets.git', defaultBranch: 'main' },
      { name: 'acme/gadgets', remoteUrl: 'https://github.com/acme/gadgets.git' },
    ]);
    expect(JSON.stringify(sent)).not.toMatch(/hunter2|ghp_secret|bob|\/home\/alice/);
  });
});
