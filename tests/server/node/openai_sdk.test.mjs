// `pagoda serve` driven by the official OpenAI Node SDK (npm package `openai`).
//
// Run by tests/server/openai_sdk_test.cpp, which installs the package and sets
// PAGODA_CLI (the pagoda binary), PAGODA_MODEL (stories260K) and
// PAGODA_VISION_DIR (tests/data/oracle/vision: a tiny model and its mmproj,
// for the image flow). This file
// starts the server itself on a free loopback port (--port 0) with one global
// key and two tenants, and stops it at the end; the tool-calling flows start
// one server per chat template family (--chat-template) the same way.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { crc32, deflateSync } from 'node:zlib';
import OpenAI from 'openai';

const cli = process.env.PAGODA_CLI;
const modelPath = process.env.PAGODA_MODEL;
const visionDir = process.env.PAGODA_VISION_DIR;
if (!cli || !modelPath || !visionDir) throw new Error('set PAGODA_CLI, PAGODA_MODEL and PAGODA_VISION_DIR');

const GLOBAL_KEY = 'sk-pagoda-global';
const ALICE_KEY = 'sk-pagoda-alice';
const BOB_KEY = 'sk-pagoda-bob';
const STORY =
  'Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. ' +
  'One day, she saw a big tree in the garden and wanted to climb it.';

let server;
let baseURL;
let serverLog = '';
let dir;

// A server on a free loopback port; resolves to its base URL.
function launch(proc, log) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${log()}`)), 30000);
    let out = '';
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[^\s]+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    proc.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${log()}`)));
  });
}

async function stop(proc) {
  if (proc && proc.exitCode === null) {
    const exited = new Promise((r) => proc.once('exit', r));
    proc.kill('SIGTERM');
    await exited;
  }
}

