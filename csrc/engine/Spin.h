#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "engine/Config.h"

namespace smfree::engine {

// How long the engine's polling threads (the progress thread, the UCX receive worker's) and a
// CUDA wait() poll after their last event before they sleep (docs/design.md, Threads).
// Spinning pays only where each polling thread of the host's ranks has a CPU to spin on, so
// unless SMFREE_SPIN_US chose, it stops where they outnumber this process's CPUs. The host's
// ranks are LOCAL_WORLD_SIZE where the launcher says (torchrun does); elsewhere (e.g.
// torch.multiprocessing.spawn) they are counted as same-host peers connect.
class Spin {
 public:
  Spin(const Config& config, int cpus);
  // The CPUs this process may run on; 0 where the system does not say.
  static int cpusOfProcess();

  std::chrono::microseconds get() const {
    return std::chrono::microseconds(us_.load(std::memory_order_relaxed));
  }
  // Progress thread: this many ranks are known to share the host (this one included).
  void onRanksOnHost(long ranks);

  static constexpr std::chrono::microseconds kDefault{10000};
  static constexpr long kPollingThreadsPerRank = 2;

 private:
  bool crowded(long ranks) const;

  std::atomic<int64_t> us_;
  const int cpus_;
  // Whether peers may still stop it: neither the user nor the launcher chose, and it spins.
  bool counting_ = false;
};

// The deadline of a loop that spins on another thread or process (a word in shared memory, a
// flag the progress thread sets): every engine spin has one, so a stuck thread or a peer that
// keeps changing a shared word ends in an Error naming the wait, never in a hang. The clock
// is read once every kCallsPerClockRead calls: a check is a compare.
class SpinDeadline {
 public:
  static constexpr uint32_t kCallsPerClockRead = 1024;

  SpinDeadline(std::chrono::milliseconds limit, const char* what)
      : limit_(limit), what_(what), deadline_(std::chrono::steady_clock::now() + limit) {}
  // Throws Error once the limit has passed.
  void check() {
    if (++calls_ % kCallsPerClockRead == 0 && std::chrono::steady_clock::now() > deadline_) {
      expired();
    }
  }

 private:
  [[noreturn]] void expired() const;

  std::chrono::milliseconds limit_;
  const char* what_;
  std::chrono::steady_clock::time_point deadline_;
  uint32_t calls_ = 0;
};

}  // namespace smfree::engine
