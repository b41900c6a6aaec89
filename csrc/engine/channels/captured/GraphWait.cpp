#include "engine/channels/captured/GraphWait.h"

namespace smfree::engine {

GraphWait::Verdict GraphWait::check(Clock::time_point now, std::chrono::milliseconds limit) {
  uint32_t* word = const_cast<uint32_t*>(word_);
  uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  if (seen == kWaiting) {
    if (!__atomic_compare_exchange_n(word, &seen, kSeen, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
      return seen == kIdle ? Verdict::kIdle : Verdict::kWaiting;  // the GPU moved on meanwhile
    }
    seenAt_ = now;
    return Verdict::kWaiting;
  }
  if (seen != kSeen) return Verdict::kIdle;
  return now - seenAt_ >= limit ? Verdict::kStuck : Verdict::kWaiting;
}

bool GraphWait::waiting() const {
  const uint32_t seen = __atomic_load_n(const_cast<uint32_t*>(word_), __ATOMIC_ACQUIRE);
  return seen == kWaiting || seen == kSeen;
}

}  // namespace smfree::engine