function startServer() {
  dir = mkdtempSync(join(tmpdir(), 'pagoda-sdk-'));
  const tenants = join(dir, 'tenants.json');
  writeFileSync(tenants, JSON.stringify({
    tenants: [
      { name: 'alice', api_keys: [ALICE_KEY], quota_blocks: 256 },
      { name: 'bob', api_keys: [BOB_KEY] },
    ],
  }));
  const args = ['serve', '-m', modelPath, '--host', '127.0.0.1', '--port', '0', '--ctx', '512', '--threads', '1',
    '--kv-cache-dtype', 'f32', '--max-kv-tokens', '32768', '--api-key', GLOBAL_KEY, '--tenants', tenants,
    '--kv-store', join(dir, 'kv')];  // hermetic: not the per-user default store
  server = spawn(cli, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  server.stderr.on('data', (d) => { serverLog += d; });
  return launch(server, () => serverLog);
}

const client = (apiKey = GLOBAL_KEY) => new OpenAI({ apiKey, baseURL: `${baseURL}/v1`, maxRetries: 0, timeout: 60000 });

before(async () => {
  baseURL = await startServer();
});

after(async () => {
  await stop(server);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe('completions', () => {
  test('non-streaming: text, finish reason and usage', async () => {
    const r = await client().completions.create({
      model: 'stories260K', prompt: 'Once upon a time', max_tokens: 12, temperature: 0, ignore_eos: true,
    });
    assert.equal(r.object, 'text_completion');
    assert.match(r.id, /^cmpl-/);
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.ok(r.choices[0].text.length > 0);
    assert.equal(r.usage.completion_tokens, 12);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);
    assert.equal(r.usage.prompt_tokens_details.cached_tokens, 0);
  });

  test('streaming equals non-streaming, with usage at the end', async () => {
    const params = { model: 'stories260K', prompt: STORY, max_tokens: 16, temperature: 0, ignore_eos: true };
    const whole = await client().completions.create(params);
    const stream = await client().completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let usage = null;
    let finish = null;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        text += c.text;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(text, whole.choices[0].text);
    assert.equal(finish, 'length');
    assert.equal(usage.completion_tokens, 16);
    assert.equal(usage.prompt_tokens, whole.usage.prompt_tokens);
  });

  test('stop strings end the text before the stop', async () => {
    const params = { model: 'stories260K', prompt: 'Once upon a time', max_tokens: 40, temperature: 0, ignore_eos: true };
    const free = (await client().completions.create(params)).choices[0].text;
    // A word from the middle of the free-running text becomes the stop string.
    const words = free.split(' ').filter((w) => w.length > 2);
    const stop = ' ' + words[Math.floor(words.length / 2)];
    const cut = free.indexOf(stop);
    assert.ok(cut > 0, `stop ${JSON.stringify(stop)} in ${JSON.stringify(free)}`);
    const r = await client().completions.create({ ...params, stop: [stop, '@@never@@'] });
    assert.equal(r.choices[0].text, free.slice(0, cut));
    assert.equal(r.choices[0].finish_reason, 'stop');
  });

  test('a seed reproduces sampled output; another seed differs', async () => {
    const params = { model: 'stories260K', prompt: 'Once upon a time', max_tokens: 30, temperature: 1.0, ignore_eos: true };
    const a = await client().completions.create({ ...params, seed: 1234 });
    const b = await client().completions.create({ ...params, seed: 1234 });
    const c = await client().completions.create({ ...params, seed: 98765 });
    assert.equal(a.choices[0].text, b.choices[0].text);
    assert.notEqual(a.choices[0].text, c.choices[0].text);
  });

  test('a repeated prompt reports cached tokens', async () => {
    // A prompt no earlier test used (finished requests' blocks stay cached, generated tokens included).
    const prompt = `Cache test ${process.pid} ${Date.now()}. ` + STORY;
    const first = await client().completions.create({ model: 'stories260K', prompt, max_tokens: 2, temperature: 0 });
    const second = await client().completions.create({ model: 'stories260K', prompt, max_tokens: 2, temperature: 0 });
    assert.equal(first.usage.prompt_tokens_details.cached_tokens, 0);
    assert.ok(second.usage.prompt_tokens_details.cached_tokens >= 16, JSON.stringify(second.usage));
    assert.equal(second.usage.prompt_tokens_details.cached_tokens % 16, 0);
  });
});

describe('chat', () => {
  test('non-streaming message', async () => {
    const r = await client().chat.completions.create({
      model: 'stories260K', messages: [{ role: 'user', content: 'Once upon a time' }], max_tokens: 10, temperature: 0,
    });
    assert.equal(r.object, 'chat.completion');
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(typeof r.choices[0].message.content, 'string');
    assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
    // stories260K has no chat template: the message is the prompt as is.
    const c = await client().completions.create({ model: 'stories260K', prompt: 'Once upon a time', max_tokens: 10, temperature: 0 });
    assert.equal(r.choices[0].message.content, c.choices[0].text);
    assert.equal(r.usage.prompt_tokens, c.usage.prompt_tokens);
  });

  test('streaming deltas add up to the message', async () => {
    const params = { model: 'stories260K', messages: [{ role: 'user', content: STORY }], max_tokens: 12, temperature: 0 };
    const whole = await client().chat.completions.create(params);
    const stream = await client().chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
    let content = '';
    let role = null;
    let finish = null;
    let usage = null;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (c.delta.role) role = c.delta.role;
        if (c.delta.content) content += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(role, 'assistant');
    assert.equal(content, whole.choices[0].message.content);
    assert.equal(finish, whole.choices[0].finish_reason);
    assert.deepEqual(usage.completion_tokens, whole.usage.completion_tokens);
  });

  test('n > 1 gives n choices; each is reproducible from the seed', async () => {
    const params = {
      model: 'stories260K', messages: [{ role: 'user', content: 'Once upon a time' }], max_tokens: 20,
      temperature: 1.0, seed: 42, n: 3,
    };
    const a = await client().chat.completions.create(params);
    const b = await client().chat.completions.create(params);
    assert.deepEqual(a.choices.map((c) => c.index), [0, 1, 2]);
    assert.deepEqual(a.choices.map((c) => c.message.content), b.choices.map((c) => c.message.content));
    assert.ok(new Set(a.choices.map((c) => c.message.content)).size > 1, 'samples with different seeds differ');
    // Streaming n > 1: every choice gets its own deltas and finish reason.
    const stream = await client().chat.completions.create({ ...params, stream: true });
    const texts = ['', '', ''];
    const finishes = [null, null, null];
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta.content) texts[c.index] += c.delta.content;
        if (c.finish_reason) finishes[c.index] = c.finish_reason;
      }
    }
    assert.deepEqual(texts, a.choices.map((c) => c.message.content));
    assert.ok(finishes.every((f) => f !== null));
  });

  test('stop strings in chat', async () => {
    const params = { model: 'stories260K', messages: [{ role: 'user', content: 'Once upon a time' }], max_tokens: 40, temperature: 0, ignore_eos: true };
    const free = (await client().chat.completions.create(params)).choices[0].message.content;
    const words = free.split(' ').filter((w) => w.length > 2);
    const stop = ' ' + words[Math.floor(words.length / 2)];
    const cut = free.indexOf(stop);
    assert.ok(cut > 0, `stop ${JSON.stringify(stop)} in ${JSON.stringify(free)}`);
    const r = await client().chat.completions.create({ ...params, stop });
    assert.equal(r.choices[0].message.content, free.slice(0, cut));
    assert.equal(r.choices[0].finish_reason, 'stop');
  });
});

