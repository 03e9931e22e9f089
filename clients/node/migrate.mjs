// A worker that dies mid-stream with request migration on: the official OpenAI client reads
// one whole stream, as if nothing had happened. Run by replica's
// TestOfficialClientsReadAMovedStreamWhole, which starts the router with --migration-limit 1
// and sets KVROUTER_URL, KVROUTER_MODEL and KVROUTER_MAX_TOKENS, reads "first NAME WORKER"
// when a stream has its first event and cuts that worker's connections then, and counts the
// "ok NAME" lines.
import OpenAI from 'openai';

const base = process.env.KVROUTER_URL;
const model = process.env.KVROUTER_MODEL;
const max = Number(process.env.KVROUTER_MAX_TOKENS);
if (!base || !model || !max) throw new Error('KVROUTER_URL, KVROUTER_MODEL and KVROUTER_MAX_TOKENS must be set');
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0 });
const messages = [{ role: 'user', content: 'Tell me a long story about request migration.' }];

// Each case asks once whole (the simulated workers' answer is a function of the prompt) and
// once streamed, and says how to read the text of an answer and of a chunk.
const cases = [
  ['chat', (stream) => openai.chat.completions.create({ model, stream, max_tokens: max, messages }),
    (a) => a.choices[0].message.content, (c) => c.choices[0]?.delta?.content ?? ''],
  ['completions', (stream) => openai.completions.create({ model, stream, max_tokens: max, prompt: 'Once upon a migration' }),
    (a) => a.choices[0].text, (c) => c.choices[0]?.text ?? ''],
];

for (const [name, open, whole, piece] of cases) {
  let events = 0;
  try {
    const want = whole(await open(false));
    const { data: stream, response } = await open(true).withResponse();
    const ids = new Set();
    let text = '';
    for await (const chunk of stream) {
      if (events++ === 0) console.log(`first ${name} ${response.headers.get('x-kvrouter-worker')}`);
      ids.add(`${chunk.id}@${chunk.created}`);
      text += piece(chunk);
    }
    if (text === want && ids.size === 1) {
      console.log(`ok ${name}: ${events} events, one id, the whole answer (${text.length} characters)`);
    } else {
      console.log(`FAIL ${name}: ids ${[...ids]}; read ${JSON.stringify(text)}, want ${JSON.stringify(want)}`);
      process.exitCode = 1;
    }
  } catch (err) {
    console.log(`FAIL ${name}: after ${events} events, ${err?.constructor?.name}: ${err?.message}`);
    process.exitCode = 1;
  }
}
