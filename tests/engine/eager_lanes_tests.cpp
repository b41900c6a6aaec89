// Eager lanes' bookkeeping that needs no GPU: where message n of a lane goes, that a slot's
// word only grows from one use to the next, and that one side alone claims a recv's copy out.

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "engine/channels/copy_engine/EagerLanes.h"

#include "check.h"

using namespace smfree::engine;

namespace {

TEST(eagerMessagesTakeSlotsInTurn, "eager lanes: message n takes slot n % 8, use n / 8") {
  std::set<uint32_t> slots;
  for (uint64_t seq = 0; seq < kEagerSlots; ++seq) {
    const EagerSlot eager = eagerSlotOf(seq, 3);
    slots.insert(eager.staged.slot);
    CHECK(eager.staged.use == 0 && eager.device == 3);
  }
  CHECK(slots.size() == kEagerSlots);  // a lane's 8 messages in flight never share a slot
  const EagerSlot later = eagerSlotOf(5 + 2 * kEagerSlots, 0);
  CHECK(later.staged.slot == 5 && later.staged.use == 2);
}

TEST(slotWordOnlyGrows, "eager lanes: a slot's word grows full, emptied, full of the next use") {
  // The sender waits for emptied(u - 1) before it raises the word to full(u), and each GPU
  // wait is "at least": so every value a slot's word takes must exceed the one before.
  const cuda::Flag word{7, 100};
  uint32_t last = 0;
  for (uint32_t use = 0; use < 50; ++use) {
    const uint32_t full = slotFull(word, use).value;
    const uint32_t emptied = slotEmptied(word, use).value;
    CHECK(full > last || use == 0);
    CHECK(emptied > full);
    CHECK(slotFull(word, use).index == 7 && slotEmptied(word, use).index == 7);
    last = emptied;
  }
}

TEST(oneSideClaimsACopyOut, "eager lanes: the wait() or the match claims a copy out, once") {
  EagerRecv recv;
  CHECK(recv.claimBy(EagerRecv::kByCaller));
  CHECK(recv.claimBy(EagerRecv::kByCaller));     // the same side again: still its own
  CHECK(!recv.claimBy(EagerRecv::kByProgress));  // the other side: refused
  EagerRecv other;
  CHECK(other.claimBy(EagerRecv::kByProgress));
  CHECK(!other.claimBy(EagerRecv::kByCaller));
  // Raced from two threads, many times: exactly one wins each recv.
  for (int round = 0; round < 200; ++round) {
    EagerRecv raced;
    std::atomic<int> wins{0};
    std::thread caller([&] { wins += raced.claimBy(EagerRecv::kByCaller) ? 1 : 0; });
    std::thread progress([&] { wins += raced.claimBy(EagerRecv::kByProgress) ? 1 : 0; });
    caller.join();
    progress.join();
    CHECK(wins == 1);
  }
}

}  // namespace