describe('keys and tenants', () => {
  test('401 without a key or with a wrong one', async () => {
    for (const key of ['', 'sk-wrong']) {
      await assert.rejects(
        client(key || 'none').completions.create({ model: 'stories260K', prompt: 'x', max_tokens: 1 }),
        (e) => e instanceof OpenAI.AuthenticationError && e.status === 401,
      );
    }
    await assert.rejects(client('sk-wrong').models.list(), (e) => e.status === 401);
  });

  test('tenants do not share cached prefixes', async () => {
    const prompt = 'Tenant test. ' + STORY;
    const ask = async (key) => (await client(key).completions.create({ model: 'stories260K', prompt, max_tokens: 1, temperature: 0 }))
      .usage.prompt_tokens_details.cached_tokens;
    assert.equal(await ask(ALICE_KEY), 0);
    assert.ok(await ask(ALICE_KEY) > 0, "alice's repeat hits her cache");
    assert.equal(await ask(BOB_KEY), 0, 'bob does not see alice\'s blocks');
    assert.equal(await ask(GLOBAL_KEY), 0, 'the global cache does not either');
    assert.ok(await ask(BOB_KEY) > 0, "bob's repeat hits his own cache");
  });
});

describe('errors and models', () => {
  test('bad values are 400 errors naming the field', async () => {
    await assert.rejects(
      client().completions.create({ model: 'stories260K', prompt: 'x', max_tokens: -5 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'max_tokens',
    );
    await assert.rejects(
      client().chat.completions.create({ model: 'stories260K', messages: [{ role: 'user', content: 'x' }], temperature: 9 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'temperature',
    );
    await assert.rejects(
      client().completions.create({ model: 'no-such-model', prompt: 'x' }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'model' && e.code === 'model_not_found',
    );
  });

  test('models.list names the served model', async () => {
    const models = [];
    for await (const m of client().models.list()) models.push(m);
    assert.deepEqual(models.map((m) => m.id), ['stories260K']);
    const one = await client().models.retrieve('stories260K');
    assert.equal(one.object, 'model');
  });
});

// A validator for the JSON Schema subset the flows below use (type, properties,
// required, additionalProperties: false, enum, items, maxLength), written
// here so that the check does not share code with the server's grammar.
function validate(schema, value, at = '$') {
  const fail = (why) => { throw new Error(`${at}: ${why} (${JSON.stringify(value)})`); };
  if (schema.enum && !schema.enum.some((e) => JSON.stringify(e) === JSON.stringify(value))) fail('not in enum');
  switch (schema.type) {
    case 'object': {
      if (typeof value !== 'object' || value === null || Array.isArray(value)) fail('not an object');
      for (const k of schema.required ?? []) if (!(k in value)) fail(`missing ${k}`);
      for (const [k, v] of Object.entries(value)) {
        if (!(k in (schema.properties ?? {}))) {
          if (schema.additionalProperties === false) fail(`unexpected ${k}`);
          continue;
        }
        validate(schema.properties[k], v, `${at}.${k}`);
      }
      break;
    }
    case 'array':
      if (!Array.isArray(value)) fail('not an array');
      value.forEach((v, i) => validate(schema.items, v, `${at}[${i}]`));
      break;
    case 'integer': if (!Number.isInteger(value)) fail('not an integer'); break;
    case 'boolean': if (typeof value !== 'boolean') fail('not a boolean'); break;
    case 'string':
      if (typeof value !== 'string') fail('not a string');
      if (schema.maxLength !== undefined && [...value].length > schema.maxLength) fail('too long');
      break;
    default: break;
  }
  return true;
}

const PET = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 10 },
    kind: { type: 'string', enum: ['cat', 'dog'] },
    age: { type: 'integer' },
    tags: { type: 'array', items: { type: 'boolean' }, maxItems: 2 },
  },
  required: ['name', 'kind', 'age', 'tags'],
  additionalProperties: false,
};

describe('response_format json_schema', () => {
  const params = {
    model: 'stories260K', messages: [{ role: 'user', content: 'Describe a pet.' }], max_tokens: 120, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name: 'pet', schema: PET, strict: true } },
  };

  test('non-streaming: the message parses and validates', async () => {
    const r = await client().chat.completions.create(params);
    assert.equal(r.choices[0].finish_reason, 'stop', r.choices[0].message.content);
    validate(PET, JSON.parse(r.choices[0].message.content));
    // Sampled as well.
    for (const seed of [1, 2, 3]) {
      const s = await client().chat.completions.create({ ...params, temperature: 1, seed });
      assert.equal(s.choices[0].finish_reason, 'stop', s.choices[0].message.content);
      validate(PET, JSON.parse(s.choices[0].message.content));
    }
  });

  test('streaming: the deltas add up to the same valid JSON', async () => {
    const whole = await client().chat.completions.create(params);
    const stream = await client().chat.completions.create({ ...params, stream: true });
    let content = '';
    let finish = null;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta.content) content += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(finish, 'stop');
    assert.equal(content, whole.choices[0].message.content);
    validate(PET, JSON.parse(content));
  });
});

