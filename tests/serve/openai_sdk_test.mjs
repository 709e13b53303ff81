// The official OpenAI Node SDK (npm `openai`, 4.x, pinned in package-lock.json) against
// `simpler serve` on a free loopback port: completions and chat completions, streamed and not,
// n > 1, stop strings, logprobs, tools, errors, and a SIGTERM that drains and exits 0.
//
// Usage: node openai_sdk_test.mjs SIMPLER_BINARY WORK_DIR TOKENIZER_DIR
import { spawn, execFileSync } from "node:child_process";
import { mkdirSync, rmSync } from "node:fs";
import assert from "node:assert/strict";
import OpenAI from "openai";

const [simpler, work, tokenizerDir] = process.argv.slice(2);
if (!simpler || !work || !tokenizerDir) {
  console.error("usage: openai_sdk_test.mjs SIMPLER WORK_DIR TOKENIZER_DIR");
  process.exit(2);
}
rmSync(work, { recursive: true, force: true });
mkdirSync(work, { recursive: true });
const model = `${work}/model`;
execFileSync(simpler, ["make-model", "--preset", "tiny", "--seed", "5", "--out", model,
                       "--tokenizer-dir", tokenizerDir], { stdio: "inherit" });

const KEY = "test-key-123";
const server = spawn(simpler, ["serve", "--model", model, "--port", "0", "--api-key", KEY,
                               "--served-model-name", "tiny", "--max-num-seqs", "8",
                               "--drain-timeout", "5"], { stdio: ["ignore", "pipe", "inherit"] });
const exited = new Promise((resolve) => server.on("exit", (code, signal) => resolve({ code, signal })));
const baseURL = await new Promise((resolve, reject) => {
  let out = "";
  const timer = setTimeout(() => reject(new Error(`no ready line in 60 s: ${out}`)), 60000);
  server.stdout.on("data", (d) => {
    out += d;
    const m = out.match(/ready on (http:\/\/127\.0\.0\.1:\d+\/v1)/);
    if (m) {
      clearTimeout(timer);
      resolve(m[1]);
    }
  });
  server.on("exit", () => reject(new Error(`the server exited before it was ready: ${out}`)));
});
console.log(`server at ${baseURL}`);

const client = new OpenAI({ apiKey: KEY, baseURL, maxRetries: 0, timeout: 60000 });
let failures = 0;
async function check(name, fn) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failures++;
    console.log(`FAIL ${name}: ${e.stack || e}`);
  }
}

await check("models lists the served model", async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ["tiny"]);
});

await check("completion, not streamed and streamed, give the same text", async () => {
  const args = { model: "tiny", prompt: "Once upon a time", max_tokens: 12, temperature: 0,
                 ignore_eos: true };
  const full = await client.completions.create(args);
  assert.equal(full.object, "text_completion");
  assert.equal(full.choices.length, 1);
  assert.equal(full.choices[0].finish_reason, "length");
  assert.equal(full.usage.completion_tokens, 12);
  let text = "";
  let finish = null;
  let usage = null;
  const stream = await client.completions.create({ ...args, stream: true,
                                                   stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, full.choices[0].text);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 12);
  assert.equal(usage.prompt_tokens, full.usage.prompt_tokens);
});

await check("chat, n = 2 with a seed, streamed and not", async () => {
  const args = { model: "tiny", messages: [{ role: "system", content: "Be brief." },
                                           { role: "user", content: "Hello! ¿Qué tal? 🦊" }],
                 max_tokens: 8, temperature: 0.8, seed: 11, n: 2 };
  const full = await client.chat.completions.create(args);
  assert.equal(full.choices.length, 2);
  const texts = ["", ""];
  const roles = [0, 0];
  const stream = await client.chat.completions.create({ ...args, stream: true });
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      if (c.delta.role) roles[c.index]++;
      if (c.delta.content) texts[c.index] += c.delta.content;
    }
  }
  assert.deepEqual(roles, [1, 1]);
  for (const c of full.choices) {
    assert.equal(c.message.role, "assistant");
    assert.equal(texts[c.index], c.message.content);
  }
});

