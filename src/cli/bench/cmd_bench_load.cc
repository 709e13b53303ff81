// `simpler bench load`: checkpoint load time against reading the files, and the peak resident
// memory.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_probes.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/engine/model_files.h"
#include "simpler/model/safetensors.h"

namespace simpler::cli {

namespace {

constexpr const char* kBenchLoadCommand = "bench load";

struct LoadFlags {
  std::string model;
  EngineFlags engine;
};

// Reading `files` (into one reused 64 MiB buffer), best of 3 passes, seconds; the first pass also
// puts them in the page cache, so the figure is of cached files.
double best_read_s(const std::vector<std::string>& files) {
  std::vector<char> buf(64 << 20);
  double read_s = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    const int64_t t0 = base::now_ns();
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
      }
    }
    read_s = std::min(read_s, (base::now_ns() - t0) / 1e9);
  }
  return read_s;
}

int run_bench_load(const LoadFlags& st) {
  const CommonOptions& common = st.engine.common;
  base::TraceRecorder trace;
  const std::vector<std::string> files = llm::model_checkpoint_files(st.model);
  const uint64_t checkpoint_bytes = files_bytes(files);
  if (files.empty()) {
    return fail(kBenchLoadCommand,
                absl::NotFoundError(absl::StrCat("no .safetensors file in ", st.model)));
  }
  const double read_s = best_read_s(files);
  // Loading: the engine created (weights in device memory, scratch and a small KV pool), best
  // of 3.
  EngineFlags load_flags = st.engine;
  load_flags.max_num_seqs = 1;
  load_flags.max_num_batched_tokens = 16;
  load_flags.num_pages = 16;
  absl::StatusOr<llm::EngineOptions> eo = engine_options(load_flags, {}, &trace);
  if (!eo.ok()) return fail(kBenchLoadCommand, eo.status());
  double load_s = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    const int64_t t0 = base::now_ns();
    auto engine = llm::LlmEngine::create(st.model, *eo);
    const double s = (base::now_ns() - t0) / 1e9;
    if (!engine.ok())
      return fail_with_trace(kBenchLoadCommand, engine.status(), trace, common.trace_path);
    load_s = std::min(load_s, s);
    (void)(*engine)->shutdown(base::Deadline::poll());
  }
  const uint64_t hwm = peak_resident_bytes();
  absl::StatusOr<llm::ModelWeights> weights = llm::ModelWeights::open(st.model);
  if (!weights.ok()) return fail(kBenchLoadCommand, weights.status());
  const std::map<std::string, int64_t> types = weights->dtype_counts();
  nlohmann::json out = {
      {"model", st.model},    {"checkpoint_bytes", checkpoint_bytes}, {"load_s", load_s},
      {"read_s", read_s},     {"load_over_read", load_s / read_s},    {"vm_hwm_bytes", hwm},
      {"weight_types", types}};
  if (common.json) {
    print_json_line(out);
  } else {
    std::string mix;
    for (const auto& [name, count] : types) {
      absl::StrAppend(&mix, mix.empty() ? "" : ", ", count, " ", name);
    }
    std::printf(
        "load: %.1f MB checkpoint (%s tensors) loaded in %.3f s = %.2fx the %.3f s it takes to "
        "read the files (page cache warm, best of 3); peak resident %.1f MB = %.2fx the "
        "checkpoint\n",
        checkpoint_bytes / 1e6, mix.c_str(), load_s, load_s / read_s, read_s, hwm / 1e6,
        static_cast<double>(hwm) / checkpoint_bytes);
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_load_command(CLI::App* bench) {
  auto st = std::make_shared<LoadFlags>();
  auto* cmd = add_model_command(
      bench, "load", "checkpoint load time against reading the files; peak resident memory",
      &st->model);
  add_engine_flags(cmd, &st->engine, {.allow_unused_tensors = true, .kernel_isa = false});
  return run_if_parsed(cmd, st, run_bench_load);
}

}  // namespace simpler::cli
