import { describe, expect, it } from 'vitest';
import { projectRepositories } from './runners.js';

describe('projectRepositories', () => {
  it('reads the stored list as registered, and nothing for the projectless environment', () => {
    const web = { name: 'acme/web', remoteUrl: 'git@github.com:acme/web.git', defaultBranch: 'main' };
    expect(projectRepositories({ repositories: [web, { name: 'acme/api' }] })).toEqual([web, { name: 'acme/api' }]);
    expect(projectRepositories({ repositories: [] })).toEqual([]);
    expect(projectRepositories({ repositories: null })).toEqual([]);
  });

  it('keeps the name of an entry a later rule refuses, and drops only what has no valid name', () => {
    // A remote stored before native paths were refused still names a repository the project has.
    const stored = [{ name: 'acme/web', remoteUrl: '/home/me/web' }, { name: '/home/me/api' }, 'acme/docs', null];
    expect(projectRepositories({ repositories: stored })).toEqual([{ name: 'acme/web' }]);
  });
});
