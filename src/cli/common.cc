#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "nlohmann/json.hpp"
#include "simpler/base/json.h"
#include "simpler/model/gguf.h"
#include "simpler/worker/worker_stats.h"

namespace simpler::cli {

CLI::Validator int_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        if (!absl::SimpleAtoi(text, &v)) {
          return absl::StrCat("'", text.substr(0, 40), "' is not an integer in [", lo, ", ", hi,
                              "]");
        }
        if (v < lo) return absl::StrCat(v, " is below the minimum of ", lo);
        if (v > hi) return absl::StrCat(v, " is above the maximum of ", hi);
        return std::string();
      },
      absl::StrCat("INT in [", lo, ", ", hi, "]"));
}

CLI::Validator uint64_in() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        // SimpleAtoi takes a leading '-' for unsigned types too ("-1" would wrap around).
        if (text.find('-') != std::string::npos || !absl::SimpleAtoi(text, &v)) {
          return absl::StrCat("'", text.substr(0, 40), "' is not an integer in [0, ",
                              std::numeric_limits<uint64_t>::max(), "]");
        }
        return std::string();
      },
      absl::StrCat("INT in [0, ", std::numeric_limits<uint64_t>::max(), "]"));
}

CLI::Validator number_in(double lo, double hi, bool lo_open) {
  return CLI::Validator(
      [lo, hi, lo_open](std::string& text) -> std::string {
        double v = 0;
        if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) {
          return absl::StrCat("'", text.substr(0, 40), "' is not a finite number in ",
                              lo_open ? "(" : "[", lo, ", ", hi, "]");
        }
        if (lo_open ? !(v > lo) : !(v >= lo)) {
          return absl::StrCat(text, " is ", lo_open ? "not above " : "below ", "the minimum of ",
                              lo);
        }
        if (v > hi) return absl::StrCat(text, " is above the maximum of ", hi);
        return std::string();
      },
      absl::StrCat("NUMBER in ", lo_open ? "(" : "[", lo, ", ", hi, "]"));
}

CLI::App* add_model_command(CLI::App* parent, const std::string& name, const std::string& help,
                            std::string* model, const std::string& model_help, ModelSource source) {
  CLI::App* cmd = parent->add_subcommand(name, help);
  // Checked before anything loads, so a mistyped path is named whole rather than as the first
  // file a loader looks for inside it ("DIR/config.json: no such file").
  const bool gguf = source == ModelSource::kDirOrGguf;
  const CLI::Validator model_path(
      [gguf, name](std::string& path) -> std::string {
        std::error_code ec;
        if (std::filesystem::is_directory(path, ec)) return std::string();
        if (!gguf && std::filesystem::exists(path, ec)) {
          return path + " is not a model directory (" + name +
                 " reads a Hugging Face model directory: config.json, *.safetensors, "
                 "tokenizer.json" +
                 (llm::is_gguf_path(path) ? "; this is a GGUF file already)" : ")");
        }
        if (gguf && llm::is_gguf_path(path)) {
          if (std::filesystem::exists(path, ec)) return std::string();
          return path + ": no such .gguf file";
        }
        if (std::filesystem::exists(path, ec)) {
          return path +
                 " is neither a model directory nor a GGUF file (its first bytes are "
                 "not GGUF's magic)";
        }
        return path + ": no such model directory";
      },
      gguf ? "DIR|FILE.gguf" : "DIR");
  cmd->add_option("--model", *model, model_help)->required()->check(model_path);
  return cmd;
}

void CommonOptions::add_to(CLI::App* app, bool with_json) {
  app->add_option("--cores", cores, "sim device cores (0 = one per hardware thread)")
      ->check(int_in(0, kMaxCores))
      ->capture_default_str();
  app->add_option("--launch-depth", launch_depth, "runs launched on the device at once")
      ->check(int_in(1, worker::kMaxRunGrant))
      ->capture_default_str();
  app->add_option("--run-grant", run_grant,
                  "run resource sets (0 = launch depth + 1; must be >= launch depth)")
      ->check(int_in(0, worker::kMaxRunGrant))
      ->capture_default_str();
  // The pair, once both are parsed: a grant below the depth would fail only when the worker
  // starts (after a model loaded), naming WorkerOptions rather than the flags.
  app->parse_complete_callback([this] {
    if (run_grant != 0 && run_grant < launch_depth) {
      throw CLI::ValidationError("--run-grant",
                                 absl::StrCat(run_grant, " is below --launch-depth ", launch_depth,
                                              " (each run launched at once holds a resource set)"));
    }
  });
  app->add_option("--timeout", timeout_s, "operation timeout per run, seconds")
      ->check(number_in(0, kMaxTimeoutS, /*lo_open=*/true))
      ->capture_default_str();
  app->add_option("--graph-placement", placement,
                  "where task graphs are built: device (orchestration on the device) or host "
                  "(built during prepare, executed from a graph image)")
      ->check(CLI::IsMember({"device", "host"}))
      ->capture_default_str();
  app->add_option("--trace", trace_path, "write a Chrome/Perfetto trace JSON to this file")
      ->check(CLI::Validator(
          [](std::string& path) -> std::string {
            // Checked before the command's work, which may take long, rather than at its end.
            std::error_code ec;
            if (std::filesystem::is_directory(path, ec))
              return path + " is a directory, not a file";
            const std::filesystem::path folder = std::filesystem::path(path).parent_path();
            if (!folder.empty() && !std::filesystem::is_directory(folder, ec)) {
              return path + ": there is no directory " + folder.string();
            }
            return std::string();
          },
          "FILE"));
  if (with_json) {
    app->add_flag("--json", json,
                  "print JSON on stdout: one object per line (benchmarks: one per result row)");
  }
}

