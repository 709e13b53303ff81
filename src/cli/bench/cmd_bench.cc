// `simpler bench dispatch|pipeline|decode|prefill|load|throughput|serve|mailbox`.
#include <cstdio>
#include <iostream>

#include "cli/bench/bench_runtime.h"
#include "cli/bench/bench_starpu.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "simpler/base/json.h"
#include "simpler/base/thread.h"
#include "simpler/worker/run_resource_arena.h"

namespace simpler::cli {

int run_bench_decode(const std::string& model, const EngineFlags& flags, int steps,
                     const std::vector<int>& batches, const std::string& compare);
int run_bench_load(const std::string& model, const EngineFlags& flags);
int run_bench_prefill(const std::string& model, const EngineFlags& flags,
                      const std::vector<int>& prompt_lens, const std::string& compare);
// Registers `bench throughput` (cmd_bench_throughput.cc); its runner returns -1 unless parsed.
Runner add_bench_throughput_command(CLI::App* bench);
Runner add_bench_serve_command(CLI::App* bench);
Runner add_bench_mailbox_command(CLI::App* bench);

Runner add_bench_commands(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "benchmarks; each prints its numbers");
  bench->require_subcommand(1);

  struct State {
    CommonOptions dispatch_common, pipeline_common;
    EngineFlags decode_engine, prefill_engine, load_engine;
    std::vector<int> prompt_lens{128, 512};
    std::string compare, dispatch_compare;
    int64_t tasks = 100000;
    std::vector<int> depths{1, 2, 4};
    double device_us = 1000;
    std::vector<double> host_ratios{0.25, 1, 4};
    std::string pin = "auto";
    int runs = 200;
    std::string model;
    int steps = 32;
    std::vector<int> batches{1};
  };
  auto st = std::make_shared<State>();

  auto* dispatch = bench->add_subcommand("dispatch", "ns per task for empty kernels");
  dispatch->add_option("--tasks", st->tasks, "tasks per pattern")->check(int_in(1, kMaxTasks));
  dispatch
      ->add_option("--compare", st->dispatch_compare,
                   "starpu: run the same patterns on StarPU (Debian libstarpu-dev) after the sim "
                   "device closed, with the same CPU count, and print both")
      ->check(CLI::IsMember({"starpu"}));
  st->dispatch_common.add_to(dispatch);

  auto* pipeline = bench->add_subcommand("pipeline", "early enqueue: depth vs host/device time");
  auto* depths_opt = pipeline->add_option("--depths", st->depths, "launch depths, one row each")
                         ->delimiter(',')
                         ->check(int_in(1, worker::kMaxRunGrant));
  pipeline->add_option("--device-us", st->device_us, "device time D per run, µs")
      ->check(number_in(0, kMaxDeviceUs, /*lo_open=*/true));
  pipeline->add_option("--host-ratios", st->host_ratios, "host prepare time H as multiples of D")
      ->delimiter(',')
      ->check(number_in(0, 1000));
  pipeline
      ->add_option("--pin", st->pin,
                   "auto: device threads on the last allowed CPU, host threads on the others "
                   "(host and device each get their own cores); off: no pinning")
      ->check(CLI::IsMember({"auto", "off"}));
  pipeline->add_option("--runs", st->runs, "runs per row")->check(int_in(2, kMaxRepeats));
  st->pipeline_common.add_to(pipeline);
  // --launch-depth D is --depths D; --cores defaults to 1 here (one task on one core).
  pipeline->get_option("--launch-depth")->excludes(depths_opt);

  auto* decode = bench->add_subcommand("decode", "decode step time and weight bandwidth");
  decode->add_option("--model", st->model, "model directory")->required();
  // The first step feeds the prompt; the timed decode phase is the steps after it.
  decode
      ->add_option("--steps", st->steps, "steps to run (>= 2; the steps after the first are timed)")
      ->check(int_in(2, kMaxRepeats));
  decode->add_option("--batch", st->batches, "requests per step; a comma list runs one row each")
      ->delimiter(',')
      ->check(int_in(1, kMaxRequests));
  decode
      ->add_option("--compare", st->compare,
                   "torch: also run the checkpoint in PyTorch eager (Debian python3-torch, f32, "
                   "every hardware thread); llama.cpp: in llama.cpp (llama-bench / "
                   "llama-batched-bench on the checkpoint exported as GGUF, the same threads, "
                   "batch and steps, its CPU variant matching --kernel-isa; built by "
                   "scripts/install_deps.sh --bench); prints both and their ratio")
      ->check(CLI::IsMember({"torch", "llama.cpp"}));
  add_engine_flags(decode, &st->decode_engine, {.allow_unused_tensors = true});

  auto* prefill = bench->add_subcommand(
      "prefill", "time to first token of long prompts, against the measured f32 FMA peak");
  prefill->add_option("--model", st->model, "model directory")->required();
  prefill->add_option("--prompt-lens", st->prompt_lens, "prompt lengths in tokens, one row each")
      ->delimiter(',')
      ->check(int_in(1, 1 << 16));
  prefill
      ->add_option("--compare", st->compare,
                   "torch: also run the prompts in PyTorch eager (Debian python3-torch, f32, "
                   "every hardware thread); llama.cpp: in llama.cpp's llama-bench (the checkpoint "
                   "exported as GGUF, the same threads and prompt length, its CPU variant "
                   "matching --kernel-isa; scripts/install_deps.sh --bench); prints both")
      ->check(CLI::IsMember({"torch", "llama.cpp"}));
  add_engine_flags(prefill, &st->prefill_engine, {.allow_unused_tensors = true});

