// The import direction of ../shared/ARCHITECTURE.md: doors open downward only. `npm test` runs it
// (`npm run lint`); test/lint.test.ts proves each rule fires.
const layer = (...names) => `^src/(${names.join('|')})/`;
const root = '^src/(main|config)\\.ts$';

const forbid = (name, from, to, comment) => ({ name, severity: 'error', comment, from, to });

module.exports = {
  forbidden: [
    forbid('protocol-is-zod-only', { path: '^src/protocol/' }, { path: [`^src/(?!protocol/)`, root] }, 'protocol depends on zod only'),
    forbid(
      'platform-is-generic',
      { path: '^src/platform/' },
      { path: [`^src/(?!(platform|protocol)/)`, root] },
      'platform holds generic, svc-agnostic I/O helpers (lock files, process identity) that every layer may import; it imports nothing of ours but protocol types',
    ),
    forbid(
      'domain-is-pure',
      { path: '^src/domain/' },
      { path: [layer('store', 'engine', 'sandbox', 'agents', 'codehost', 'integrations', 'server', 'runner', 'cli', 'web', 'platform'), root] },
      'domain holds pure rules and imports nothing of ours but protocol types',
    ),
    forbid(
      'store-sandbox-codehost-below-engine',
      { path: layer('store', 'sandbox', 'codehost') },
      { path: [layer('engine', 'integrations', 'server', 'runner', 'cli', 'web', 'agents'), root] },
      'store, sandbox and codehost see only domain and protocol',
    ),
    forbid(
      'agents-below-engine',
      { path: layer('agents') },
      { path: [layer('engine', 'integrations', 'server', 'runner', 'cli', 'web', 'store'), root] },
      'agents may use sandbox, domain and protocol',
    ),
    forbid('engine-below-server', { path: layer('engine', 'integrations') }, { path: [layer('server', 'runner', 'cli', 'web'), root] }, 'engine and integrations sit below the HTTP edge'),
    forbid('server-below-main', { path: layer('server') }, { path: [layer('runner', 'cli', 'web'), root] }, 'the server is wired by main.ts'),
    forbid(
      'clients-speak-http',
      { path: layer('cli', 'runner', 'web') },
      { path: layer('server', 'store', 'engine', 'integrations') },
      'clients speak HTTP through src/protocol; they never import the server, store or engine',
    ),
    forbid(
      'only-server-and-admin-commands-reach-main',
      { path: '^src/cli/', pathNot: '^src/cli/(admin|server|worker)\\.ts$' },
      { path: '^src/main\\.ts$' },
      'only svc server, svc worker and svc admin may import the composition root',
    ),
    forbid('runner-stands-alone', { path: layer('runner') }, { path: [layer('cli', 'web'), '^src/main\\.ts$'] }, 'the runner reuses agents and sandbox only'),
    forbid('web-stands-alone', { path: layer('web') }, { path: [layer('cli', 'runner', 'agents', 'sandbox'), '^src/main\\.ts$'] }, 'the web app speaks HTTP only'),
  ],
  options: {
    doNotFollow: { path: 'node_modules' },
    exclude: { path: '\\.test\\.ts$' },
    tsConfig: { fileName: 'tsconfig.json' },
    tsPreCompilationDeps: true,
  },
};
