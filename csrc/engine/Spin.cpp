#include "engine/Spin.h"

#include <sched.h>

#include <string>

#include "engine/Error.h"
#include "engine/Log.h"

namespace smfree::engine {
namespace {

std::string sleepingNote(long ranks, const char* counted, int cpus) {
  return concat("SMFREE_SPIN_US unset and ", ranks, ranks == 1 ? " rank" : " ranks",
                " on this host (", counted, "), two polling threads each, share ", cpus,
                " CPUs: the engine's threads sleep between events instead of spinning");
}

}  // namespace

// 4 ranks on 2 cores, each progress thread spinning 10 ms after every event, took up to 10 x
// Gloo's time per exchange; without spinning, about Gloo's (tools/probe_exchange_patterns.py).
Spin::Spin(const Config& config, int cpus)
    : us_(config.spin.value_or(kDefault).count()), cpus_(cpus) {
  if (config.spin || cpus_ <= 0) return;
  if (!config.localRanks) {
    counting_ = true;
    onRanksOnHost(1);  // this one
    return;
  }
  if (crowded(*config.localRanks)) {
    us_ = 0;
    log(LogLevel::kInfo, sleepingNote(*config.localRanks, "LOCAL_WORLD_SIZE", cpus_));
  }
}

int Spin::cpusOfProcess() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return 0;
  return CPU_COUNT(&allowed);
}

void Spin::onRanksOnHost(long ranks) {
  if (!counting_ || !crowded(ranks)) return;
  counting_ = false;
  us_ = 0;
  log(LogLevel::kInfo,
      sleepingNote(ranks, "LOCAL_WORLD_SIZE unset; counted from the peers connected", cpus_));
}

bool Spin::crowded(long ranks) const { return ranks * kPollingThreadsPerRank > cpus_; }

void SpinDeadline::expired() const {
  fail(what_, " did not end within ", limit_.count(),
       " ms: the thread or process it waits on is stuck or gone");
}

}  // namespace smfree::engine