const WEATHER = {
  type: 'object',
  properties: { city: { type: 'string', enum: ['Paris', 'Tokyo', 'Lima'] }, days: { type: 'integer' } },
  required: ['city', 'days'],
  additionalProperties: false,
};
const TIME = {
  type: 'object', properties: { zone: { type: 'string', maxLength: 8 } }, required: ['zone'], additionalProperties: false,
};
const TOOLS = [
  { type: 'function', function: { name: 'get_weather', description: 'The weather in a city', parameters: WEATHER } },
  { type: 'function', function: { name: 'get_time', description: 'The time in a zone', parameters: TIME } },
];
const SCHEMAS = { get_weather: WEATHER, get_time: TIME };

function checkCall(call) {
  assert.equal(call.type, 'function');
  assert.equal(typeof call.id, 'string');
  assert.ok(call.id.length > 0);
  assert.ok(call.function.name in SCHEMAS, call.function.name);
  validate(SCHEMAS[call.function.name], JSON.parse(call.function.arguments));
}

// Each family with a tool format, on stories260K with --chat-template: a model
// this small calls no tool of its own accord, so the flows force calls
// (required, named) and check their shape, then send a result back.
for (const family of ['chatml', 'llama3', 'mistral']) {
  describe(`tools (${family} template)`, () => {
    let proc;
    let url;
    let log = '';
    const tc = () => new OpenAI({ apiKey: 'none', baseURL: `${url}/v1`, maxRetries: 0, timeout: 60000 });
    const base = {
      model: 'stories260K', messages: [{ role: 'user', content: 'What is the weather in Paris?' }], tools: TOOLS,
      max_tokens: 150, temperature: 0,
    };

    before(async () => {
      proc = spawn(cli, ['serve', '-m', modelPath, '--host', '127.0.0.1', '--port', '0', '--ctx', '2048', '--threads',
        '1', '--chat-template', family, '--no-kv-store'], { stdio: ['ignore', 'pipe', 'pipe'] });
      proc.stderr.on('data', (d) => { log += d; });
      url = await launch(proc, () => log);
    });
    after(async () => { await stop(proc); });

    test('named function and required: tool_calls whose arguments match the schema', async () => {
      const named = await tc().chat.completions.create({
        ...base, tool_choice: { type: 'function', function: { name: 'get_weather' } },
      });
      const m = named.choices[0].message;
      assert.equal(named.choices[0].finish_reason, 'stop', JSON.stringify(m));  // OpenAI's reason for a named function
      assert.equal(m.content, null);
      assert.equal(m.tool_calls.length, 1);
      assert.equal(m.tool_calls[0].function.name, 'get_weather');
      checkCall(m.tool_calls[0]);
      const required = await tc().chat.completions.create({ ...base, tool_choice: 'required', parallel_tool_calls: false });
      assert.equal(required.choices[0].finish_reason, 'tool_calls', JSON.stringify(required.choices[0].message));
      assert.equal(required.choices[0].message.tool_calls.length, 1);
      checkCall(required.choices[0].message.tool_calls[0]);
      // Sampled, several seeds: always a valid call.
      for (const seed of [7, 8]) {
        const s = await tc().chat.completions.create({
          ...base, tool_choice: 'required', parallel_tool_calls: false, temperature: 1, seed,
        });
        assert.equal(s.choices[0].finish_reason, 'tool_calls', JSON.stringify(s.choices[0].message));
        s.choices[0].message.tool_calls.forEach(checkCall);
      }
    });

    test('streaming: id and name first, then argument pieces, as the SDK accumulates them', async () => {
      const params = { ...base, tool_choice: 'required', parallel_tool_calls: false };
      const whole = await tc().chat.completions.create(params);
      const stream = await tc().chat.completions.create({ ...params, stream: true });
      const calls = [];
      let finish = null;
      for await (const chunk of stream) {
        for (const c of chunk.choices) {
          if (c.finish_reason) finish = c.finish_reason;
          for (const d of c.delta.tool_calls ?? []) {
            if (d.id) {
              assert.equal(d.index, calls.length);
              assert.equal(d.type, 'function');
              assert.ok(d.function.name);
              calls.push({ id: d.id, type: 'function', function: { name: d.function.name, arguments: d.function.arguments ?? '' } });
            } else {
              assert.ok(calls[d.index], 'arguments come after the call was named');
              calls[d.index].function.arguments += d.function.arguments;
            }
          }
        }
      }
      assert.equal(finish, 'tool_calls');
      assert.equal(calls.length, 1);
      checkCall(calls[0]);
      assert.deepEqual(calls.map((c) => c.function), whole.choices[0].message.tool_calls.map((c) => c.function));
      // The SDK's own stream helper assembles the same message.
      const helper = tc().chat.completions.stream({ ...params, tool_choice: { type: 'function', function: { name: 'get_time' } } });
      const final = await helper.finalChatCompletion();
      const call = final.choices[0].message.tool_calls[0];
      assert.equal(call.function.name, 'get_time');
      checkCall(call);
    });

    test('a tool result round trip gets an answer', async () => {
      const first = await tc().chat.completions.create({
        ...base, tool_choice: { type: 'function', function: { name: 'get_weather' } },
      });
      const assistant = first.choices[0].message;
      const messages = [
        ...base.messages,
        { role: 'assistant', content: assistant.content, tool_calls: assistant.tool_calls },
        { role: 'tool', tool_call_id: assistant.tool_calls[0].id, content: '{"sky": "sunny", "high": 21}' },
      ];
      const answer = await tc().chat.completions.create({ ...base, messages, max_tokens: 12, tool_choice: 'none' });
      assert.equal(typeof answer.choices[0].message.content, 'string');
      assert.ok(['stop', 'length'].includes(answer.choices[0].finish_reason));
      // With the tools still offered (auto), the answer is text or calls, well formed either way.
      const auto = await tc().chat.completions.create({ ...base, messages, max_tokens: 12 });
      assert.ok(auto.usage.prompt_tokens > first.usage.prompt_tokens, 'the call and its result are in the prompt');
      const m = auto.choices[0].message;
      if (m.tool_calls) m.tool_calls.forEach((c) => assert.ok(c.function.name in SCHEMAS));
      else assert.equal(typeof m.content, 'string');
    });

    test("the SDK's runTools calls the function with the parsed arguments", async () => {
      const seen = [];
      for (const stream of [false, true]) {
        const runner = tc().chat.completions.runTools({
          ...base,
          stream,
          tool_choice: { type: 'function', function: { name: 'get_weather' } },
          tools: [{
            type: 'function',
            function: {
              name: 'get_weather', parameters: WEATHER, parse: JSON.parse,
              function: (args) => { seen.push(args); return { sky: 'sunny' }; },
            },
          }],
        });
        await runner.done();
        const last = runner.messages.at(-1);
        assert.equal(last.role, 'tool');
        assert.equal(last.content, '{"sky":"sunny"}');
        assert.equal(last.tool_call_id, runner.messages.at(-2).tool_calls[0].id);
      }
      assert.equal(seen.length, 2);
      seen.forEach((args) => validate(WEATHER, args));
      assert.deepEqual(seen[0], seen[1], 'greedy: streamed and whole calls agree');
    });

    test('bad tools are 400s naming the field', async () => {
      await assert.rejects(
        tc().chat.completions.create({ ...base, tool_choice: { type: 'function', function: { name: 'get_stock' } } }),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'tool_choice.function.name',
      );
      await assert.rejects(
        tc().chat.completions.create({ ...base, tools: [{ type: 'function', function: { description: 'no name' } }] }),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools[0].function.name',
      );
    });
  });
}

