/**
 * PostgreSQL text cannot hold U+0000, so a NUL anywhere in a request would surface as a 500. This
 * preValidation hook refuses it first: in the body or query as a 400 naming the field, in a task id as
 * the 404 any unknown task gets.
 */
import type { FastifyRequest } from 'fastify';
import { NotFoundError, ValidationError } from '../domain/errors.js';

function findNul(value: unknown, path: string): string | null {
  if (typeof value === 'string') return value.includes('\u0000') ? path : null;
  if (Array.isArray(value)) {
    for (const [index, item] of value.entries()) {
      const found = findNul(item, path ? `${path}.${index}` : String(index));
      if (found !== null) return found;
    }
    return null;
  }
  if (value !== null && typeof value === 'object') {
    for (const [key, item] of Object.entries(value)) {
      const found = findNul(key, path ? `${path}.${key}` : key) ?? findNul(item, path ? `${path}.${key}` : key);
      if (found !== null) return found;
    }
  }
  return null;
}

export async function refuseNulBytes(request: FastifyRequest): Promise<void> {
  const param = findNul(request.params, '');
  if (param !== null) {
    if (param === 'taskIdOrSlug') throw new NotFoundError('Task not found');
    throw new ValidationError([{ field: param, message: 'must not contain NUL characters' }], 'Invalid path parameters');
  }
  const query = findNul(request.query, '');
  if (query !== null) throw new ValidationError([{ field: query, message: 'must not contain NUL characters' }], 'Invalid query parameters');
  const body = findNul(request.body, '');
  if (body !== null) throw new ValidationError([{ field: body || 'body', message: 'must not contain NUL characters' }]);
}
