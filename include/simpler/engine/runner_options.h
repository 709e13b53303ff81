// RunnerOptions: how the engine's model runner (one run of the step program per step) is set
// up: the Worker, the KV pool, the per-step limits, where sampling runs and the kernels' ISA
// target and precision. Part of EngineOptions (llm_engine.h); plain value.
#pragma once

#include <cstdint>

#include "simpler/kernels/kernels.h"
#include "simpler/worker/worker.h"

namespace simpler::llm {

struct RunnerOptions {
  // Device, cores, launch depth, grant, timeout, trace. A runner on an L3 child uses only
  // launch_depth (its steps in flight); the child's worker options are the L3 worker's.
  worker::WorkerOptions worker;
  int32_t page_size = 16;                // tokens per KV page (> 0)
  int32_t num_pages = 0;                 // pages in the KV pool (> 0)
  int32_t max_num_seqs = 64;             // state slots = most logit rows per step (> 0)
  int32_t max_num_batched_tokens = 512;  // most rows (positions) per step (>= max_num_seqs)
  // Sample on the host from logits read back every step (the same math as on the device; the
  // next step needs those tokens first, so steps run one at a time).
  bool host_sampling = false;
  // create() refuses a checkpoint holding a tensor the config does not use
  // unless this is set (checkpoints with extra heads).
  bool allow_unused_tensors = false;
  // The matmul inner loops (kernels.h): kAuto picks AVX-512 where the CPU has it; kAvx512 on a
  // CPU without it is refused by create() (FAILED_PRECONDITION). Results are the same either way.
  KernelIsa kernel_isa = KernelIsa::kAuto;
  // kernels.h Precision (kInt8, the default: int8 activations over quantized weights, exact over
  // the others). kBf16 on a CPU without AVX512_BF16 falls back to kExact: create() logs it and
  // options().precision says which ran.
  Precision precision = Precision::kInt8;
  // Capture the step program once per step shape and replay it (task::CallConfig::capture_key;
  // docs/design/capture_replay.md): one key per distinct list of the step's argument shapes,
  // with the block tables' width rounded up to a power of two, and the positions and sampled
  // rows padded to a bucket (the next power of two: 1, 2, 4, ..., 32, ..., at most
  // max_num_batched_tokens or max_num_seqs) as vLLM pads CUDA graphs: a padded row writes no KV
  // slot, touches no request's sampling state and is not reported, so decode batches of 1 to 32
  // rows need at most 6 graphs (per block-table width). Steps that commit token counts (a
  // request's first step, or its recompute after preemption) run uncaptured. Tokens are the same
  // either way. The graphs kept: worker.max_captured_graphs. Only a runner with its own Worker
  // captures: Qwen3DataParallel (runners on L3 children, whose capture keys do not cross the L3
  // mailbox) turns it off with one log line saying why, and runs every step uncaptured.
  bool capture = false;
};

}  // namespace simpler::llm
