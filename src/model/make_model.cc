#include "simpler/model/make_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numbers>
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

// Fills consecutive chunks of one tensor with its random values: splitmix64's sequence
// (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) seeded
// from the seed and the tensor's index, two 53-bit uniforms per Box–Muller pair (Box and Muller,
// "A note on the generation of random normal deviates", 1958) in double, rounded once to the
// tensor's dtype. Every step is specified here, so the same options give the same bytes with
// any standard library (std::normal_distribution's algorithm is the library's choice), and it
// is cheap where it runs most: libstdc++'s generate_canonical recomputed a long-double log per
// draw, a third of the time of a test binary that makes a model under the sanitizers.
class RandomFill {
 public:
  RandomFill(uint64_t seed, size_t tensor_index, Init init, DataType dtype)
      : state_(splitmix64(seed ^ splitmix64(tensor_index + 1))), init_(init), dtype_(dtype) {}

  absl::Status operator()(std::span<std::byte> chunk) {
    const size_t elem = task::size_of(dtype_);
    const size_t n = chunk.size() / elem;
    std::byte* out = chunk.data();
    for (size_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(init_.mean + init_.std * next_normal());
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
  // The next value of splitmix64's sequence.
  uint64_t next_u64() {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // A uniform double in (0, 1]: never 0, so its log is finite.
  double next_uniform() { return static_cast<double>((next_u64() >> 11) + 1) * 0x1.0p-53; }
  // N(0, 1): Box–Muller gives two values a pair; the second is kept for the next call.
  double next_normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double radius = std::sqrt(-2.0 * std::log(next_uniform()));
    const double angle = 2.0 * std::numbers::pi * next_uniform();
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0.0;
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
  // name, hidden, intermediate, layers, heads, kv heads, head_dim, vocab, max positions.
  struct Preset {
    std::string_view name;
    int64_t hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, max_positions;
  };
  static constexpr Preset kPresets[] = {
      {"tiny", 128, 384, 2, 4, 2, 64, 151936, 4096},
      {"qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151936, 40960},
  };
  const Preset* found = nullptr;
  for (const Preset& p : kPresets) {
    if (p.name == preset) found = &p;
  }
  if (found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown model preset '", std::string(preset),
                                                   "' (expected tiny or qwen3-0.6b)"));
  }
  ModelConfig c;
  c.hidden_size = found->hidden;
  c.intermediate_size = found->intermediate;
  c.num_hidden_layers = found->layers;
  c.num_attention_heads = found->heads;
  c.num_key_value_heads = found->kv_heads;
  c.head_dim = found->head_dim;
  c.vocab_size = found->vocab;
  c.max_position_embeddings = found->max_positions;
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

namespace {

// tokenizer.json and tokenizer_config.json of options.tokenizer_dir (none when it is empty).
absl::StatusOr<std::vector<fs::path>> find_tokenizer_files(const MakeModelOptions& options) {
  std::vector<fs::path> tokenizer_files;
  if (options.tokenizer_dir.empty()) return tokenizer_files;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::path p = fs::path(options.tokenizer_dir) / name;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) {
      return absl::NotFoundError(absl::StrCat(
          "tokenizer file ", p.string(), " not found (tokenizer_dir ", options.tokenizer_dir, ")"));
    }
    tokenizer_files.push_back(p);
  }
  return tokenizer_files;
}

// Whether make-model writes a file of this name (or leaves it beside its model: a GGUF export).
bool written_by_make_model(const std::string& name) {
  static const char* const kNames[] = {"config.json",       "generation_config.json",
                                       "model.safetensors", "model.safetensors.index.json",
                                       "tokenizer.json",    "tokenizer_config.json"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return (name.starts_with("model-") && name.ends_with(".safetensors")) || name.ends_with(".gguf");
}

// An existing `out` may be replaced only when it holds what make-model writes and its
// config.json was not written by Hugging Face's transformers (which records its version there):
// a checkpoint of another origin, or a folder of other files, is never overwritten.
absl::Status check_out_dir(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return absl::OkStatus();
  if (!fs::is_directory(out, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(out.string(), " is not a directory"));
  }
  int64_t others = 0;
  std::string first;
  for (const fs::directory_entry& entry : fs::directory_iterator(out, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".")) continue;  // hidden files (.gitkeep, .DS_Store) are no one's model
    std::error_code type_ec;
    if (written_by_make_model(name) && !entry.is_directory(type_ec)) continue;
    if (others++ == 0) first = name;
  }
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot list ", out.string(), ": ", ec.message()));
  }
  if (others > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(out.string(), " holds files make-model does not write (", first,
                     others > 1 ? absl::StrCat(" and ", others - 1, " more") : "",
                     "): give a new or empty directory, or one make-model wrote"));
  }
  std::ifstream config(out / "config.json");
  const json j = config ? json::parse(config, nullptr, false) : json();
  if (j.is_object() && j.contains("transformers_version")) {
    return absl::FailedPreconditionError(
        absl::StrCat(out.string(),
                     " holds a Hugging Face checkpoint (its config.json has "
                     "transformers_version): make-model does not overwrite one; give a new or "
                     "empty directory"));
  }
  return absl::OkStatus();
}