  auto* load = bench->add_subcommand(
      "load", "checkpoint load time against reading the files; peak resident memory");
  load->add_option("--model", st->model, "model directory")->required();
  add_engine_flags(load, &st->load_engine, {.allow_unused_tensors = true, .kernel_isa = false});

  Runner throughput = add_bench_throughput_command(bench);
  Runner mailbox = add_bench_mailbox_command(bench);
  Runner serve = add_bench_serve_command(bench);

  return [=]() -> int {
    if (!bench->parsed()) return -1;
    if (dispatch->parsed()) {
      base::TraceRecorder trace;
      auto rows = bench_dispatch(st->dispatch_common.worker_options(&trace), st->tasks);
      if (!rows.ok()) {
        return fail_with_trace("bench dispatch", rows.status(), trace,
                               st->dispatch_common.trace_path);
      }
      std::vector<DispatchRow> starpu_rows;
      int ncpu = st->dispatch_common.cores;
      if (ncpu == 0) ncpu = base::hardware_threads();
      if (st->dispatch_compare == "starpu") {
        auto peer = bench_dispatch_starpu(ncpu, st->tasks);
        if (!peer.ok()) return fail("bench dispatch", peer.status());
        starpu_rows = std::move(*peer);
      }
      if (st->dispatch_common.json) {
        nlohmann::json out = nlohmann::json::array();
        for (size_t i = 0; i < rows->size(); ++i) {
          nlohmann::json j = to_json((*rows)[i]);
          if (i < starpu_rows.size()) {
            j["starpu_ns_per_task"] = starpu_rows[i].ns_per_task;
            j["starpu_over_simpler"] = starpu_rows[i].ns_per_task / (*rows)[i].ns_per_task;
          }
          out.push_back(j);
        }
        std::printf("%s\n", base::dump_replacing(nlohmann::json{{"dispatch", out}}).c_str());
      } else {
        std::printf("%-12s %10s %12s %10s", "pattern", "tasks", "ns/task", "wall ms");
        if (!starpu_rows.empty()) std::printf(" %16s %8s", "StarPU ns/task", "ratio");
        std::printf("\n");
        for (size_t i = 0; i < rows->size(); ++i) {
          const auto& r = (*rows)[i];
          std::printf("%-12s %10lld %12.1f %10.1f", r.pattern.c_str(),
                      static_cast<long long>(r.tasks), r.ns_per_task, r.wall_ms);
          if (i < starpu_rows.size()) {
            std::printf(" %16.1f %7.1fx", starpu_rows[i].ns_per_task,
                        starpu_rows[i].ns_per_task / r.ns_per_task);
          }
          std::printf("\n");
        }
        if (!starpu_rows.empty()) {
          std::printf(
              "StarPU %s: %d CPU workers, STARPU_SCHED=eager, inferred (STARPU_RW) "
              "dependencies; ratio = StarPU ns / simpler ns\n",
              starpu_version().c_str(), ncpu);
        }
      }
      return write_trace(trace, st->dispatch_common.trace_path) ? 0 : 1;
    }
    if (pipeline->parsed()) {
      base::TraceRecorder trace;
      const double d = st->device_us;
      std::vector<double> host_us;
      for (double r : st->host_ratios) host_us.push_back(r * d);
      worker::WorkerOptions options = st->pipeline_common.worker_options(&trace);
      if (pipeline->get_option("--cores")->count() == 0) options.num_cores = 1;
      std::vector<int> depths = st->depths;
      if (pipeline->get_option("--launch-depth")->count() > 0) {
        depths = {st->pipeline_common.launch_depth};
      }
      auto rows = bench_pipeline(options, depths, d, host_us, st->runs,
                                 st->pin == "auto" ? PinMode::kAuto : PinMode::kOff);
      if (!rows.ok()) {
        return fail_with_trace("bench pipeline", rows.status(), trace,
                               st->pipeline_common.trace_path);
      }
      if (st->pipeline_common.json) {
        for (const auto& r : *rows) std::printf("%s\n", base::dump_replacing(to_json(r)).c_str());
      } else {
        if (!rows->empty()) {
          std::printf("host and device threads %s\n",
                      rows->front().pinned ? "pinned to disjoint CPUs" : "not pinned");
        }
        std::printf("%5s %8s %8s %10s %8s %10s %10s %12s %8s %6s\n", "depth", "H us", "D us",
                    "runs/s", "busy", "gap p50", "gap p99", "host cpu us", "gap>20", "late");
        for (const auto& r : *rows) {
          std::printf("%5d %8.0f %8.0f %10.1f %7.1f%% %10.2f %10.2f %12.1f %8d %6d\n", r.depth,
                      r.host_us, r.device_us, r.runs_per_s, 100 * r.device_busy, r.gap_us_p50,
                      r.gap_us_p99, r.host_cpu_us_per_run, r.gaps_over_20us, r.late_launches);
        }
        std::printf(
            "gap>20: gaps over 20 µs; late: runs the host launched after the previous "
            "run's last task ended (of %d gaps per row)\n",
            rows->empty() ? 0 : rows->front().runs - 1);
      }
      return write_trace(trace, st->pipeline_common.trace_path) ? 0 : 1;
    }
    if (decode->parsed())
      return run_bench_decode(st->model, st->decode_engine, st->steps, st->batches, st->compare);
    if (load->parsed()) {
      return run_bench_load(st->model, st->load_engine);
    }
    if (prefill->parsed()) {
      return run_bench_prefill(st->model, st->prefill_engine, st->prompt_lens, st->compare);
    }
    if (int rc = throughput(); rc != -1) return rc;
    if (int rc = serve(); rc != -1) return rc;
    if (int rc = mailbox(); rc != -1) return rc;
    return 0;
  };
}

}  // namespace simpler::cli
