// `simpler export-gguf`: a model directory as one GGUF file for llama.cpp (the benchmarks' peer).
#include <atomic>
#include <csignal>
#include <iostream>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "simpler/base/clock.h"
#include "simpler/model/gguf_export.h"

namespace simpler::cli {
namespace {

// SIGINT / SIGTERM during an export: the export stops before its next tensor or chunk and removes
// its temporary file (GgufExportOptions::cancel), then the process dies by the signal, as the
// shell expects of an interrupted command; a second signal takes its default action at once.
static_assert(std::atomic<bool>::is_always_lock_free);  // set from a signal handler
std::atomic<bool> g_interrupted{false};
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_export_signal(int sig) {
  g_signal = sig;
  g_interrupted.store(true);
}

void cancel_export_on_signals() {
  struct sigaction sa = {};
  sa.sa_handler = on_export_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_RESTART;  // the second one is not caught; writes go on
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace

Runner add_export_gguf_command(CLI::App& app) {
  struct State {
    std::string model;
    std::string out;
    std::string type = "bf16";
  };
  auto st = std::make_shared<State>();
  auto* cmd =
      add_model_command(&app, "export-gguf",
                        "write a model directory as a GGUF file that llama.cpp loads "
                        "(Qwen3 metadata, tokenizer and tensors under llama.cpp's names)",
                        &st->model, "model directory (Hugging Face layout)", ModelSource::kDirOnly);
  cmd->add_option("--out", st->out,
                  "the GGUF file to write: written to a temporary file beside it (OUT.tmp.*) and "
                  "renamed to OUT when complete (a file already at OUT is replaced then, and kept "
                  "on an error or Ctrl-C, which remove the temporary file); refused inside the "
                  "model directory unless named *.gguf, and for any file the model directory "
                  "holds or links to")
      ->required();
  cmd->add_option(
         "--type", st->type,
         "type of the 2-D tensors: bf16 (a bf16 checkpoint's bits as they are), f32, or "
         "q8_0, q4_0 or q4_k_m (llama.cpp's reference quantizers; norms stay f32; matrices "
         "whose rows are not whole 32-value blocks stay f16, as llama.cpp's converter writes "
         "them; a "
         "q4_0 file's LM head is q6_k, or q8_0 for rows that are not whole 256-blocks; q4_k_m "
         "is llama-quantize's Q4_K/Q6_K mix)")
      ->check(CLI::IsMember({"bf16", "f32", "q8_0", "q4_0", "q4_k_m"}))
      ->capture_default_str();
  return [cmd, st]() -> int {
    if (!cmd->parsed()) return -1;
    llm::GgufExportOptions o;
    o.model_dir = st->model;
    o.out_path = st->out;
    o.type = st->type == "f32"      ? llm::GgufType::kF32
             : st->type == "q8_0"   ? llm::GgufType::kQ8_0
             : st->type == "q4_0"   ? llm::GgufType::kQ4_0
             : st->type == "q4_k_m" ? llm::GgufType::kQ4_K_M
                                    : llm::GgufType::kBf16;
    o.cancel = &g_interrupted;
    o.progress = [](int64_t done, int64_t all) {
      if (done == 1 || done == all || done % 50 == 0) {
        std::cerr << "simpler export-gguf: " << done << " of " << all << " tensors\n";
      }
    };
    const int64_t t0 = base::now_ns();
    cancel_export_on_signals();
    if (absl::Status s = llm::export_gguf(o); !s.ok()) {
      const int code = fail("export-gguf", s);
      if (absl::IsCancelled(s) && g_signal != 0) std::raise(g_signal);  // its default action now
      return code;
    }
    std::cerr << "simpler export-gguf: wrote " << st->out << " (" << st->type << ") in "
              << (base::now_ns() - t0) / 1e9 << " s\n";
    return 0;
  };
}

}  // namespace simpler::cli
