// The serving load check (issue 14): C clients x R requests against a
// `pagoda serve` this script starts on a free loopback port, in two rounds.
// Requests mix streaming and non-streaming, share a few long prefixes (so the
// prefix cache is hit and blocks are shared), and every fifth one is a fixed
// greedy check prompt whose text must equal the answer it got alone before
// the load. After each round the server must come back to no block in use.
//
//   node bench/serve/load_rounds.mjs [--cli build/release/pagoda] [--model models/stories260K.gguf]
//        [--clients 64] [--requests 20] [-- extra serve flags]
//
// Reports errors (transport, non-200, wrong check text), p50/p99 latency and
// TTFT (streamed requests), generated tokens/s, blocks left in use (from
// /metrics) and the server's RSS growth (VmRSS from /proc) over the rounds.
// Node 20's fetch only: no npm package.
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';

const argv = process.argv.slice(2);
const split = argv.indexOf('--');
const own = split < 0 ? argv : argv.slice(0, split);
const serveExtra = split < 0 ? [] : argv.slice(split + 1);
const opt = (name, def) => {
  const i = own.indexOf(name);
  return i < 0 ? def : own[i + 1];
};
const cli = opt('--cli', 'build/release/pagoda');
const model = opt('--model', 'models/stories260K.gguf');
const nClients = Number(opt('--clients', '64'));
const nRequests = Number(opt('--requests', '20'));

const PREFIXES = [
  'Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine with her dog. ',
  'Tom and his mom went to the park on a sunny day. They saw a big red ball near the pond and many ducks. ',
  'There was a small bird who lived in a tall tree. Every morning the bird sang a happy song for the forest. ',
  'One day, a boy named Ben found a shiny key in the garden. He wondered what door the key could open. ',
].map((p) => p.repeat(3));
const CHECK = { prompt: 'Once upon a time, there was a little', max_tokens: 24, temperature: 0 };

function startServer() {
  const args = ['serve', '-m', model, '--port', '0', '--no-kv-store', '--no-access-log', '--log-stats-interval', '0',
    ...serveExtra];
  const proc = spawn(cli, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  proc.stderr.on('data', (d) => { log += d; });
  return new Promise((resolve, reject) => {
    let out = '';
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[^\s]+)/);
      if (m) resolve({ proc, url: m[1] });
    });
    proc.on('exit', (code) => reject(new Error(`pagoda serve exited with ${code}:\n${log}`)));
  });
}

const rssBytes = (pid) => {
  const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+) kB/);
  return m ? Number(m[1]) * 1024 : NaN;
};

async function metric(url, key) {
  const text = await (await fetch(`${url}/metrics`)).text();
  for (const line of text.split('\n')) {
    if (line.startsWith('#')) continue;
    const sp = line.lastIndexOf(' ');
    const name = line.slice(0, sp).replace(/model_name="[^"]*",?/, '').replace('{}', '');
    if (name === key) return Number(line.slice(sp + 1));
  }
  return NaN;
}

async function complete(url, body) {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${(await res.text()).slice(0, 200)}`);
  if (!body.stream) {
    const j = await res.json();
    return { text: j.choices[0].text, tokens: j.usage.completion_tokens, ms: performance.now() - t0, ttft: null };
  }
  let text = '', tokens = 0, ttft = null, buf = '', done = false;
  const decoder = new TextDecoder();
  for await (const piece of res.body) {
    buf += decoder.decode(piece, { stream: true });
    let at;
    while ((at = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, at);
      buf = buf.slice(at + 2);
      if (!event.startsWith('data: ')) continue;
      const data = event.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const j = JSON.parse(data);
      if (j.usage) tokens = j.usage.completion_tokens;
      if (j.choices.length && j.choices[0].text) {
        if (ttft === null) ttft = performance.now() - t0;
        text += j.choices[0].text;
      }
    }
  }
  if (!done) throw new Error('stream ended without [DONE]');
  return { text, tokens, ms: performance.now() - t0, ttft };
}

const pct = (xs, p) => {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};

async function round(url, checkText) {
  const lat = [], ttft = [], errors = [];
  let tokens = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: nClients }, async (_, c) => {
    for (let r = 0; r < nRequests; ++r) {
      const check = (c + r) % 5 === 0;
      const stream = (c + r) % 2 === 0;
      const body = check ? { ...CHECK, stream } : {
        prompt: PREFIXES[(c + r) % PREFIXES.length] + `Client ${c} asks question ${r}.`,
        max_tokens: 16 + ((c * 7 + r) % 17), temperature: 0.8, seed: c * 1000 + r, stream,
      };
      if (stream) body.stream_options = { include_usage: true };
      try {
        const a = await complete(url, body);
        lat.push(a.ms);
        if (a.ttft !== null) ttft.push(a.ttft);
        tokens += a.tokens;
        if (check && a.text !== checkText) errors.push(`check text differs: ${JSON.stringify(a.text)}`);
      } catch (e) {
        errors.push(String(e.message || e));
      }
    }
  }));
  const wall = (performance.now() - t0) / 1000;
  return { lat, ttft, errors, tokens, wall };
}

async function idleBlocks(url) {
  for (let i = 0; i < 200; ++i) {
    const used = await metric(url, 'pagoda:kv_cache_blocks{state="used"}');
    const running = await metric(url, 'pagoda:num_requests_running');
    if (used === 0 && running === 0) return 0;
    await new Promise((r) => setTimeout(r, 10));
  }
  return metric(url, 'pagoda:kv_cache_blocks{state="used"}');
}

const { proc, url } = await startServer();
try {
  const reference = (await complete(url, CHECK)).text;
  await round(url, reference);  // warm-up: allocator pools, prefix cache
  await idleBlocks(url);
  const rss0 = rssBytes(proc.pid);
  console.log(`pagoda serve ${serveExtra.join(' ')} on ${model}: ${nClients} clients x ${nRequests} requests a round`);
  console.log('| round | requests | errors | latency p50 / p99 ms | TTFT p50 / p99 ms | gen tok/s | blocks in use after | RSS growth MB |');
  console.log('|---|---|---|---|---|---|---|---|');
  let failed = false;
  for (let i = 1; i <= 2; ++i) {
    const r = await round(url, reference);
    const leaked = await idleBlocks(url);
    const growth = (rssBytes(proc.pid) - rss0) / 1e6;
    const f = (x) => x.toFixed(1);
    console.log(`| ${i} | ${r.lat.length + r.errors.length} | ${r.errors.length} | ${f(pct(r.lat, 50))} / ${f(pct(r.lat, 99))} | ` +
      `${f(pct(r.ttft, 50))} / ${f(pct(r.ttft, 99))} | ${f(r.tokens / r.wall)} | ${leaked} | ${f(growth)} |`);
    for (const e of r.errors.slice(0, 5)) console.log(`  error: ${e}`);
    failed ||= r.errors.length > 0 || leaked !== 0;
  }
  console.log(`check prompt (greedy, ${CHECK.max_tokens} tokens): ${JSON.stringify(reference)}`);
  process.exitCode = failed ? 1 : 0;
} finally {
  proc.kill('SIGTERM');
}
