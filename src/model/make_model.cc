#include "simpler/model/make_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using task::DataType;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// How a tensor's values are drawn: mean + std * N(0, 1).
struct Init {
  float mean = 0.0f;
  float std = 1.0f;
};

Init init_for(const WeightSpec& spec) {
  const std::string& n = spec.name;
  auto ends_with = [&](std::string_view suffix) {
    return n.size() >= suffix.size() &&
           n.compare(n.size() - suffix.size(), suffix.size(), std::string(suffix)) == 0;
  };
  if (ends_with("norm.weight")) return {1.0f, 0.1f};  // RMSNorm, q_norm, k_norm
  // Linear [out, in], and the embedding / lm_head [vocab, hidden].
  return {0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(spec.shape.back())))};
}

// Fills consecutive chunks of one tensor with its random values.
class RandomFill {
 public:
  RandomFill(uint64_t seed, size_t tensor_index, Init init, DataType dtype)
      : rng_(splitmix64(seed ^ splitmix64(tensor_index + 1))), init_(init), dtype_(dtype) {}

  absl::Status operator()(std::span<std::byte> chunk) {
    const size_t elem = task::size_of(dtype_);
    const size_t n = chunk.size() / elem;
    std::byte* out = chunk.data();
    for (size_t i = 0; i < n; ++i) {
      const float v = init_.mean + init_.std * normal_(rng_);
      if (dtype_ == DataType::kFloat32) {
        std::memcpy(out + 4 * i, &v, 4);
      } else {
        const uint16_t h = task::f32_to_bf16(v);
        std::memcpy(out + 2 * i, &h, 2);
      }
    }
    return absl::OkStatus();
  }

 private:
  std::mt19937_64 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
  Init init_;
  DataType dtype_;
};

absl::Status write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    return absl::InternalError(
        absl::StrCat("cannot write ", path.string(), ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string shard_name(int index, int count) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", index + 1, count);
}

}  // namespace

absl::StatusOr<ModelConfig> preset_config(std::string_view preset, const ModelConfigOverrides& o) {
  ModelConfig c;
  if (preset == "tiny") {
    c.hidden_size = 128;
    c.intermediate_size = 384;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.vocab_size = 151936;
    c.max_position_embeddings = 4096;
  } else if (preset == "qwen3-0.6b") {
    c.hidden_size = 1024;
    c.intermediate_size = 3072;
    c.num_hidden_layers = 28;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.vocab_size = 151936;
    c.max_position_embeddings = 40960;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown model preset '", std::string(preset),
                                                   "' (expected tiny or qwen3-0.6b)"));
  }
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = true;
  c.hidden_size = o.hidden_size.value_or(c.hidden_size);
  c.intermediate_size = o.intermediate_size.value_or(c.intermediate_size);
  c.num_hidden_layers = o.num_hidden_layers.value_or(c.num_hidden_layers);
  c.num_attention_heads = o.num_attention_heads.value_or(c.num_attention_heads);
  c.num_key_value_heads = o.num_key_value_heads.value_or(c.num_key_value_heads);
  c.head_dim = o.head_dim.value_or(c.head_dim);
  c.vocab_size = o.vocab_size.value_or(c.vocab_size);
  c.max_position_embeddings = o.max_position_embeddings.value_or(c.max_position_embeddings);
  c.rope_theta = o.rope_theta.value_or(c.rope_theta);
  c.rms_norm_eps = o.rms_norm_eps.value_or(c.rms_norm_eps);
  c.tie_word_embeddings = o.tie_word_embeddings.value_or(c.tie_word_embeddings);
  if (c.vocab_size > kQwen3ImEndId) {
    c.bos_token_id = kQwen3EndOfTextId;
    c.eos_token_ids = {kQwen3ImEndId};
    c.generation_eos_token_ids = {kQwen3ImEndId, kQwen3EndOfTextId};
  } else if (c.vocab_size >= 2) {
    c.bos_token_id = c.vocab_size - 2;
    c.eos_token_ids = {c.vocab_size - 1};
    c.generation_eos_token_ids = {c.vocab_size - 1, c.vocab_size - 2};
  }
  SIMPLER_RETURN_IF_ERROR(
      c.validate(absl::StrCat("preset ", std::string(preset), " with overrides")));
  return c;
}

