import { z } from 'zod';

/** Every error code the service answers with. One code, one HTTP status, one default message. */
export const ErrorCode = z.enum([
  'validation_error',
  'unauthorized',
  'forbidden',
  'not_found',
  'method_not_allowed',
  'conflict',
  'payload_too_large',
  'unsupported_media_type',
  'rate_limited',
  'internal_error',
  'service_unavailable',
]);
export type ErrorCode = z.infer<typeof ErrorCode>;

export const ValidationIssue = z.object({
  field: z.string().describe('Dotted path of the offending field; `body`, `query` or `params` for the whole part'),
  message: z.string(),
});
export type ValidationIssue = z.infer<typeof ValidationIssue>;

export const ErrorEnvelope = z
  .object({
    error: z.object({
      code: ErrorCode,
      message: z.string(),
      details: z.any().optional(),
    }),
  })
  .meta({ id: 'ErrorEnvelope' });
export type ErrorEnvelope = z.infer<typeof ErrorEnvelope>;
