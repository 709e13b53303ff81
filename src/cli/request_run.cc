#include "cli/request_run.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <memory>
#include <mutex>

#include "simpler/base/clock.h"

namespace simpler::cli {

RequestRun run_requests(const std::vector<llm::LlmEngine*>& engines,
                        std::vector<llm::RequestSpec> specs, const char* command, bool progress) {
  RequestRun run;
  run.results.resize(specs.size());
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int64_t open = 0;
    int64_t tokens = 0;
  };
  auto shared = std::make_shared<Shared>();
  run.start_ns = base::now_ns();
  for (size_t r = 0; r < specs.size(); ++r) {
    run.results[r].resize(specs[r].n);
    std::vector<ChoiceResult>* choices = &run.results[r];
    specs[r].on_output = [shared, choices](const llm::RequestOutput& out) {
      std::lock_guard<std::mutex> l(shared->mu);
      ChoiceResult& c = (*choices)[out.index];
      c.tokens.insert(c.tokens.end(), out.token_ids.begin(), out.token_ids.end());
      c.token_times_ns.insert(c.token_times_ns.end(), out.token_times_ns.begin(),
                              out.token_times_ns.end());
      c.text += out.text;
      shared->tokens += static_cast<int64_t>(out.token_ids.size());
      const llm::OutputHooks& hooks = llm::hooks_of(out);
      for (auto& [k, v] : hooks.logits) c.logits[k] = v;
      for (auto& [k, v] : hooks.kv) c.kv[k] = v;
      if (out.finished()) {
        c.finish_reason = llm::finish_reason_name(out.finish);
        c.error = out.error;
        c.pages = hooks.pages;
        c.page_steps = hooks.page_steps;
        c.last_step = hooks.last_step;
        c.arrival_ns = out.arrival_ns;
        c.first_token_ns = out.first_token_ns;
        c.finished_ns = out.finished_ns;
        c.cached_tokens = out.cached_tokens;
        c.done = true;
        --shared->open;
        shared->cv.notify_all();
      }
    };
    const int32_t n = specs[r].n;
    {
      std::lock_guard<std::mutex> l(shared->mu);
      shared->open += n;
    }
    absl::StatusOr<llm::RequestId> id =
        engines[r % engines.size()]->add_request(std::move(specs[r]));
    if (!id.ok()) {
      std::lock_guard<std::mutex> l(shared->mu);
      shared->open -= n;
      for (ChoiceResult& c : run.results[r]) {
        c.finish_reason = "error";
        c.error = id.status();
        c.done = true;
      }
    }
  }
  std::unique_lock<std::mutex> l(shared->mu);
  int64_t last_report = base::now_ns();
  while (shared->open > 0) {
    shared->cv.wait_for(l, std::chrono::milliseconds(200));
    if (progress && base::now_ns() - last_report > 1'000'000'000) {
      last_report = base::now_ns();
      std::cerr << "simpler " << command << ": " << shared->tokens << " tokens generated, "
                << shared->open << " request(s) still open\n";
    }
  }
  run.end_ns = base::now_ns();
  for (const auto& rs : run.results) {
    for (const ChoiceResult& c : rs) {
      if (c.first_token_ns != 0)
        run.all_first_token_ns = std::max(run.all_first_token_ns, c.first_token_ns);
    }
  }
  if (run.all_first_token_ns == 0) run.all_first_token_ns = run.end_ns;
  return run;
}

DepthStats depth_stats(const std::vector<llm::StepRecord>& records) {
  DepthStats d;
  int64_t sum = 0;
  for (const llm::StepRecord& r : records) {
    sum += r.effective_depth;
    d.max_steps_in_flight = std::max(d.max_steps_in_flight, r.in_flight_at_submit);
  }
  d.steps = static_cast<int64_t>(records.size());
  d.effective_depth = records.empty() ? 0 : static_cast<double>(sum) / records.size();
  return d;
}

}  // namespace simpler::cli