await check("a stop string cuts the text before it", async () => {
  const base = await client.completions.create({ model: "tiny", prompt: "abc", max_tokens: 16,
                                                 temperature: 0, ignore_eos: true });
  const text = base.choices[0].text;
  // A stop string from the middle of the text: the first occurrence of a 2-character piece.
  const chars = [...text];
  assert.ok(chars.length >= 6, `text too short: ${JSON.stringify(text)}`);
  const stop = chars.slice(3, 5).join("");
  const cut = text.slice(0, text.indexOf(stop));
  const stopped = await client.completions.create({ model: "tiny", prompt: "abc", max_tokens: 16,
                                                    temperature: 0, ignore_eos: true, stop: [stop] });
  assert.equal(stopped.choices[0].finish_reason, "stop");
  assert.equal(stopped.choices[0].text, cut);
});

await check("logprobs on completions and chat", async () => {
  const c = await client.completions.create({ model: "tiny", prompt: "x", max_tokens: 3,
                                              temperature: 0, logprobs: 2, ignore_eos: true });
  const lp = c.choices[0].logprobs;
  assert.equal(lp.tokens.length, 3);
  assert.equal(lp.token_logprobs.length, 3);
  for (const v of lp.token_logprobs) assert.ok(v <= 0);
  for (const top of lp.top_logprobs) assert.equal(Object.keys(top).length, 2);
  const chat = await client.chat.completions.create({ model: "tiny", max_tokens: 2,
      messages: [{ role: "user", content: "x" }], logprobs: true, top_logprobs: 3 });
  const content = chat.choices[0].logprobs.content;
  assert.equal(content.length, chat.usage.completion_tokens);
  assert.equal(content[0].top_logprobs.length, 3);
  assert.ok(content[0].logprob <= content[0].top_logprobs[0].logprob + 1e-6);
});

