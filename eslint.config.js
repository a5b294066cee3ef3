// Lint: typescript-eslint's recommended rules plus the import direction of ../shared/ARCHITECTURE.md.
import tseslint from 'typescript-eslint';
import importX from 'eslint-plugin-import-x';
import { createTypeScriptImportResolver } from 'eslint-import-resolver-typescript';

const layers = ['protocol', 'domain', 'store', 'engine', 'sandbox', 'agents', 'codehost', 'integrations', 'server', 'runner', 'cli', 'web'];
const src = (name) => `./src/${name}`;
const others = (...allowed) => layers.filter((layer) => !allowed.includes(layer)).map(src);

/** Who may import whom: doors open downward only. */
const zones = [
  // protocol depends on zod alone.
  { target: src('protocol'), from: [...others('protocol'), './src/main.ts', './src/config.ts'] },
  // domain: pure rules; protocol types only.
  { target: src('domain'), from: [...others('protocol', 'domain'), './src/main.ts', './src/config.ts'] },
  // store, sandbox, agents, codehost: domain and protocol below them.
  ...['store', 'sandbox', 'codehost'].map((layer) => ({
    target: src(layer),
    from: [src('engine'), src('integrations'), src('server'), src('runner'), src('cli'), src('web'), src('agents'), './src/main.ts'],
  })),
  { target: src('agents'), from: [src('engine'), src('integrations'), src('server'), src('runner'), src('cli'), src('web'), src('store'), './src/main.ts'] },
  // engine and integrations orchestrate; the HTTP edge and the clients sit above them.
  { target: src('engine'), from: [src('server'), src('runner'), src('cli'), src('web'), './src/main.ts'] },
  { target: src('integrations'), from: [src('server'), src('runner'), src('cli'), src('web'), './src/main.ts'] },
  { target: src('server'), from: [src('runner'), src('cli'), src('web'), './src/main.ts'] },
  // Clients speak HTTP through protocol's client: never the server, the store or the engine.
  ...['cli', 'runner', 'web'].map((layer) => ({
    target: src(layer),
    from: [src('server'), src('store'), src('engine'), src('integrations')],
    message: 'clients speak HTTP through src/protocol; they never import the server, store or engine',
  })),
  { target: src('runner'), from: ['./src/main.ts', src('cli'), src('web')] },
  { target: src('web'), from: ['./src/main.ts', src('cli'), src('runner'), src('agents'), src('sandbox')] },
];

export default tseslint.config(
  { ignores: ['dist/**', 'node_modules/**', 'coverage/**', 'scratch/**', 'src/web/dist/**'] },
  ...tseslint.configs.recommended,
  {
    plugins: { 'import-x': importX },
    // Resolves `./x.js` specifiers to their `.ts` sources, which the zones below are written against.
    settings: { 'import-x/resolver-next': [createTypeScriptImportResolver({ project: './tsconfig.json' })] },
    rules: {
      'import-x/no-restricted-paths': ['error', { zones }],
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_' }],
      '@typescript-eslint/consistent-type-imports': ['error', { fixStyle: 'inline-type-imports' }],
      'no-console': 'error',
    },
  },
  {
    // Only `svc server` and `svc admin` reach the composition root; every other command uses HTTP.
    files: ['src/cli/**/*.ts'],
    ignores: ['src/cli/server.ts', 'src/cli/admin.ts'],
    rules: {
      'import-x/no-restricted-paths': [
        'error',
        { zones: [...zones, { target: src('cli'), from: ['./src/main.ts'], message: 'only svc server and svc admin may import main.ts' }] },
      ],
    },
  },
  {
    files: ['test/**/*.ts', 'bench/**/*.ts', 'scripts/**', '**/*.test.ts'],
    rules: { 'no-console': 'off', '@typescript-eslint/no-non-null-assertion': 'off' },
  },
);
