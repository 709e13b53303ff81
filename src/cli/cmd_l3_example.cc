// `simpler l3-example`: the example L3 program — a tensor-parallel MLP across --chips sim chips
// whose partial results a host sub-task sums (hierarchy/tp_mlp.h) — in thread or process mode,
// each run checked against a float64 reference.
#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"
#include "simpler/base/log.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/hierarchy/tp_mlp.h"

namespace simpler::cli {

Runner add_l3_example_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "l3-example",
      "a tensor-parallel MLP across --chips sim chips with a host sub-task summing the partial "
      "results (an L3 program), checked against a float64 reference");
  struct State {
    std::string mode = "process";
    int runs = 3;
    int64_t batch = 8, hidden = 64, intermediate = 256;
    int chips = 2;
    CommonOptions common;
  };
  auto st = std::make_shared<State>();
  cmd->add_option("--child-mode", st->mode, "thread or process")
      ->check(CLI::IsMember({"thread", "process"}))
      ->capture_default_str();
  cmd->add_option("--chips", st->chips, "child chips")->check(int_in(1, 16))->capture_default_str();
  cmd->add_option("--runs", st->runs, "L3 runs, each on fresh inputs")
      ->check(int_in(1, kMaxRepeats))
      ->capture_default_str();
  cmd->add_option("--batch", st->batch, "rows of x")->check(int_in(1, 4096))->capture_default_str();
  cmd->add_option("--hidden", st->hidden, "model width")
      ->check(int_in(1, 4096))
      ->capture_default_str();
  cmd->add_option("--intermediate", st->intermediate, "MLP width (a multiple of --chips)")
      ->check(int_in(1, 16384))
      ->capture_default_str();
  st->common.add_to(cmd);
  // The runs execute on the child chips (in other processes in process mode): nothing to trace
  // here, so the flag is not offered rather than accepted and ignored.
  cmd->remove_option(cmd->get_option("--trace"));
  return [cmd, st]() -> int {
    if (!cmd->parsed()) return -1;
    if (st->intermediate % st->chips != 0) {
      return fail("l3-example",
                  absl::InvalidArgumentError(absl::StrCat(
                      "--intermediate ", st->intermediate, " is not a multiple of --chips ",
                      st->chips, " (each chip takes an equal share of the MLP's columns)")));
    }
    hierarchy::L3Options o;
    o.device_ids.clear();
    for (int c = 0; c < st->chips; ++c) o.device_ids.push_back(c);
    o.child_mode = *hierarchy::parse_child_mode(st->mode);
    o.child = st->common.worker_options(nullptr);
    const uint64_t floats =
        st->batch * st->hidden * (st->chips + 2) + 2 * st->hidden * st->intermediate;
    o.host_heap_bytes = floats * 4 + (1 << 20);
    hierarchy::L3Worker w(o);
    absl::StatusOr<std::unique_ptr<hierarchy::TpMlp>> mlp = hierarchy::TpMlp::register_on(
        w, hierarchy::TpMlpShape{st->batch, st->hidden, st->intermediate});
    if (!mlp.ok()) return fail("l3-example", mlp.status());
    if (absl::Status s = w.init(); !s.ok()) return fail("l3-example", s);
    std::string children;
    for (const std::string& c : w.describe_children()) {
      absl::StrAppend(&children, children.empty() ? "" : ", ", c);
    }
    SIMPLER_LOG_INFO("l3-example: children: {}", children);
    std::fprintf(stderr, "l3-example: children: %s\n", children.c_str());
    if (absl::Status s = (*mlp)->allocate(); !s.ok()) return fail("l3-example", s);
    nlohmann::json rows = nlohmann::json::array();
    bool all = true;
    double checksum = 0;
    for (int r = 0; r < st->runs; ++r) {
      absl::StatusOr<std::vector<double>> ref = (*mlp)->fill(static_cast<uint32_t>(r + 1));
      if (!ref.ok()) return fail("l3-example", ref.status());
      const int64_t t0 = base::now_ns();
      absl::Status s = w.run((*mlp)->program(), {});
      const double ms = (base::now_ns() - t0) / 1e6;
      if (!s.ok()) {
        (void)w.close();
        return fail("l3-example", s);
      }
      double err = 0, scale = 0;
      for (size_t i = 0; i < ref->size(); ++i) {
        err = std::max(err, std::abs((*mlp)->y()[i] - (*ref)[i]));
        scale = std::max(scale, std::abs((*ref)[i]));
        checksum += std::abs(static_cast<double>((*mlp)->y()[i]));
      }
      // f32 accumulation over `hidden` then `intermediate` terms, against a float64 reference.
      const double tolerance = 1e-6 * (1 + scale) * static_cast<double>(st->hidden);
      const bool ok = err <= tolerance;
      all = all && ok;
      if (st->common.json) {
        rows.push_back({{"run", r},
                        {"max_abs_error", err},
                        {"tolerance", tolerance},
                        {"passed", ok},
                        {"ms", ms}});
      } else {
        std::printf("run %d: max_abs_error %.3e (tolerance %.1e) %s  %.2f ms\n", r, err, tolerance,
                    ok ? "ok" : "FAILED", ms);
      }
    }
    absl::Status closed = w.close();
    if (!closed.ok()) return fail("l3-example", closed);
    if (st->common.json) {
      std::printf("%s\n", base::dump_replacing(nlohmann::json{{"child_mode", st->mode},
                                                              {"chips", st->chips},
                                                              {"runs", rows},
                                                              {"passed", all},
                                                              {"y_abs_sum", checksum}})
                              .c_str());
    } else {
      std::printf("%s: %d runs across %d chips (%s mode), y abs-sum %.9g\n",
                  all ? "passed" : "FAILED", st->runs, st->chips, st->mode.c_str(), checksum);
    }
    return all ? 0 : 1;
  };
}

}  // namespace simpler::cli
