import { readFileSync } from 'node:fs';
import SwaggerParser from '@apidevtools/swagger-parser';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildDocument, documentText, DOCUMENT_PATH, typesText, TYPES_PATH } from '../../scripts/openapi.js';
import { startTestApi, type TestApi } from '../support/api.js';

/** Every operation of the REST API; a route added without its place here fails the test. */
const OPERATIONS = [
  'POST /api/v1/tasks',
  'GET /api/v1/tasks',
  'GET /api/v1/tasks/{taskIdOrSlug}',
  'GET /api/v1/tasks/{taskIdOrSlug}/jobs',
  'POST /api/v1/tasks/{taskIdOrSlug}/messages',
  'POST /api/v1/tasks/{taskIdOrSlug}/approve-plan',
  'POST /api/v1/tasks/{taskIdOrSlug}/cancel',
  'POST /api/v1/tasks/{taskIdOrSlug}/archive',
  'GET /api/v1/tasks/{taskIdOrSlug}/logs',
  'GET /api/v1/routing-configs',
  'PUT /api/v1/routing-configs/{name}',
  'DELETE /api/v1/routing-configs/{name}',
];

type Schema = { $ref?: string; allOf?: Schema[] };
type Operation = { security?: unknown; responses: Record<string, { content?: Record<string, { schema: Schema }>; headers?: Record<string, unknown> }> };

/** The component a response schema points at, directly or through a described `allOf` wrapper. */
const refOf = (schema: Schema | undefined): string | undefined => schema?.$ref ?? schema?.allOf?.[0]?.$ref;

describe('the OpenAPI document', () => {
  let api: TestApi;
  let document: { openapi: string; info: { version: string }; paths: Record<string, Record<string, Operation>>; components: Record<string, Record<string, unknown>> };

  beforeAll(async () => {
    api = await startTestApi('pglite');
    const response = await api.app.inject({ method: 'GET', url: '/api/v1/openapi.json' });
    expect(response.statusCode).toBe(200);
    document = response.json();
  });
  afterAll(async () => {
    await api?.close();
  });

  it('is OpenAPI 3.0.3, version 1.0.0, and valid', async () => {
    expect(document.openapi).toBe('3.0.3');
    expect(document.info.version).toBe('1.0.0');
    await expect(SwaggerParser.validate(structuredClone(document) as never)).resolves.toBeTruthy();
  });

  it('documents exactly the routes the server has, each behind bearer auth with its errors', async () => {
    const listed = Object.entries(document.paths).flatMap(([path, operations]) =>
      Object.keys(operations).map((method) => `${method.toUpperCase()} ${path}`),
    );
    expect(listed.sort()).toEqual([...OPERATIONS].sort());
    expect(document.components.securitySchemes).toEqual({ bearerAuth: expect.objectContaining({ type: 'http', scheme: 'bearer' }) });
    for (const [path, operations] of Object.entries(document.paths)) {
      for (const [method, operation] of Object.entries(operations)) {
        const name = `${method} ${path}`;
        expect(operation.security, name).toEqual([{ bearerAuth: [] }]);
        for (const status of ['401', '429', '500']) {
          const schema = operation.responses[status]?.content?.['application/json']?.schema;
          expect(refOf(schema), `${name} ${status}`).toBe('#/components/schemas/ErrorEnvelope');
        }
        expect(operation.responses['429']?.headers, name).toHaveProperty('Retry-After');
        const success = Object.keys(operation.responses).filter((status) => status.startsWith('2'));
        expect(success, name).toHaveLength(1);
      }
    }
    // Each route that the server really serves answers something other than 404 at its documented path.
    const tenant = await api.newTenant();
    for (const operation of OPERATIONS) {
      const [method, path] = operation.split(' ') as [string, string];
      const url = path.replace('{taskIdOrSlug}', 'no-such-task-aaaaaa').replace('{name}', 'x');
      const response = await tenant.request(method as 'GET', url, method === 'GET' || method === 'DELETE' ? undefined : {});
      expect(response.json().error?.message ?? '', operation).not.toMatch(/^Route /);
    }
  });

  it('is served without a key, and the server does not serve undocumented /api/v1 routes', async () => {
    const response = await api.app.inject({ method: 'GET', url: '/api/v1/openapi.json', headers: { authorization: 'Bearer nonsense' } });
    expect(response.statusCode).toBe(200);
  });

  it('matches the committed docs/openapi.json and src/protocol/openapi.d.ts (run `npm run openapi`)', async () => {
    const fresh = await buildDocument();
    expect(documentText(fresh), 'docs/openapi.json is stale: run `npm run openapi`').toBe(readFileSync(DOCUMENT_PATH, 'utf8'));
    expect(await typesText(fresh), 'src/protocol/openapi.d.ts is stale: run `npm run openapi`').toBe(readFileSync(TYPES_PATH, 'utf8'));
  });
});
