// Eager lanes' bookkeeping that needs no GPU: where message n of a lane goes, that a slot's
// word only grows from one use to the next, and that one side alone claims a recv's copy out.

#include <sys/syscall.h>
#include <unistd.h>

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

namespace {

// A way word in shared memory, as the receiver and the sender each map it.
struct WayWord {
  cuda::FlagSegment segment;
  cuda::Flag way = segment.acquire();
  // Taken as a peer takes it, through a pidfd of its owner: this process.
  int ownerPidfd = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
  cuda::RemoteFlagSegment remote{ownerPidfd, segment.ref(), "this process"};
  ~WayWord() { close(ownerPidfd); }
  volatile uint32_t* receiver() { return segment.word(way); }
  volatile uint32_t* sender() { return remote.word(way); }
};

TEST(firstSideDecidesAWay, "eager lanes: the first side decides a message's way, the other follows") {
  WayWord word;
  // Use 0: the receiver's wait() comes first and claims eager; the sender, whose slot is full,
  // would have chosen rendezvous, and follows.
  CHECK(decideWay(word.receiver(), word.way, 0, Way::kEager) == Way::kEager);
  CHECK(decideWay(word.sender(), word.way, 0, Way::kRendezvous) == Way::kEager);
  // Use 1: the sender comes first with its slot full; the receiver's claim finds rendezvous.
  CHECK(decideWay(word.sender(), word.way, 1, Way::kRendezvous) == Way::kRendezvous);
  CHECK(decideWay(word.receiver(), word.way, 1, Way::kEager) == Way::kRendezvous);
  // Asked again, a side reads its own decision.
  CHECK(decideWay(word.sender(), word.way, 1, Way::kEager) == Way::kRendezvous);
  // A use nobody took (a message too large for a slot) is skipped.
  CHECK(decideWay(word.sender(), word.way, 3, Way::kRendezvous) == Way::kRendezvous);
  // The sender ran ahead: the receiver, at use 2, learns only that it is the sender's.
  CHECK(!decideWay(word.receiver(), word.way, 2, Way::kEager).has_value());
}

TEST(racedWaysAgree, "eager lanes: raced from two processes' mappings, both sides agree per use") {
  for (int round = 0; round < 20; ++round) {
    WayWord word;
    constexpr uint32_t kUses = 200;
    std::vector<std::optional<Way>> sent(kUses), received(kUses);
    std::thread sender([&] {
      for (uint32_t use = 0; use < kUses; ++use) {
        sent[use] = decideWay(word.sender(), word.way, use, Way::kRendezvous);
      }
    });
    std::thread receiver([&] {
      for (uint32_t use = 0; use < kUses; ++use) {
        received[use] = decideWay(word.receiver(), word.way, use, Way::kEager);
      }
    });
    sender.join();
    receiver.join();
    for (uint32_t use = 0; use < kUses; ++use) {
      // Where a side found the use passed, the other decided it: the receiver only eager.
      CHECK(sent[use] || received[use]);
      CHECK(sent[use] || received[use] == Way::kEager);
      CHECK(!sent[use] || !received[use] || sent[use] == received[use]);
    }
  }
}

}  // namespace
