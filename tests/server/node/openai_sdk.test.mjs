// `pagoda serve` driven by the official OpenAI Node SDK (npm package `openai`).
//
// Run by tests/server/openai_sdk_test.cpp, which installs the package and sets
// PAGODA_CLI (the pagoda binary) and PAGODA_MODEL (stories260K). This file
// starts the server itself on a free loopback port (--port 0) with one global
// key and two tenants, and stops it at the end.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';

const cli = process.env.PAGODA_CLI;
const modelPath = process.env.PAGODA_MODEL;
if (!cli || !modelPath) throw new Error('set PAGODA_CLI and PAGODA_MODEL');

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
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${serverLog}`)), 30000);
    let out = '';
    server.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[^\s]+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    server.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${serverLog}`)));
  });
}

const client = (apiKey = GLOBAL_KEY) => new OpenAI({ apiKey, baseURL: `${baseURL}/v1`, maxRetries: 0, timeout: 60000 });

before(async () => {
  baseURL = await startServer();
});

after(async () => {
  if (server && server.exitCode === null) {
    const exited = new Promise((r) => server.once('exit', r));
    server.kill('SIGTERM');
    await exited;
  }
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
