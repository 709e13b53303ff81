#include "cli/bench/bench_multi_turn.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"

namespace simpler::cli::bench {

absl::StatusOr<MultiTurnWorkload> make_multi_turn_workload(const llm::ModelConfig& config,
                                                           int64_t conversations, int64_t turns,
                                                           int64_t system_len, LenRange user,
                                                           LenRange output, uint64_t seed) {
  SIMPLER_RETURN_IF_ERROR(base::require_positive(
      {{"conversations", conversations}, {"turns", turns}, {"system prompt length", system_len}}));
  MultiTurnWorkload w;
  w.conversations = conversations;
  w.turns = turns;
  SplitMix64 lengths(seed);
  SplitMix64 ids(seed ^ 0x5bd1e9955bd1e995ull);
  auto draw = [&](int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& id : t) id = static_cast<int32_t>(ids.uniform(0, config.vocab_size - 1));
    return t;
  };
  w.system = draw(system_len);
  w.user.resize(conversations);
  w.output_lens.resize(conversations);
  for (int64_t c = 0; c < conversations; ++c) {
    int64_t total = system_len;
    for (int64_t t = 0; t < turns; ++t) {
      w.user[c].push_back(draw(lengths.uniform(user.lo, user.hi)));
      w.output_lens[c].push_back(lengths.uniform(output.lo, output.hi));
      total += static_cast<int64_t>(w.user[c].back().size());
      // The last turn's prompt holds every earlier answer; check it with its own max_tokens.
      const std::vector<int64_t> prompt(static_cast<size_t>(total), 0);
      if (absl::Status s = config.check_request(prompt, w.output_lens[c].back()); !s.ok()) {
        return base::annotate(s, absl::StrCat("conversation ", c, " turn ", t, ": "));
      }
      total += w.output_lens[c].back();
    }
    w.longest = std::max(w.longest, total);
  }
  return w;
}

namespace {

// The state of one run, shared between the caller and the engine's output thread (the callback
// submits each conversation's next turn). Thread-safe.
class Conversations {
 public:
  Conversations(llm::LlmEngine* engine, const MultiTurnWorkload& w)
      : engine_(engine), w_(w), prompts_(w.conversations, w.system), results_(w.conversations) {
    for (auto& r : results_) r.resize(w.turns);
  }

  // Submits turn 0 of every conversation.
  void start(const std::shared_ptr<Conversations>& self) {
    for (int64_t c = 0; c < w_.conversations; ++c) submit(self, c, 0);
  }

  void wait_all() {
    base::MutexLock l(mu_);
    while (open_ > 0) cv_.wait(l);
  }

  std::vector<std::vector<TurnResult>> take() {
    base::MutexLock l(mu_);
    return std::move(results_);
  }

 private:
  void submit(const std::shared_ptr<Conversations>& self, int64_t c, int64_t t) {
    llm::RequestSpec spec;
    {
      base::MutexLock l(mu_);
      if (t == 0) ++open_;
      std::vector<int32_t>& p = prompts_[c];
      p.insert(p.end(), w_.user[c][t].begin(), w_.user[c][t].end());
      spec.prompt_ids = p;
      results_[c][t].prompt_tokens = static_cast<int64_t>(p.size());
    }
    spec.max_tokens = w_.output_lens[c][t];
    spec.sampling.temperature = 0;
    spec.sampling.ignore_eos = true;
    spec.on_output = [self, c, t](const llm::RequestOutput& out) {
      self->on_output(self, c, t, out);
    };
    absl::StatusOr<llm::RequestId> id = engine_->add_request(std::move(spec));
    if (!id.ok()) end(c, t, id.status());
  }

  void on_output(const std::shared_ptr<Conversations>& self, int64_t c, int64_t t,
                 const llm::RequestOutput& out) {
    bool next = false;
    {
      base::MutexLock l(mu_);
      TurnResult& r = results_[c][t];
      r.tokens += static_cast<int64_t>(out.token_ids.size());
      prompts_[c].insert(prompts_[c].end(), out.token_ids.begin(), out.token_ids.end());
      if (!out.finished()) return;
      r.ttft_ns = out.first_token_ns > 0 ? out.first_token_ns - out.arrival_ns : 0;
      r.cached_tokens = out.cached_tokens;
      r.ok = out.finish == llm::OutputFinish::kLength && r.tokens == w_.output_lens[c][t];
      r.error = out.error;
      next = r.ok && t + 1 < w_.turns;
    }
    if (next) return submit(self, c, t + 1);
    end(c, t, absl::OkStatus());
  }

  // Conversation c ended at turn t (its last, or a failed one).
  void end(int64_t c, int64_t t, const absl::Status& refused) {
    base::MutexLock l(mu_);
    if (!refused.ok()) results_[c][t].error = refused;
    --open_;
    cv_.notify_all();
  }

  llm::LlmEngine* const engine_;
  const MultiTurnWorkload& w_;
  base::Mutex mu_;
  base::CondVar cv_;
  std::vector<std::vector<int32_t>> prompts_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::vector<TurnResult>> results_ SIMPLER_GUARDED_BY(mu_);
  int64_t open_ SIMPLER_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<MultiTurnRun> run_multi_turn(const std::string& model, const llm::EngineOptions& eo,
                                            const MultiTurnWorkload& w) {
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<llm::LlmEngine> engine,
                           llm::LlmEngine::create(model, eo));
  // One warm-up request first (a one-token prompt no conversation starts with), so the runs
  // compared do not differ by the first steps' one-time costs.
  llm::RequestSpec warm;
  warm.prompt_ids = {w.system.empty() || w.system[0] != 0 ? 0 : 1};
  warm.max_tokens = 1;
  SIMPLER_ASSIGN_OR_RETURN(llm::RequestId warm_id, engine->add_request(std::move(warm)));
  for (bool done = false; !done;) {
    SIMPLER_ASSIGN_OR_RETURN(llm::RequestOutput out, engine->next_output(warm_id));
    done = out.finished();
  }
  MultiTurnRun run;
  auto conversations = std::make_shared<Conversations>(engine.get(), w);
  run.start_ns = base::now_ns();
  conversations->start(conversations);
  conversations->wait_all();
  run.end_ns = base::now_ns();
  run.turns = conversations->take();
  for (const auto& conv : run.turns) {
    for (const TurnResult& t : conv) run.output_tokens += t.tokens;
  }
  run.metrics = engine->metrics();
  run.closed = engine->shutdown(base::Deadline::poll());
  return run;
}

}  // namespace simpler::cli::bench