await check("errors arrive as the SDK's typed errors", async () => {
  const bad = new OpenAI({ apiKey: "wrong", baseURL, maxRetries: 0, timeout: 10000 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
  await assert.rejects(
      client.completions.create({ model: "tiny", prompt: "x", max_tokens: 0 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "max_tokens");
  await assert.rejects(
      client.completions.create({ model: "nope", prompt: "x" }),
      (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found");
  await assert.rejects(
      client.chat.completions.create({ model: "tiny", messages: [{ role: "user", content: "x" }],
                                       tools: [{ type: "function", function: { name: "f" } }],
                                       tool_choice: { type: "function", function: { name: "g" } } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "tool_choice" &&
             /'g', which is not in 'tools'/.test(e.message));
});

await check("tools: a tool round trip under every tool_choice, streamed and not", async () => {
  const tools = [{ type: "function", function: { name: "get_weather", description: "Weather",
                   parameters: { type: "object", properties: { city: { type: "string" } },
                                 required: ["city"] } } }];
  const messages = [
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function",
      function: { name: "get_weather", arguments: JSON.stringify({ city: "Paris" }) } }] },
    { role: "tool", tool_call_id: "call_1", content: "21 C" }];
  const choices = ["auto", "none", "required",
                   { type: "function", function: { name: "get_weather" } }];
  for (const tool_choice of choices) {
    const args = { model: "tiny", messages, tools, tool_choice, max_tokens: 6, temperature: 0,
                   ignore_eos: true };
    const full = await client.chat.completions.create(args);
    const c = full.choices[0];
    // Six tokens end every output before a call is complete (under "required" and a named
    // function, inside the constrained call): its text comes back as content.
    assert.equal(c.finish_reason, "length", JSON.stringify(tool_choice));
    assert.equal(c.message.tool_calls, undefined);
    assert.ok(c.message.content.length > 0);
    let text = "";
    let finish = null;
    for await (const chunk of await client.chat.completions.create({ ...args, stream: true })) {
      for (const d of chunk.choices) {
        assert.equal(d.delta.tool_calls, undefined);
        if (d.delta.content) text += d.delta.content;
        if (d.finish_reason) finish = d.finish_reason;
      }
    }
    assert.equal(text, c.message.content);
    assert.equal(finish, "length");
  }
});

await check("tools: constrained decoding makes every required or named call valid", async () => {
  const tools = [{ type: "function", function: { name: "toss", parameters: { type: "object",
                   properties: { heads: { type: "boolean" } }, required: ["heads"],
                   additionalProperties: false } } }];
  for (const tool_choice of ["required", { type: "function", function: { name: "toss" } }]) {
    const args = { model: "tiny", messages: [{ role: "user", content: "Toss" }], tools,
                   tool_choice, parallel_tool_calls: false, max_tokens: 60, temperature: 0 };
    const full = await client.chat.completions.create(args);
    const c = full.choices[0];
    assert.equal(c.finish_reason, "tool_calls", JSON.stringify(c));
    assert.equal(c.message.tool_calls.length, 1);
    assert.equal(c.message.tool_calls[0].function.name, "toss");
    assert.equal(typeof JSON.parse(c.message.tool_calls[0].function.arguments).heads, "boolean");
    let name = "", argsText = "", finish = null;
    for await (const chunk of await client.chat.completions.create({ ...args, stream: true })) {
      for (const d of chunk.choices) {
        for (const t of d.delta.tool_calls ?? []) {
          if (t.function?.name) name += t.function.name;
          if (t.function?.arguments) argsText += t.function.arguments;
        }
        if (d.finish_reason) finish = d.finish_reason;
      }
    }
    assert.equal(name, "toss");
    assert.equal(argsText, c.message.tool_calls[0].function.arguments);
    assert.equal(finish, "tool_calls");
  }
});

await check("response_format json_schema: the content parses and matches the schema", async () => {
  const r = await client.chat.completions.create({
    model: "tiny", messages: [{ role: "user", content: "Color?" }], max_tokens: 40,
    temperature: 0.7, seed: 5,
    response_format: { type: "json_schema", json_schema: { name: "c", strict: true, schema: {
      type: "object", properties: { color: { enum: ["red", "blue"] }, ok: { type: "boolean" } },
      required: ["color", "ok"], additionalProperties: false } } } });
  const c = r.choices[0];
  assert.equal(c.finish_reason, "stop", JSON.stringify(c));
  const v = JSON.parse(c.message.content);
  assert.deepEqual(Object.keys(v), ["color", "ok"]);
  assert.ok(["red", "blue"].includes(v.color));
  assert.equal(typeof v.ok, "boolean");
  await assert.rejects(
      client.chat.completions.create({ model: "tiny", messages: [{ role: "user", content: "x" }],
        response_format: { type: "json_schema", json_schema: { name: "c",
          schema: { type: "string", pattern: "^a" } } } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "response_format" &&
             /unsupported JSON Schema keyword 'pattern'/.test(e.message));
});

await check("guided_regex and GBNF grammar (vLLM / llama-server fields): outputs match", async () => {
  const r = await client.chat.completions.create({
    model: "tiny", messages: [{ role: "user", content: "Phone?" }], max_tokens: 30, seed: 2,
    temperature: 0.8, guided_regex: String.raw`\(\d{3}\) \d{3}-\d{4}` });
  assert.equal(r.choices[0].finish_reason, "stop", JSON.stringify(r.choices[0]));
  assert.match(r.choices[0].message.content, /^\(\d{3}\) \d{3}-\d{4}$/);
  for (const field of ["guided_grammar", "grammar"]) {
    const c = await client.completions.create({
      model: "tiny", prompt: "Answer:", max_tokens: 20, temperature: 0,
      [field]: 'root ::= ("yes" | "no") [.!]\n' });
    assert.equal(c.choices[0].finish_reason, "stop", field);
    assert.match(c.choices[0].text, /^(yes|no)[.!]$/, field);
  }
  await assert.rejects(
      client.completions.create({ model: "tiny", prompt: "x", guided_regex: "(a)\\1" }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "guided_regex" &&
             /unsupported regular expression construct: backreference \\1 at byte offset 3/
                 .test(e.message));
  await assert.rejects(
      client.completions.create({ model: "tiny", prompt: "x", grammar: "root ::= (\"a\"\n" }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "grammar" &&
             /expected \) at 2:1/.test(e.message));
});

await check("SIGTERM with a stream in flight: the stream ends cleanly, exit 0", async () => {
  const stream = await client.completions.create({ model: "tiny", prompt: "long", max_tokens: 3000,
                                                   ignore_eos: true, stream: true });
  let finish = null;
  let chunks = 0;
  setTimeout(() => server.kill("SIGTERM"), 300);
  for await (const chunk of stream) {
    chunks++;
    for (const c of chunk.choices) if (c.finish_reason) finish = c.finish_reason;
  }
  assert.ok(chunks > 0);
  assert.ok(finish === "abort" || finish === "length", `finish_reason ${finish}`);
  const { code, signal } = await Promise.race([
      exited, new Promise((_, rej) => setTimeout(() => rej(new Error("no exit in 20 s")), 20000))]);
  assert.equal(signal, null);
  assert.equal(code, 0);
});

server.kill("SIGKILL");
if (failures === 0) rmSync(work, { recursive: true, force: true });
console.log(failures === 0 ? "all passed" : `${failures} failed`);
process.exit(failures === 0 ? 0 : 1);
