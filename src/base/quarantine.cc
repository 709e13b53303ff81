#include "base/quarantine.h"

#include <atomic>

#include "simpler/base/sync.h"

namespace simpler::base {
namespace {

struct Registry {
  Mutex mu;
  std::vector<std::shared_ptr<const void>> kept SIMPLER_GUARDED_BY(mu);
  std::vector<std::string> abandoned SIMPLER_GUARDED_BY(mu);
  std::atomic<int64_t> abandoned_count{0};
};

// Never destroyed: static destructors run at exit while abandoned threads may
// still execute, and the leak checker finds everything through this pointer.
Registry& registry() {
  static Registry* const r = new Registry;
  return *r;
}

}  // namespace

void keep_until_exit(std::shared_ptr<const void> object) {
  if (object == nullptr) return;
  Registry& r = registry();
  MutexLock lock(r.mu);
  r.kept.push_back(std::move(object));
}

void note_abandoned_thread(std::string what) {
  Registry& r = registry();
  MutexLock lock(r.mu);
  r.abandoned.push_back(std::move(what));
  r.abandoned_count.fetch_add(1, std::memory_order_release);
}

int64_t abandoned_threads() { return registry().abandoned_count.load(std::memory_order_acquire); }

std::vector<std::string> abandoned_thread_descriptions() {
  Registry& r = registry();
  MutexLock lock(r.mu);
  return r.abandoned;
}

}  // namespace simpler::base
