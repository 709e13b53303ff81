#include "cli/bench/bench_llamacpp.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "simpler/base/enum_names.h"
#include "simpler/base/process.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"
#include "simpler/model/gguf_export.h"
#include "simpler/model/safetensors.h"

namespace simpler::cli {
namespace {

std::string peer_root() {
  const char* env = std::getenv("SIMPLER_LLAMACPP_DIR");
  return env != nullptr && *env != '\0'
             ? std::string(env)
             : std::string(SIMPLER_SOURCE_DIR) + "/build/peers/llama.cpp";
}

// The llama.cpp build of each ISA that has its own; the others use "bin".
constexpr base::EnumNames<llm::KernelIsa> kBinFolders = {
    {llm::KernelIsa::kX86_64V3, "bin-x86-64-v3"}, {llm::KernelIsa::kPortable, "bin-portable"}};

const char* bin_folder(llm::KernelIsa isa) {
  return kBinFolders.c_name(llm::resolve_kernel_isa(isa), "bin");
}

// The first JSON value of `out` that starts a line with `open` ('{' or '[').
nlohmann::json first_json(const std::string& out, char open) {
  size_t at = out[0] == open ? 0 : out.find(std::string("\n") + open);
  if (at == std::string::npos) return nlohmann::json();
  if (out[at] == '\n') ++at;
  const char close = open == '{' ? '}' : ']';
  const size_t end = open == '{' ? out.find('\n', at) : out.find(std::string("\n") + close, at);
  const std::string text = out.substr(
      at, end == std::string::npos ? std::string::npos : end - at + (open == '[' ? 2 : 0));
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// The ggml CPU variant named by a tool's "load_backend: loaded CPU backend from
// .../libggml-cpu-VARIANT.so" line in `output`; empty when none. llama-bench prints the line;
// llama-batched-bench's log filter drops it.
std::string loaded_cpu_variant(const std::string& output) {
  constexpr std::string_view kLoaded = "libggml-cpu-";
  const size_t at = output.find(kLoaded);
  if (at == std::string::npos) return "";
  const size_t end = output.find(".so", at);
  if (end == std::string::npos) return "";
  return output.substr(at + kLoaded.size(), end - at - kLoaded.size());
}

// The average tokens/s of llama-bench's JSON output (`-o json`: an array of one result each).
absl::StatusOr<double> llama_bench_tokens_per_s(const std::string& out) {
  const nlohmann::json j = first_json(out, '[');
  if (!j.is_array() || j.empty() || !j[0].contains("avg_ts")) {
    return absl::InternalError(
        absl::StrCat("llama-bench printed no result: ", out.substr(0, 2000)));
  }
  return j[0]["avg_ts"].get<double>();
}

// What a ggml x86 CPU variant's build needs beyond x86-64 (ggml/src/CMakeLists.txt's
// ggml_add_cpu_backend_variant lines, llama.cpp as node-llama-cpp 3.22.1 ships it): ggml names
// its builds after a CPU with those features, whatever CPU loads them ("zen4" on an Intel Xeon).
// Empty for a name not listed.
std::string ggml_variant_features(const std::string& variant) {
  static const std::map<std::string, std::string> kFeatures = {
      {"x64", "x86-64"},
      {"sse42", "SSE4.2"},
      {"sandybridge", "AVX"},
      {"ivybridge", "AVX, F16C"},
      {"piledriver", "AVX, F16C, FMA"},
      {"haswell", "AVX2, FMA"},
      {"skylakex", "AVX-512"},
      {"cannonlake", "AVX-512 VBMI"},
      {"cascadelake", "AVX-512 VNNI"},
      {"icelake", "AVX-512 VBMI, VNNI"},
      {"cooperlake", "AVX-512 VNNI, BF16"},
      {"zen4", "AVX-512 VBMI, VNNI, BF16"},
      {"alderlake", "AVX2, AVX-VNNI"},
      {"sapphirerapids", "AVX-512 VBMI, VNNI, BF16, AMX-INT8"},
  };
  const auto it = kFeatures.find(variant);
  return it == kFeatures.end() ? std::string() : it->second;
}

}  // namespace

LlamaCppPeer::LlamaCppPeer(std::string bin_dir, std::string gguf, bool owned)
    : bin_dir_(std::move(bin_dir)), gguf_(std::move(gguf)), owned_(owned) {}

LlamaCppPeer::LlamaCppPeer(LlamaCppPeer&& other) noexcept
    : bin_dir_(std::move(other.bin_dir_)),
      gguf_(std::exchange(other.gguf_, std::string())),
      owned_(other.owned_),
      cpu_variant_(std::move(other.cpu_variant_)) {}

LlamaCppPeer::~LlamaCppPeer() {
  if (owned_ && !gguf_.empty()) std::remove(gguf_.c_str());
}

absl::StatusOr<LlamaCppPeer> LlamaCppPeer::prepare(const std::string& model, llm::KernelIsa isa) {
  const std::string bin = peer_root() + "/" + bin_folder(isa);
  std::error_code ec;
  if (!std::filesystem::exists(bin + "/llama-bench", ec) ||
      !std::filesystem::exists(bin + "/llama-batched-bench", ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--compare llama.cpp needs llama.cpp's llama-bench and llama-batched-bench in ", bin,
        ": run scripts/install_deps.sh --bench (or set SIMPLER_LLAMACPP_DIR)"));
  }
  // The variant ggml loads from this folder, asked of llama-bench without a model: a run of
  // llama-batched-bench alone (a `--batch 16` row) does not name it.
  SIMPLER_ASSIGN_OR_RETURN(base::ProcessResult devices,
                           base::run_process({bin + "/llama-bench", "--list-devices"}));
  std::string variant = loaded_cpu_variant(devices.output);
  if (llm::is_gguf_path(model)) {
    LlamaCppPeer peer(bin, model, /*owned=*/false);
    peer.cpu_variant_ = std::move(variant);
    return peer;
  }
  llm::GgufExportOptions o;
  o.model_dir = model;
  o.out_path = (std::filesystem::temp_directory_path() /
                absl::StrCat("simpler-llamacpp-", ::getpid(), ".gguf"))
                   .string();
  absl::StatusOr<llm::ModelWeights> w = llm::ModelWeights::open(model);
  if (!w.ok()) return w.status();
  absl::StatusOr<llm::TensorView> embed = w->get("model.embed_tokens.weight");
  o.type = embed.ok() && embed->dtype == task::DataType::kFloat32 ? llm::GgufType::kF32
                                                                  : llm::GgufType::kBf16;
  SIMPLER_RETURN_IF_ERROR(llm::export_gguf(o));
  LlamaCppPeer peer(bin, o.out_path, /*owned=*/true);
  peer.cpu_variant_ = std::move(variant);
  return peer;
}

absl::StatusOr<std::string> LlamaCppPeer::run(const std::string& tool,
                                              const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin_dir_ + "/" + tool, "-m", gguf_};
  argv.insert(argv.end(), args.begin(), args.end());
  SIMPLER_ASSIGN_OR_RETURN(base::ProcessResult r, base::run_process(argv));
  if (!r.ok()) {
    return absl::InternalError(
        absl::StrCat(tool, " failed (", r.describe(), "): ", r.output.substr(0, 2000)));
  }
  if (std::string variant = loaded_cpu_variant(r.output); !variant.empty()) {
    cpu_variant_ = std::move(variant);
  }
  return r.output;
}