// The non-auto targets this binary holds (kernels.h, KernelIsa), for --kernel-isa's help.
#if defined(__x86_64__)
constexpr char kBuiltTargets[] = "avx512, x86-64-v3 or portable";
#elif defined(__aarch64__)
constexpr char kBuiltTargets[] = "neon or portable";
#else
constexpr char kBuiltTargets[] = "portable";
#endif

void CommonOptions::add_kernel_isa_to(CLI::App* app) {
  app->add_option("--kernel-isa", kernel_isa_name,
                  "the hot kernels' ISA target: auto (the best this CPU has: " +
                      std::string(llm::name_of(llm::resolve_kernel_isa(llm::KernelIsa::kAuto))) +
                      "), " + std::string(kBuiltTargets) + "; matmul results are bitwise the same" +
                      (llm::kernel_isa_fused(llm::KernelIsa::kPortable)
                           ? ""
                           : " (but portable's here: it multiplies, then adds, without an FMA "
                             "instruction)"))
      ->check(CLI::Validator(
          [](std::string& name) -> std::string {
            absl::StatusOr<llm::KernelIsa> isa = llm::parse_kernel_isa(name);
            if (!isa.ok()) return std::string(isa.status().message());
            if (llm::kernel_isa_available(*isa)) return std::string();
            return "kernel ISA '" + name + "' needs " + llm::kernel_isa_requirements(*isa) +
                   ", which this CPU lacks (it has " + llm::available_kernel_isas() + ")";
          },
          "ISA"))
      ->capture_default_str();
  app->add_option("--precision", precision_name,
                  "matmul numerics: int8 (the default: over q8_0/q4_0/q4_k/q6_k weights, "
                  "activations quantized per block to int8 and dotted in integers, as llama.cpp; "
                  "other weights exact), exact (f32 "
                  "activations over every weight type) or bf16 "
                  "(activations rounded to bf16 over bf16 weights, AVX-512 BF16; faster, with its "
                  "own tolerance; other weights, quantized ones too, exact; falls back to exact "
                  "where the CPU lacks it)")
      ->check(CLI::IsMember({"int8", "exact", "bf16"}))
      ->capture_default_str();
}

llm::Precision CommonOptions::precision() const {
  return llm::parse_precision(precision_name).value_or(llm::Precision::kInt8);
}

llm::KernelIsa CommonOptions::kernel_isa() const {
  return llm::parse_kernel_isa(kernel_isa_name).value_or(llm::KernelIsa::kAuto);
}

worker::WorkerOptions CommonOptions::worker_options(base::TraceRecorder* trace) const {
  worker::WorkerOptions o;
  o.num_cores = cores;
  o.launch_depth = launch_depth;
  o.run_grant = run_grant;
  o.operation_timeout_s = timeout_s;
  o.trace = trace_path.empty() ? nullptr : trace;
  o.placement = placement == "host" ? task::GraphPlacement::kHost : task::GraphPlacement::kDevice;
  return o;
}

void print_json_line(const nlohmann::json& j) {
  std::printf("%s\n", base::dump_replacing(j).c_str());
}

bool write_trace(const base::TraceRecorder& trace, const std::string& path) {
  if (path.empty()) return true;
  absl::Status s = trace.write(path);
  if (!s.ok()) {
    std::cerr << "simpler: " << s.message() << "\n";
    return false;
  }
  std::cerr << "simpler: wrote trace with " << trace.size() << " spans to " << path << "\n";
  return true;
}

int fail(const std::string& cmd, const absl::Status& error) {
  std::cerr << "simpler " << cmd << ": " << error.message() << "\n";
  return 1;
}

int fail_with_trace(const std::string& cmd, const absl::Status& error,
                    const base::TraceRecorder& trace, const std::string& path) {
  (void)write_trace(trace, path);  // a failure to write is reported on its own line
  return fail(cmd, error);
}

}  // namespace simpler::cli
