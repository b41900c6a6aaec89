#pragma once

#include <chrono>
#include <cstdint>

namespace smfree::engine {

// The watchdog's view of one wait that a captured graph makes at every replay: a captured op
// waits for its peer's graph (a send for its receiver to have emptied its slot, a recv for its
// sender to have filled it), and a peer that never replays its side, or died, would leave it
// waiting for good. The graph brackets each such wait with writes of a word of this process's
// flag segment: kWaiting before, kIdle after. The progress thread checks the word every sweep:
// a kWaiting it finds it turns into kSeen (a compare-and-swap, so a GPU write in between wins),
// and a word still kSeen a limit later means the same wait has lasted that long, whatever the
// replays did meanwhile: the GPU would have written kIdle past it.
class GraphWait {
 public:
  static constexpr uint32_t kIdle = 0;
  static constexpr uint32_t kWaiting = 1;
  static constexpr uint32_t kSeen = 2;

  enum class Verdict {
    kIdle,     // the graph is not at this wait
    kWaiting,  // it is, for less than the limit so far
    kStuck,    // it has been, without a break, for the limit
  };

  using Clock = std::chrono::steady_clock;

  explicit GraphWait(volatile uint32_t* word) : word_(word) {}

  Verdict check(Clock::time_point now, std::chrono::milliseconds limit);
  // Whether the graph is at this wait now (the word is kWaiting or kSeen).
  bool waiting() const;

 private:
  volatile uint32_t* word_;
  Clock::time_point seenAt_{};
};

}  // namespace smfree::engine
