// A worker that dies mid-stream: the official OpenAI and Anthropic clients raise a typed API
// error, not a connection error. Run by replica's
// TestOfficialClientsRaiseATypedErrorWhenTheWorkerDiesMidStream, which starts the router and
// sets KVROUTER_URL, KVROUTER_MODEL and KVROUTER_MAX_TOKENS, reads "first NAME WORKER" when a
// stream has its first event and cuts that worker's connections then, and counts the "ok NAME"
// lines.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const base = process.env.KVROUTER_URL;
const model = process.env.KVROUTER_MODEL;
const max = Number(process.env.KVROUTER_MAX_TOKENS);
if (!base || !model || !max) throw new Error('KVROUTER_URL, KVROUTER_MODEL and KVROUTER_MAX_TOKENS must be set');
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: base, apiKey: 'unused', maxRetries: 0 });
const messages = [{ role: 'user', content: 'Tell me a long story about prefix caches.' }];

// Each case opens a stream and says how the error it raises must look.
const cases = [
  ['chat', () => openai.chat.completions.create({ model, stream: true, max_tokens: max, messages }),
    (err) => err instanceof OpenAI.APIError && !(err instanceof OpenAI.APIConnectionError) && err.code === 'upstream_broken'],
  ['completions', () => openai.completions.create({ model, stream: true, max_tokens: max, prompt: 'Once upon a time' }),
    (err) => err instanceof OpenAI.APIError && !(err instanceof OpenAI.APIConnectionError) && err.code === 'upstream_broken'],
  ['responses', () => openai.responses.create({ model, stream: true, max_output_tokens: max, input: 'Tell me a long story.' }),
    (err) => err instanceof OpenAI.APIError && !(err instanceof OpenAI.APIConnectionError) && err.code === 'upstream_broken'],
  ['messages', () => anthropic.messages.create({ model, stream: true, max_tokens: max, messages }),
    (err) => err instanceof Anthropic.APIError && !(err instanceof Anthropic.APIConnectionError) && err.type === 'api_error'],
];

for (const [name, open, typed] of cases) {
  let events = 0;
  try {
    const { data: stream, response } = await open().withResponse();
    for await (const _ of stream) {
      if (events++ === 0) console.log(`first ${name} ${response.headers.get('x-kvrouter-worker')}`);
    }
    console.log(`FAIL ${name}: the stream ended without an error after ${events} events`);
    process.exitCode = 1;
  } catch (err) {
    if (events > 0 && typed(err)) {
      console.log(`ok ${name}: ${err.constructor.name} after ${events} events: ${err.message}`);
    } else {
      console.log(`FAIL ${name}: after ${events} events, ${err?.constructor?.name}: ${err?.message} (cause ${err?.cause})`);
      process.exitCode = 1;
    }
  }
}