absl::StatusOr<double> LlamaCppPeer::decode_tokens_per_s(int batch, int steps, int threads,
                                                         int context) {
  const std::string t = std::to_string(threads), n = std::to_string(steps);
  if (batch == 1) {
    std::vector<std::string> args = {"-t", t, "-p", "0", "-n", n, "-r", "3", "-o", "json"};
    if (context > 0) args.insert(args.end(), {"-d", std::to_string(context)});
    SIMPLER_ASSIGN_OR_RETURN(std::string out, run("llama-bench", args));
    return llama_bench_tokens_per_s(out);
  }
  // With a context, the sequences share its prompt (-pps), as simpler's copies of one request
  // share its pages. -c is every sequence's room though: without a unified KV cache llama.cpp
  // splits n_ctx evenly over the sequences, so each needs its prompt and steps (a -c of the
  // shared prompt once, 360 for 4 sequences of 256 + 8, leaves each 90 cells, and the run fails).
  const int prompt = std::max(context, 1);
  const std::string ctx = std::to_string(batch * (prompt + steps + 2) + 64);
  std::vector<std::string> args = {"-t",
                                   t,
                                   "-c",
                                   ctx,
                                   "-npp",
                                   std::to_string(prompt),
                                   "-ntg",
                                   n,
                                   "-npl",
                                   std::to_string(batch),
                                   "--output-format",
                                   "jsonl"};
  if (context > 0) args.push_back("-pps");
  SIMPLER_ASSIGN_OR_RETURN(std::string out, run("llama-batched-bench", args));
  const nlohmann::json j = first_json(out, '{');
  if (!j.is_object() || !j.contains("speed_tg")) {
    return absl::InternalError(
        absl::StrCat("llama-batched-bench printed no result: ", out.substr(0, 2000)));
  }
  return j["speed_tg"].get<double>();
}