describe('tools without a tool format', () => {
  test('the plain template refuses tools, takes tool_choice none', async () => {
    const params = { model: 'stories260K', messages: [{ role: 'user', content: 'Hi' }], tools: TOOLS, max_tokens: 4 };
    await assert.rejects(client().chat.completions.create(params),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools');
    const r = await client().chat.completions.create({ ...params, tool_choice: 'none' });
    assert.equal(typeof r.choices[0].message.content, 'string');
  });
});

// An RGB PNG of w x h pixels whose values depend on seed (zlib's deflate and CRC-32).
function png(w, h, seed) {
  const chunk = (type, data) => {
    const body = Buffer.concat([Buffer.from(type, 'latin1'), data]);
    const out = Buffer.alloc(body.length + 8);
    out.writeUInt32BE(data.length, 0);
    body.copy(out, 4);
    out.writeUInt32BE(crc32(body), body.length + 4);
    return out;
  };
  const ihdr = Buffer.alloc(13);
  ihdr.writeUInt32BE(w, 0);
  ihdr.writeUInt32BE(h, 4);
  ihdr[8] = 8;  // bits per sample
  ihdr[9] = 2;  // RGB
  const rows = Buffer.alloc(h * (1 + 3 * w));
  for (let y = 0; y < h; ++y)
    for (let i = 0; i < 3 * w; ++i) rows[y * (1 + 3 * w) + 1 + i] = (i * 7 + y * 13 + seed * 131) & 0xff;
  return Buffer.concat([Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]), chunk('IHDR', ihdr),
    chunk('IDAT', deflateSync(rows)), chunk('IEND', Buffer.alloc(0))]);
}

