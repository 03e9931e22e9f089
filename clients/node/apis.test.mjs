// The official OpenAI and Anthropic clients against kvrouter-ha in front of simulated
// workers: Responses and Messages, streamed and not, count_tokens, embeddings, errors in each
// API's shape, a session kept on one worker, and a Responses conversation chained by
// previous_response_id kept on the worker that stored it. Run by replica's
// TestOfficialClientsSpeakResponsesAndMessages, which starts the router and sets KVROUTER_URL
// and KVROUTER_MODEL.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const base = process.env.KVROUTER_URL;
const model = process.env.KVROUTER_MODEL;
assert.ok(base && model, 'KVROUTER_URL and KVROUTER_MODEL must be set');
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: base, apiKey: 'unused', maxRetries: 0 });

test('responses.create', async () => {
  const r = await openai.responses.create({ model, input: 'Tell me about prefix caches.', max_output_tokens: 8 });
  assert.equal(r.object, 'response');
  assert.equal(r.status, 'completed');
  assert.ok(r.output_text.length > 0, 'output_text is empty');
  assert.equal(r.usage.output_tokens, 8);
});

test('responses.create, streamed', async () => {
  const stream = await openai.responses.create({
    model, instructions: 'Be brief.', max_output_tokens: 6, stream: true,
    input: [{ role: 'user', content: [{ type: 'input_text', text: 'hello there' }] }],
  });
  let text = '';
  let completed;
  for await (const ev of stream) {
    if (ev.type === 'response.output_text.delta') text += ev.delta;
    if (ev.type === 'response.completed') completed = ev.response;
  }
  assert.ok(completed, 'no response.completed event');
  assert.equal(completed.output[0].content[0].text, text);
  assert.equal(completed.usage.output_tokens, 6);
});

test('messages.create', async () => {
  const m = await anthropic.messages.create({
    model, max_tokens: 7, system: 'You are terse.', messages: [{ role: 'user', content: 'What is a KV cache?' }],
  });
  assert.equal(m.type, 'message');
  assert.equal(m.role, 'assistant');
  assert.ok(m.content[0].text.length > 0);
  assert.equal(m.usage.output_tokens, 7);
});

test('messages.create, streamed', async () => {
  const stream = await anthropic.messages.create({
    model, max_tokens: 5, stream: true,
    messages: [{ role: 'user', content: [{ type: 'text', text: 'Stream me a few words.' }] }],
  });
  let text = '';
  const types = [];
  for await (const ev of stream) {
    types.push(ev.type);
    if (ev.type === 'content_block_delta') text += ev.delta.text;
  }
  assert.equal(types[0], 'message_start');
  assert.equal(types.at(-1), 'message_stop');
  assert.equal(types.filter((t) => t === 'content_block_delta').length, 5);
  assert.ok(text.length > 0);
});

test('messages.countTokens', async () => {
  const c = await anthropic.messages.countTokens({ model, messages: [{ role: 'user', content: 'count these tokens' }] });
  assert.ok(c.input_tokens > 0);
});

test('embeddings.create, base64 (the client\'s default) and float', async () => {
  // The client asks for base64 unless told otherwise and decodes it; an answer in floats
  // would decode silently into a few zeros.
  const e = await openai.embeddings.create({ model, input: ['first text', 'second text', 'first text'] });
  assert.equal(e.data.length, 3);
  const norm = (v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0));
  for (const d of e.data) {
    assert.equal(d.embedding.length, 8, `embedding ${d.embedding}`);
    assert.ok(Math.abs(norm(d.embedding) - 1) < 1e-4, `embedding ${d.embedding} is not a unit vector`);
  }
  assert.deepEqual(e.data[0].embedding, e.data[2].embedding);
  assert.notDeepEqual(e.data[0].embedding, e.data[1].embedding);
  const f = await openai.embeddings.create({ model, input: 'first text', encoding_format: 'float' });
  // JSON's shortest float32 text read as a double rounds back to the same float32.
  assert.deepEqual(f.data[0].embedding.map(Math.fround), e.data[0].embedding);
  const b = await openai.embeddings.create({ model, input: 'first text', encoding_format: 'base64' });
  assert.equal(typeof b.data[0].embedding, 'string');
  await assert.rejects(openai.embeddings.create({ model, input: 'x', encoding_format: 'bytes' }), (err) => {
    assert.ok(err instanceof OpenAI.BadRequestError, `got ${err}`);
    assert.equal(err.param, 'encoding_format');
    return true;
  });
});

