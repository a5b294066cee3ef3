/**
 * A fake OpenAI-compatible model server over real HTTP: answers POST /v1/chat/completions from a script,
 * taking one entry from its front per model call, and records every request so that tests can see what the model was told.
 * GET /v1/models lists `options.models` (how a desktop runner discovers an endpoint's models).
 */
import { createServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

export type ScriptedAnswer =
  | { toolCalls: Array<{ name: string; arguments: unknown }>; usage?: { input: number; output: number } }
  | { text: string; usage?: { input: number; output: number } }
  | { status: number; body?: string }
  | { raw: string };

export interface ChatRequest {
  model: string;
  messages: Array<{ role: string; content: unknown; tool_calls?: unknown[]; tool_call_id?: string }>;
  tools?: Array<{ function: { name: string } }>;
}

export interface FakeModel {
  baseUrl: string;
  requests: ChatRequest[];
  close(): Promise<void>;
}

async function body(request: IncomingMessage): Promise<string> {
  let text = '';
  for await (const chunk of request) text += chunk;
  return text;
}

export interface FakeModelOptions {
  /** The model ids GET /v1/models lists. */
  models?: string[];
}

export async function startFakeModel(script: ScriptedAnswer[], options: FakeModelOptions = {}): Promise<FakeModel> {
  const requests: ChatRequest[] = [];
  let call = 0;
  const models = options.models ?? ['fake-coder'];
  const server: Server = createServer(async (request, response) => {
    if (request.method === 'GET' && request.url?.endsWith('/models')) {
      response
        .writeHead(200, { 'content-type': 'application/json' })
        .end(JSON.stringify({ object: 'list', data: models.map((id) => ({ id, object: 'model', created: 0, owned_by: 'fake' })) }));
      return;
    }
    if (request.method !== 'POST' || !request.url?.endsWith('/chat/completions')) {
      response.writeHead(404).end();
      return;
    }
    requests.push(JSON.parse(await body(request)) as ChatRequest);
    // Answers are consumed in order, so a test may append to the script while the server runs.
    const answer = script.shift();
    call += 1;
    if (!answer) {
      response.writeHead(500, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { message: 'script exhausted' } }));
      return;
    }
    if ('status' in answer) {
      response.writeHead(answer.status, { 'content-type': 'application/json' }).end(answer.body ?? JSON.stringify({ error: { message: 'scripted failure' } }));
      return;
    }
    if ('raw' in answer) {
      response.writeHead(200, { 'content-type': 'application/json' }).end(answer.raw);
      return;
    }
    const usage = { prompt_tokens: answer.usage?.input ?? 100, completion_tokens: answer.usage?.output ?? 20 };
    const message =
      'toolCalls' in answer
        ? {
            role: 'assistant',
            content: null,
            tool_calls: answer.toolCalls.map((toolCall, index) => ({
              id: `call_${call}_${index}`,
              type: 'function',
              function: { name: toolCall.name, arguments: typeof toolCall.arguments === 'string' ? toolCall.arguments : JSON.stringify(toolCall.arguments) },
            })),
          }
        : { role: 'assistant', content: answer.text };
    response.writeHead(200, { 'content-type': 'application/json' }).end(
      JSON.stringify({
        id: `chatcmpl-${call}`,
        object: 'chat.completion',
        created: Math.floor(Date.now() / 1000),
        model: requests.at(-1)?.model ?? 'fake',
        choices: [{ index: 0, message, finish_reason: 'toolCalls' in answer ? 'tool_calls' : 'stop' }],
        usage: { ...usage, total_tokens: usage.prompt_tokens + usage.completion_tokens },
      }),
    );
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  return {
    baseUrl: `http://127.0.0.1:${port}/v1`,
    requests,
    // Clients' keep-alive connections would hold the close until their idle timeout.
    close: () =>
      new Promise((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}