// Images in chat (docs/serving.md, "Images"): a tiny model and its idefics3
// mmproj, the image sent as the SDK's image_url content part.
describe('images', () => {
  let proc;
  let url;
  let log = '';
  const vc = () => new OpenAI({ apiKey: 'none', baseURL: `${url}/v1`, maxRetries: 0, timeout: 60000 });

  before(async () => {
    proc = spawn(cli, ['serve', '-m', join(visionDir, 'text-tiny-F32.gguf'), '--mmproj',
      join(visionDir, 'mmproj-idefics3-F32.gguf'), '--host', '127.0.0.1', '--port', '0', '--ctx', '512', '--threads', '1',
      '--no-kv-store'], { stdio: ['ignore', 'pipe', 'pipe'] });
    proc.stderr.on('data', (d) => { log += d; });
    url = await launch(proc, () => log);
  });
  after(async () => { await stop(proc); });

  test('an image_url part is answered; the same image again is cached, another is not', async () => {
    const ask = (image) => vc().chat.completions.create({
      model: 'text-tiny-F32', max_tokens: 8, temperature: 0,
      messages: [{
        role: 'user',
        content: [
          { type: 'image_url', image_url: { url: `data:image/png;base64,${image.toString('base64')}` } },
          { type: 'text', text: 'What is in this image?' },
        ],
      }],
    });
    const a = png(64, 64, 1);
    const first = await ask(a);
    assert.equal(typeof first.choices[0].message.content, 'string');
    assert.ok(first.usage.completion_tokens > 0);
    const n = first.usage.prompt_tokens_details.image_tokens;
    assert.ok(n > 0, JSON.stringify(first.usage));
    assert.equal(first.usage.prompt_tokens_details.cached_image_tokens, 0);
    const second = await ask(a);
    assert.equal(second.usage.prompt_tokens_details.image_tokens, n);
    assert.ok(second.usage.prompt_tokens_details.cached_image_tokens > 0, JSON.stringify(second.usage));
    assert.equal(second.choices[0].message.content, first.choices[0].message.content);
    const other = await ask(png(64, 64, 2));
    assert.equal(other.usage.prompt_tokens_details.cached_image_tokens, 0);
    await assert.rejects(vc().chat.completions.create({
      model: 'text-tiny-F32', max_tokens: 4,
      messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'https://example.com/a.png' } }] }],
    }), (e) => e instanceof OpenAI.BadRequestError && /network/.test(e.message));
  });
});