// Creates `out` and removes weights of an earlier model so it holds exactly one checkpoint.
absl::Status prepare_out_dir(const fs::path& out) {
  SIMPLER_RETURN_IF_ERROR(check_out_dir(out));
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", out.string(), ": ", ec.message()));
  }
  for (const fs::directory_entry& entry : fs::directory_iterator(out, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard = name.starts_with("model-") && name.ends_with(".safetensors");
    if (shard || name == "model.safetensors" || name == "model.safetensors.index.json") {
      fs::remove(entry.path(), ec);
    }
  }
  return absl::OkStatus();
}

// Each tensor's shard: contiguous runs of about total/shards bytes, none empty.
std::vector<int> assign_shards(const std::vector<uint64_t>& bytes, uint64_t total, int shards) {
  const uint64_t target = (total + shards - 1) / shards;
  std::vector<int> shard_of(bytes.size());
  int shard = 0;
  uint64_t in_shard = 0;
  size_t count = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const size_t remaining = bytes.size() - i;
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
  return shard_of;
}

// Tensor `index` of `specs`, `size` bytes of seeded random values, logged when written.
TensorSource random_source(const MakeModelOptions& options, const std::vector<WeightSpec>& specs,
                           size_t index, uint64_t size) {
  const WeightSpec& spec = specs[index];
  TensorSource src;
  src.name = spec.name;
  src.dtype = options.dtype;
  src.shape = spec.shape;
  auto fill = std::make_shared<RandomFill>(options.seed, index, init_for(spec), options.dtype);
  const std::string name = spec.name;
  const size_t count = specs.size();
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
  return src;
}

// RESOURCE_EXHAUSTED when the checkpoint's `total` bytes would not fit in the space free on
// `out`'s file system (a --vocab-size or --hidden-size within its bounds can ask for terabytes:
// refused before a byte is written rather than filling the disk).
absl::Status check_free_space(const fs::path& out, uint64_t total) {
  std::error_code ec;
  const fs::space_info space = fs::space(out, ec);
  if (ec) return absl::OkStatus();  // unknown: the writes will say what is wrong
  const uint64_t free_bytes = space.available;
  if (total <= free_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "the checkpoint takes %.3f GB of weights, more than the %.3f GB free on %s's "
      "file system",
      static_cast<double>(total) / 1e9, static_cast<double>(free_bytes) / 1e9, out.string()));
}

// The weights' bytes: each tensor's (its shape's product times `elem`), and their sum.
uint64_t weight_bytes(const std::vector<WeightSpec>& specs, size_t elem,
                      std::vector<uint64_t>* bytes) {
  bytes->assign(specs.size(), 0);
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    uint64_t n = 1;
    for (int64_t d : specs[i].shape) n *= static_cast<uint64_t>(d);
    (*bytes)[i] = n * elem;
    total += (*bytes)[i];
  }
  return total;
}

// The weights in `shards` files (and their index when more than one): tensor i of `specs` takes
// bytes[i], `total` in all (weight_bytes).
absl::Status write_weights(const MakeModelOptions& options, const std::vector<WeightSpec>& specs,
                           const std::vector<uint64_t>& bytes, uint64_t total,
                           const fs::path& out) {
  const int shards = options.shards;
  const std::vector<int> shard_of = assign_shards(bytes, total, shards);
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
      sources.push_back(random_source(options, specs, next, bytes[next]));
      weight_map[specs[next].name] = file;
    }
    SIMPLER_RETURN_IF_ERROR(write_safetensors((out / file).string(), sources, metadata));
  }
  if (shards > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    SIMPLER_RETURN_IF_ERROR(write_text(out / "model.safetensors.index.json", index.dump(2) + "\n"));
  }
  return absl::OkStatus();
}

}  // namespace

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
  SIMPLER_ASSIGN_OR_RETURN(const std::vector<fs::path> tokenizer_files,
                           find_tokenizer_files(options));
  SIMPLER_RETURN_IF_ERROR(prepare_out_dir(out));
  std::vector<uint64_t> bytes;
  const uint64_t total = weight_bytes(specs, task::size_of(options.dtype), &bytes);
  SIMPLER_RETURN_IF_ERROR(check_free_space(out, total));
  SIMPLER_RETURN_IF_ERROR(write_text(out / "config.json", config.to_config_json()));
  SIMPLER_RETURN_IF_ERROR(
      write_text(out / "generation_config.json", config.to_generation_config_json()));
  SIMPLER_RETURN_IF_ERROR(write_weights(options, specs, bytes, total, out));
  std::error_code ec;
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
