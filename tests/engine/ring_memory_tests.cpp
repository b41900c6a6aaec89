// The rings' memory bound: what is taken is counted per device, a ring beyond the bound is
// refused naming it, and a ring's share comes back when it goes.

#include "engine/channels/copy_engine/RingMemory.h"

#include "check.h"

using namespace smfree::engine;

namespace {

TEST(ringsWithinTheirBound, "ring memory: taken per device up to the bound, given back when gone") {
  RingMemory memory(96ull << 20);
  auto eager = memory.take(0, 64ull << 20, "eager ring");
  {
    auto staging = memory.take(1, 32ull << 20, "staging ring");
    CHECK(memory.taken() == 96ull << 20);
    CHECK(memory.describe() ==
          "cuda:0 64 MiB, cuda:1 32 MiB of 96 MiB (SMFREE_RING_MEMORY_BYTES)");
    CHECK(testing::throwsError([&] { memory.take(0, 1 << 20, "eager ring for tag 5"); },
                               "eager ring for tag 5 needs 1 MiB of GPU memory; the rings of "
                               "this process hold 96 MiB of the 96 MiB SMFREE_RING_MEMORY_BYTES "
                               "allows"));
    CHECK(memory.taken() == 96ull << 20);  // a refusal takes nothing
  }
  CHECK(memory.taken() == 64ull << 20);
  CHECK(memory.describe() == "cuda:0 64 MiB of 96 MiB (SMFREE_RING_MEMORY_BYTES)");
  auto small = memory.take(1, 4 << 10, "eager ring of 4 KiB slots");
  CHECK(memory.describe() ==
        "cuda:0 64 MiB, cuda:1 4 KiB of 96 MiB (SMFREE_RING_MEMORY_BYTES)");
}

TEST(noRingsWithoutMemory, "ring memory: a bound of 0 refuses every ring") {
  RingMemory memory(0);
  CHECK(testing::throwsError([&] { memory.take(0, 1, "ring"); }, "ring needs"));
  CHECK(memory.describe() == "nothing of 0 B (SMFREE_RING_MEMORY_BYTES)");
}

}  // namespace