absl::StatusOr<double> LlamaCppPeer::prefill_tokens_per_s(int prompt_len, int threads) {
  SIMPLER_ASSIGN_OR_RETURN(std::string out, run("llama-bench", {"-t", std::to_string(threads), "-p",
                                                                std::to_string(prompt_len), "-n",
                                                                "0", "-r", "3", "-o", "json"}));
  return llama_bench_tokens_per_s(out);
}

absl::StatusOr<std::optional<LlamaCppPeer>> prepare_peer_if_compared(const std::string& compare,
                                                                     const std::string& model,
                                                                     llm::KernelIsa isa) {
  if (compare != "llama.cpp") return std::nullopt;
  SIMPLER_ASSIGN_OR_RETURN(LlamaCppPeer peer, LlamaCppPeer::prepare(model, isa));
  return std::optional<LlamaCppPeer>(std::move(peer));
}

void add_compare_flag(CLI::App* cmd, std::string* compare, const std::string& what,
                      const std::string& llama_tools, const std::string& same) {
  cmd->add_option(
         "--compare", *compare,
         absl::StrCat("torch: also run ", what,
                      " in PyTorch eager (Debian python3-torch, f32, every hardware "
                      "thread); llama.cpp: in llama.cpp's ",
                      llama_tools, " (the checkpoint exported as GGUF, the same threads and ", same,
                      ", its CPU variant matching --kernel-isa; built by "
                      "scripts/install_deps.sh --bench); prints both and their ratio"))
      ->check(CLI::IsMember({"torch", "llama.cpp"}));
}

void add_llamacpp_figures(const LlamaCppPeer& peer, double theirs, double ours,
                          nlohmann::json* out) {
  (*out)["llamacpp_tokens_per_s"] = theirs;
  (*out)["over_llamacpp"] = ours / theirs;
  (*out)["llamacpp_cpu_variant"] = peer.cpu_variant();
}

void print_llamacpp_line(const LlamaCppPeer* peer, int threads, const nlohmann::json& out) {
  if (peer == nullptr) return;
  const std::string features = ggml_variant_features(peer->cpu_variant());
  std::printf(
      "  llama.cpp (ggml CPU variant %s%s, %d threads): %.1f tokens/s; simpler / "
      "llama.cpp = %.2f\n",
      peer->cpu_variant().c_str(), features.empty() ? "" : (": " + features).c_str(), threads,
      out["llamacpp_tokens_per_s"].get<double>(), out["over_llamacpp"].get<double>());
}

}  // namespace simpler::cli
