// Flag words: the signal words CUDA streams and progress threads wait on.

#include <cstdint>

#include "engine/cuda/FlagSegment.h"

#include "check.h"

using namespace smfree::engine;

namespace {

TEST(flagValuesGrowPerWord, "flag values grow per word") {
  cuda::FlagSegment segment;
  const cuda::Flag first = segment.acquire();
  const cuda::Flag other = segment.acquire();
  CHECK(first.index != other.index);
  CHECK(!segment.isSet(first));
  segment.set(first);
  CHECK(segment.isSet(first));
  segment.release(first);
  const cuda::Flag again = segment.acquire();  // the word just released comes back...
  CHECK(again.index == first.index);
  CHECK(again.value == first.value + 1);  // ...with a larger value: old waits stay satisfied
  CHECK(!segment.isSet(again));
  CHECK(segment.inUse() == 2);
}

TEST(flagUsesOwnASpanOfValues, "a flag use owns a span of values") {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.release(done);
  const cuda::Flag next = segment.acquire();
  CHECK(next.index == done.index);
  CHECK(next.value == done.value + 3);  // past every value the last use could have written
}

TEST(settingAFlagNeverLowersItsWord, "setting a flag never lowers its word") {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.set(done.plus(2));  // what a GPU (or a peer) wrote first
  segment.set(done);          // a later release by this process's CPU
  CHECK(segment.wordOf(done) == done.value + 2);
  segment.set(done.plus(1));
  CHECK(segment.wordOf(done) == done.value + 2);
}

TEST(flagWaitsFollowTheGpuComparison, "flag waits follow the GPU comparison") {
  CHECK(cuda::reached(5, 5));
  CHECK(cuda::reached(6, 5));
  CHECK(!cuda::reached(4, 5));
  CHECK(cuda::reached(2, 0xFFFFFFFEu));   // wrapped past the top: still "greater or equal"
  CHECK(!cuda::reached(0xFFFFFFFEu, 2));
}

TEST(flagSegmentRunsOutLoudly, "flag segment runs out loudly") {
  cuda::FlagSegment segment;
  for (uint32_t i = 0; i < cuda::FlagSegment::kWords; ++i) segment.acquire();
  CHECK(testing::throwsError([&] { segment.acquire(); }, "too many CUDA ops in flight"));
}

}  // namespace