test('errors come in each API\'s shape', async () => {
  await assert.rejects(openai.responses.create({ model, input: [] }), (err) => {
    assert.ok(err instanceof OpenAI.BadRequestError, `got ${err}`);
    assert.equal(err.error.type, 'invalid_request_error');
    return true;
  });
  await assert.rejects(anthropic.messages.create({ model, max_tokens: 4, messages: [] }), (err) => {
    assert.ok(err instanceof Anthropic.BadRequestError, `got ${err}`);
    assert.equal(err.error.type, 'error');
    assert.equal(err.error.error.type, 'invalid_request_error');
    return true;
  });
  // A member of the wrong type is named in JSON's terms, not in Go's.
  await assert.rejects(anthropic.messages.create({ model, max_tokens: 4, messages: 'hi' }), (err) => {
    assert.ok(err instanceof Anthropic.BadRequestError, `got ${err}`);
    assert.equal(err.error.error.type, 'invalid_request_error');
    assert.match(err.error.error.message, /^messages must be an array, not a string/);
    return true;
  });
});

test('a session stays on its worker', async () => {
  const workers = new Set();
  for (const input of ['first turn', 'second turn, quite different', 'third']) {
    const { response } = await openai.responses
      .create({ model, input, max_output_tokens: 2 }, { headers: { 'X-Session-ID': 'node-session' } })
      .withResponse();
    workers.add(response.headers.get('x-kvrouter-worker'));
  }
  const { response } = await anthropic.messages
    .create({ model, max_tokens: 2, messages: [{ role: 'user', content: 'fourth' }] }, { headers: { 'X-Dynamo-Session-ID': 'node-session' } })
    .withResponse();
  workers.add(response.headers.get('x-kvrouter-worker'));
  assert.equal(workers.size, 1, `the session went to ${[...workers]}`);
});

test('a conversation chained by previous_response_id stays on the worker that stored it', async () => {
  const workers = new Set();
  let previous;
  for (let turn = 1; turn <= 5; turn++) {
    const stream = turn % 2 === 0;
    const { data, response } = await openai.responses
      .create({ model, input: `turn ${turn}`, max_output_tokens: 2, stream, ...(previous && { previous_response_id: previous }) })
      .withResponse();
    workers.add(response.headers.get('x-kvrouter-worker'));
    if (!stream) {
      previous = data.id;
      continue;
    }
    for await (const ev of data) {
      if (ev.type === 'response.completed') previous = ev.response.id;
    }
  }
  assert.equal(workers.size, 1, `the conversation went to ${[...workers]}`);
  await assert.rejects(openai.responses.create({ model, input: 'more', previous_response_id: 'resp-nobody-1' }),
    (err) => err instanceof OpenAI.NotFoundError && err.message.includes("Response with id 'resp-nobody-1' not found"));
});

test('models.list and models.retrieve', async () => {
  const ids = [];
  for await (const m of openai.models.list()) {
    assert.equal(m.object, 'model');
    ids.push(m.id);
  }
  assert.ok(ids.includes(model), `models.list() lacks ${model}: ${ids}`);
  const m = await openai.models.retrieve(model);
  assert.equal(m.id, model);
  assert.equal(m.object, 'model');
  await assert.rejects(openai.models.retrieve('no-such-model'),
    (err) => err instanceof OpenAI.NotFoundError && err.code === 'model_not_found');
});

test('a model no worker serves: model_not_found', async () => {
  await assert.rejects(openai.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'hi' }] }),
    (err) => err instanceof OpenAI.NotFoundError && err.code === 'model_not_found' && err.param === 'model');
  await assert.rejects(anthropic.messages.create({ model: 'no-such-model', max_tokens: 4, messages: [{ role: 'user', content: 'hi' }] }),
    (err) => err instanceof Anthropic.NotFoundError && err.error?.error?.type === 'not_found_error');
});
