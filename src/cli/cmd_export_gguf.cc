// `simpler export-gguf`: a model directory as one GGUF file for llama.cpp (the benchmarks' peer).
#include <iostream>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "simpler/base/clock.h"
#include "simpler/model/gguf_export.h"

namespace simpler::cli {

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
  cmd->add_option("--out", st->out, "the GGUF file to write")->required();
  cmd->add_option(
         "--type", st->type,
         "type of the 2-D tensors: bf16 (a bf16 checkpoint's bits as they are), f32, or "
         "q8_0, q4_0 or q4_k_m (llama.cpp's reference quantizers; norms stay f32, a "
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
    o.progress = [](int64_t done, int64_t all) {
      if (done == all || done % 50 == 0) {
        std::cerr << "simpler export-gguf: " << done << " of " << all << " tensors\n";
      }
    };
    const int64_t t0 = base::now_ns();
    if (absl::Status s = llm::export_gguf(o); !s.ok()) return fail("export-gguf", s);
    std::cerr << "simpler export-gguf: wrote " << st->out << " (" << st->type << ") in "
              << (base::now_ns() - t0) / 1e9 << " s\n";
    return 0;
  };
}

}  // namespace simpler::cli