absl::Status make_model(const MakeModelOptions& options) {
  SIMPLER_ASSIGN_OR_RETURN(ModelConfig config, preset_config(options.preset, options.overrides));
  if (options.dtype != DataType::kBFloat16 && options.dtype != DataType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ",
                                                   std::string(task::name_of(options.dtype)),
                                                   " (expected bf16 or f32)"));
  }
  config.torch_dtype = options.dtype == DataType::kBFloat16 ? "bfloat16" : "float32";
  const std::vector<WeightSpec> specs = config.tensor_names_and_shapes();
  if (options.shards < 1 || static_cast<size_t>(options.shards) > specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards must be in [1, ", specs.size(), "], got ", options.shards));
  }
  if (options.out_dir.empty()) {
    return absl::InvalidArgumentError("empty output directory");
  }
  const fs::path out(options.out_dir);
  std::vector<fs::path> tokenizer_files;
  if (!options.tokenizer_dir.empty()) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::path p = fs::path(options.tokenizer_dir) / name;
      std::error_code ec;
      if (!fs::is_regular_file(p, ec)) {
        return absl::NotFoundError(absl::StrCat("tokenizer file ", p.string(),
                                                " not found (tokenizer_dir ", options.tokenizer_dir,
                                                ")"));
      }
      tokenizer_files.push_back(p);
    }
  }

  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", out.string(), ": ", ec.message()));
  }
  // Remove weights of an earlier model so the directory holds exactly one checkpoint.
  for (const fs::directory_entry& entry : fs::directory_iterator(out, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard = name.starts_with("model-") && name.ends_with(".safetensors");
    if (shard || name == "model.safetensors" || name == "model.safetensors.index.json") {
      fs::remove(entry.path(), ec);
    }
  }

  SIMPLER_RETURN_IF_ERROR(write_text(out / "config.json", config.to_config_json()));
  SIMPLER_RETURN_IF_ERROR(
      write_text(out / "generation_config.json", config.to_generation_config_json()));

  // Assign tensors to shards: contiguous runs of about total/shards bytes, none empty.
  const size_t elem = task::size_of(options.dtype);
  std::vector<uint64_t> bytes(specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    uint64_t n = 1;
    for (int64_t d : specs[i].shape) n *= static_cast<uint64_t>(d);
    bytes[i] = n * elem;
    total += bytes[i];
  }
  const int shards = options.shards;
  const uint64_t target = (total + shards - 1) / shards;
  std::vector<int> shard_of(specs.size());
  {
    int shard = 0;
    uint64_t in_shard = 0;
    size_t count = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      const size_t remaining = specs.size() - i;
      const int later_shards = shards - 1 - shard;
      if (count > 0 && later_shards > 0 &&
          (in_shard + bytes[i] > target || remaining <= static_cast<size_t>(later_shards))) {
        ++shard;
        in_shard = 0;
        count = 0;
      }
      shard_of[i] = shard;
      in_shard += bytes[i];
      ++count;
    }
  }

  SIMPLER_LOG_INFO("make-model: writing {} ({} tensors, {:.1f} MB, {} shard(s)) to {}",
                   options.preset, specs.size(), static_cast<double>(total) / 1e6, shards,
                   out.string());
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  json weight_map = json::object();
  size_t next = 0;
  for (int s = 0; s < shards; ++s) {
    const std::string file = shards == 1 ? "model.safetensors" : shard_name(s, shards);
    std::vector<TensorSource> sources;
    for (; next < specs.size() && shard_of[next] == s; ++next) {
      const WeightSpec& spec = specs[next];
      TensorSource src;
      src.name = spec.name;
      src.dtype = options.dtype;
      src.shape = spec.shape;
      auto fill = std::make_shared<RandomFill>(options.seed, next, init_for(spec), options.dtype);
      const std::string name = spec.name;
      const size_t index = next;
      const size_t count = specs.size();
      const uint64_t size = bytes[next];
      auto produced = std::make_shared<uint64_t>(0);
      src.produce = [fill, produced, name, index, count, size](std::span<std::byte> chunk) {
        SIMPLER_RETURN_IF_ERROR((*fill)(chunk));
        *produced += chunk.size();
        if (*produced == size) {
          SIMPLER_LOG_INFO("make-model: [{}/{}] {} ({:.1f} MB)", index + 1, count, name,
                           static_cast<double>(size) / 1e6);
        }
        return absl::OkStatus();
      };
      sources.push_back(std::move(src));
      weight_map[spec.name] = file;
    }
    SIMPLER_RETURN_IF_ERROR(write_safetensors((out / file).string(), sources, metadata));
  }
  if (shards > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    SIMPLER_RETURN_IF_ERROR(write_text(out / "model.safetensors.index.json", index.dump(2) + "\n"));
  }

  for (const fs::path& p : tokenizer_files) {
    fs::copy_file(p, out / p.filename(), fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot copy ", p.string(), " to ", out.string(), ": ", ec.message()));
    }
  }
  SIMPLER_LOG_INFO("make-model: done: {}", out.string());
  return absl::OkStatus();
}

}  // namespace simpler::llm
