// `simpler make-model`: a Qwen3 model directory with random weights.
#include <iostream>
#include <limits>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "simpler/base/clock.h"
#include "simpler/model/make_model.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::cli {

Runner add_make_model_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-model",
                                 "write a Qwen3 model directory with random weights (HF layout)");
  struct State {
    std::string preset = "tiny";
    uint64_t seed = 0;
    std::string dtype = "bf16";
    std::string out;
    std::string tokenizer_dir;
    int shards = 1;
    int64_t vocab = 0, layers = 0, hidden = 0;
    bool untied = false;
  };
  auto st = std::make_shared<State>();
  cmd->add_option("--preset", st->preset, "tiny | qwen3-0.6b")
      ->check(CLI::IsMember({"tiny", "qwen3-0.6b"}))
      ->capture_default_str();
  cmd->add_option("--seed", st->seed, "random seed")->check(uint64_in())->capture_default_str();
  cmd->add_option("--dtype", st->dtype, "bf16 | f32")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  cmd->add_option("--out", st->out, "output directory")->required();
  cmd->add_option("--tokenizer-dir", st->tokenizer_dir,
                  "directory with tokenizer.json (default: the npm-installed Qwen3 files)");
  cmd->add_option("--shards", st->shards, "safetensors shards (> 1 writes an index)")
      ->check(int_in(1, kMaxShards))
      ->capture_default_str();
  auto* vocab = cmd->add_option("--vocab-size", st->vocab, "override the vocabulary size (tests)")
                    ->check(int_in(1, std::numeric_limits<int32_t>::max()));
  auto* layers = cmd->add_option("--layers", st->layers, "override the number of layers")
                     ->check(int_in(1, kMaxLayers));
  auto* hidden = cmd->add_option("--hidden-size", st->hidden, "override the hidden size")
                     ->check(int_in(1, kMaxHiddenSize));
  cmd->add_flag("--untied", st->untied, "write a separate lm_head.weight");
  return [cmd, st, vocab, layers, hidden]() -> int {
    if (!cmd->parsed()) return -1;
    llm::MakeModelOptions o;
    o.preset = st->preset;
    o.seed = st->seed;
    o.dtype = st->dtype == "f32" ? task::DataType::kFloat32 : task::DataType::kBFloat16;
    o.out_dir = st->out;
    o.shards = st->shards;
    if (vocab->count() > 0) o.overrides.vocab_size = st->vocab;
    if (layers->count() > 0) o.overrides.num_hidden_layers = st->layers;
    if (hidden->count() > 0) o.overrides.hidden_size = st->hidden;
    if (st->untied) o.overrides.tie_word_embeddings = false;
    if (st->tokenizer_dir.empty()) {
      auto dir = llm::default_tokenizer_dir();
      if (!dir.ok()) return fail("make-model", dir.status());
      o.tokenizer_dir = *dir;
    } else {
      o.tokenizer_dir = st->tokenizer_dir;
    }
    const int64_t t0 = base::now_ns();
    absl::Status s = llm::make_model(o);
    if (!s.ok()) return fail("make-model", s);
    std::cerr << "simpler make-model: wrote " << st->preset << " (" << st->dtype << ", seed "
              << st->seed << ") to " << st->out << " in " << (base::now_ns() - t0) / 1e9 << " s\n";
    return 0;
  };
}

}  // namespace simpler::cli
