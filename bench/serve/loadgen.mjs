#!/usr/bin/env node
// A small load generator for `pagoda serve` (or any OpenAI-compatible server).
// No dependencies: Node's fetch and streams.
//
// Mode "load": C concurrent clients each send R streamed /v1/completions
// requests back to back (unique prompts, greedy, ignore_eos so every request
// generates exactly --max-tokens). Reports generated tokens/s over the wall
// time, requests/s, time to first token (first streamed text) and inter-token
// latency (gaps between streamed chunks, one token each) at p50 and p99.
//
// Mode "prefix": time to first token (max_tokens 1) of a long prompt seen for
// the first time (a prefix-cache miss) and right after, again (a hit), over
// several distinct prompts; reports both medians and their ratio.
//
// Usage:
//   node bench/serve/loadgen.mjs --url http://127.0.0.1:8080 --mode load \
//        --concurrency 8 --requests 4 --max-tokens 64 --prompt-chars 400
//   node bench/serve/loadgen.mjs --url ... --mode prefix --prompt-chars 6000 --trials 5
// Prints one JSON object on stdout.
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

function parseArgs(argv) {
  const opts = {
    url: 'http://127.0.0.1:8080', mode: 'load', concurrency: 1, requests: 4, maxTokens: 64, promptChars: 400,
    trials: 5, model: undefined, apiKey: process.env.OPENAI_API_KEY, warmup: 1,
  };
  const names = {
    '--url': 'url', '--mode': 'mode', '--concurrency': 'concurrency', '--requests': 'requests',
    '--max-tokens': 'maxTokens', '--prompt-chars': 'promptChars', '--trials': 'trials', '--model': 'model',
    '--api-key': 'apiKey', '--warmup': 'warmup',
  };
  for (let i = 2; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) throw new Error(`unknown or incomplete option ${argv[i]}`);
    const v = argv[i + 1];
    opts[key] = typeof opts[key] === 'number' ? Number(v) : v;
  }
  return opts;
}

const opts = parseArgs(process.argv);
const here = dirname(fileURLToPath(import.meta.url));
const corpus = readFileSync(join(here, '../../tests/data/tinystories_dev.txt'), 'utf8')
  .split('<|endoftext|>').map((s) => s.replace(/\s+/g, ' ').trim()).filter((s) => s.length > 0).join(' ');

// A prompt of about `chars` characters that no other request shares: a random
// tag first, so even its first KV block is new (no prefix-cache hit), then
// text from the corpus.
let promptCounter = 0;
function uniquePrompt(chars) {
  const tag = `[${randomBytes(8).toString('hex')}] `;
  ++promptCounter;
  const start = (promptCounter * 7919) % Math.max(1, corpus.length - chars);
  return tag + corpus.slice(start, start + chars);
}

const headers = { 'Content-Type': 'application/json' };
if (opts.apiKey) headers.Authorization = `Bearer ${opts.apiKey}`;

// One streamed completion; returns its timings.
async function streamCompletion(prompt, maxTokens) {
  const body = {
    prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true,
    stream_options: { include_usage: true },
  };
  if (opts.model) body.model = opts.model;
  const t0 = performance.now();
  const res = await fetch(`${opts.url}/v1/completions`, { method: 'POST', headers, body: JSON.stringify(body) });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let buffer = '';
  let first = null;
  let last = null;
  const gaps = [];
  let usage = null;
  let done = false;
  for await (const bytes of res.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith('data: ')) continue;
      const data = event.slice(6);
      if (data === '[DONE]') {
        done = true;
        continue;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      if (chunk.choices.length > 0 && chunk.choices[0].text.length > 0) {
        const now = performance.now();
        if (first === null) first = now;
        else gaps.push(now - last);
        last = now;
      }
    }
  }
  if (!done || !usage) throw new Error('stream ended without [DONE] or usage');
  const end = performance.now();
  return {
    ttftMs: (first ?? end) - t0, e2eMs: end - t0, gapsMs: gaps,
    promptTokens: usage.prompt_tokens, completionTokens: usage.completion_tokens,
    cachedTokens: usage.prompt_tokens_details?.cached_tokens ?? 0,
  };
}

function quantile(values, q) {
  if (values.length === 0) return 0;
  const s = [...values].sort((a, b) => a - b);
  const pos = (s.length - 1) * q;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return s[lo] + (s[hi] - s[lo]) * (pos - lo);
}

const round = (x, d = 2) => Number(x.toFixed(d));

async function runLoad() {
  for (let i = 0; i < opts.warmup; ++i) await streamCompletion(uniquePrompt(opts.promptChars), opts.maxTokens);
  const results = [];
  const t0 = performance.now();
  const clients = [];
  for (let c = 0; c < opts.concurrency; ++c) {
    clients.push((async () => {
      for (let r = 0; r < opts.requests; ++r) results.push(await streamCompletion(uniquePrompt(opts.promptChars), opts.maxTokens));
    })());
  }
  await Promise.all(clients);
  const wallS = (performance.now() - t0) / 1000;
  const generated = results.reduce((a, r) => a + r.completionTokens, 0);
  const prompted = results.reduce((a, r) => a + r.promptTokens, 0);
  const ttft = results.map((r) => r.ttftMs);
  const itl = results.flatMap((r) => r.gapsMs);
  return {
    mode: 'load', concurrency: opts.concurrency, requests: results.length, max_tokens: opts.maxTokens,
    mean_prompt_tokens: round(results.reduce((a, r) => a + r.promptTokens, 0) / results.length, 1),
    wall_s: round(wallS, 3), generated_tokens: generated,
    output_tokens_per_s: round(generated / wallS, 1), total_tokens_per_s: round((generated + prompted) / wallS, 1),
    requests_per_s: round(results.length / wallS, 3),
    ttft_p50_ms: round(quantile(ttft, 0.5)), ttft_p99_ms: round(quantile(ttft, 0.99)),
    itl_p50_ms: round(quantile(itl, 0.5)), itl_p99_ms: round(quantile(itl, 0.99)),
    e2e_p50_ms: round(quantile(results.map((r) => r.e2eMs), 0.5)),
  };
}

async function runPrefix() {
  await streamCompletion(uniquePrompt(64), 1);  // warm up
  const miss = [];
  const hit = [];
  let promptTokens = 0;
  let cached = 0;
  for (let t = 0; t < opts.trials; ++t) {
    const prompt = uniquePrompt(opts.promptChars);
    const a = await streamCompletion(prompt, 1);
    const b = await streamCompletion(prompt, 1);
    if (a.cachedTokens !== 0) throw new Error(`the first request of a trial hit the cache (${a.cachedTokens} tokens)`);
    miss.push(a.ttftMs);
    hit.push(b.ttftMs);
    promptTokens = a.promptTokens;
    cached = b.cachedTokens;
  }
  const missMs = quantile(miss, 0.5);
  const hitMs = quantile(hit, 0.5);
  return {
    mode: 'prefix', trials: opts.trials, prompt_tokens: promptTokens, cached_tokens_on_hit: cached,
    ttft_miss_p50_ms: round(missMs), ttft_hit_p50_ms: round(hitMs), miss_over_hit: round(missMs / hitMs, 1),
  };
}

const result = opts.mode === 'prefix' ? await runPrefix() : await runLoad();
console.log(JSON.stringify(result));
