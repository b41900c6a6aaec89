// Collective lanes' records: how the two sides of a collective piece decide, with compare-and-swaps
// on shared memory, which of them queues the copy. No GPU: the decisions are CPU atomics.

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "check.h"
#include "engine/channels/copy_engine/CollectiveRecords.h"

using namespace smfree::engine;
using smfree::engine::testing::throwsError;

namespace {

constexpr bool kSender = true;
constexpr bool kReceiver = false;

// One side's post with a second part that always agrees (CollectiveLanes maps the first's buffer
// there); `undone` counts the takes a cancel beat.
CollectiveRole post(CollectiveRecord& record, uint32_t use, bool sender, bool publishable = true,
                    std::atomic<int>* undone = nullptr) {
  const CollectiveSecond second{[](const CollectiveHalf&) { return true; },
                                [undone] {
                                  if (undone) ++*undone;
                                }};
  return decideCollective(record, use, sender, publishable, second);
}

TEST(firstPublishesSecondTakes, "collective lanes: the first side publishes, the second takes") {
  CollectiveRecord record{};
  CHECK(post(record, 0, kReceiver) == CollectiveRole::kFirst);
  CHECK(post(record, 0, kSender) == CollectiveRole::kSecond);
  // Taken: a cancel by the first side comes too late, and says a copy comes.
  CHECK(!cancelCollective(record, 0, kReceiver));
  // The record's next use opens, either side first.
  CHECK(post(record, 1, kSender) == CollectiveRole::kFirst);
  CHECK(post(record, 1, kReceiver) == CollectiveRole::kSecond);
}

TEST(aCancelledFirstSendsTheSecondByRendezvous,
     "collective lanes: a first side that cancels leaves no copy to queue") {
  CollectiveRecord record{};
  CHECK(post(record, 0, kSender) == CollectiveRole::kFirst);
  CHECK(cancelCollective(record, 0, kSender));
  CHECK(cancelCollective(record, 0, kSender));  // asked again: still no copy
  CHECK(post(record, 0, kReceiver) == CollectiveRole::kRendezvous);
  CHECK(post(record, 1, kReceiver) == CollectiveRole::kFirst);  // the next use is open
}

TEST(anUnpublishableHalfDecidesRendezvousForBoth,
     "collective lanes: a side that cannot publish decides rendezvous for both") {
  CollectiveRecord record{};
  CHECK(post(record, 0, kSender, false) == CollectiveRole::kRendezvous);
  CHECK(post(record, 0, kReceiver) == CollectiveRole::kRendezvous);
  CHECK(post(record, 1, kReceiver) == CollectiveRole::kFirst);
}

TEST(aSecondThatDisagreesDecidesRendezvous,
     "collective lanes: halves that differ (bytes, dtype) send the piece by rendezvous") {
  CollectiveRecord record{};
  record.sender.bytes = 4096;
  CHECK(post(record, 0, kSender) == CollectiveRole::kFirst);
  uint64_t seenBytes = 0;
  const CollectiveSecond disagree{[&](const CollectiveHalf& theirs) {
                                    seenBytes = theirs.bytes;
                                    return false;
                                  },
                                  [] {}};
  CHECK(decideCollective(record, 0, kReceiver, true, disagree) == CollectiveRole::kRendezvous);
  CHECK(seenBytes == 4096);                     // it read the sender's half
  CHECK(cancelCollective(record, 0, kSender));  // no copy comes to the sender either
}

TEST(anEarlierUseStillWaitingIsOutOfStep,
     "collective lanes: a record whose earlier use still waits is refused, not overwritten") {
  CollectiveRecord record{};
  CHECK(post(record, 0, kSender) == CollectiveRole::kFirst);
  CHECK(throwsError([&] { post(record, 1, kSender); }, "out of step"));
  CHECK(throwsError([&] { post(record, 1, kReceiver); }, "out of step"));
  CHECK(post(record, 0, kReceiver) == CollectiveRole::kSecond);  // the earlier use was kept
}

TEST(
    aStaleWordSendsBothSidesByRendezvous,
    "collective lanes: a word past the use (a line a closed group left) sends both by rendezvous") {
  CollectiveRecord record{};
  for (uint32_t use = 0; use < 3; ++use) {
    CHECK(post(record, use, kSender) == CollectiveRole::kFirst);
    CHECK(post(record, use, kReceiver) == CollectiveRole::kSecond);
  }
  CHECK(post(record, 0, kReceiver) == CollectiveRole::kRendezvous);
  CHECK(post(record, 0, kSender) == CollectiveRole::kRendezvous);
  CHECK(post(record, 3, kReceiver) == CollectiveRole::kFirst);
}

TEST(racedPostsMakeOneFirstAndOneSecond,
     "collective lanes: sides posting at once, many uses: one first and one second each") {
  auto record = std::make_unique<CollectiveRecord>();
  *record = CollectiveRecord{};
  constexpr uint32_t kUses = 2000;
  std::vector<CollectiveRole> senders(kUses);
  std::vector<CollectiveRole> receivers(kUses);
  std::atomic<uint32_t> sent{0};
  std::atomic<uint32_t> received{0};
  // Each side posts use u only once its use u - 1 is decided (a real side's in-flight bound).
  auto side = [&](bool sender, std::vector<CollectiveRole>& roles, std::atomic<uint32_t>& mine,
                  const std::atomic<uint32_t>& theirs) {
    for (uint32_t use = 0; use < kUses; ++use) {
      while (use > 0 && theirs.load() < use) std::this_thread::yield();
      roles[use] = post(*record, use, sender);
      mine.store(use + 1);
    }
  };
  std::thread a([&] { side(kSender, senders, sent, received); });
  std::thread b([&] { side(kReceiver, receivers, received, sent); });
  a.join();
  b.join();
  for (uint32_t use = 0; use < kUses; ++use) {
    const bool oneEach =
        (senders[use] == CollectiveRole::kFirst && receivers[use] == CollectiveRole::kSecond) ||
        (senders[use] == CollectiveRole::kSecond && receivers[use] == CollectiveRole::kFirst);
    CHECK(oneEach);
  }
}

TEST(aCancelRacesATakeAndOneWins, "collective lanes: a cancel and a take race; exactly one wins") {
  for (int round = 0; round < 500; ++round) {
    CollectiveRecord record{};
    CHECK(post(record, 0, kSender) == CollectiveRole::kFirst);
    std::atomic<bool> noCopy{false};
    std::atomic<int> undone{0};
    CollectiveRole receiver = CollectiveRole::kFirst;
    std::thread cancel([&] { noCopy = cancelCollective(record, 0, kSender); });
    std::thread take([&] { receiver = post(record, 0, kReceiver, true, &undone); });
    cancel.join();
    take.join();
    // No copy and a rendezvous, or a copy queued by the receiver: never both, never neither.
    CHECK(noCopy.load() == (receiver == CollectiveRole::kRendezvous));
    CHECK(receiver != CollectiveRole::kFirst);
    CHECK(undone.load() <= 1);
  }
}

TEST(bothSidesFindOneLine, "collective lanes: both sides find a (group, rank) line in one table") {
  std::vector<char> tail(CollectiveLines::kTableBytes + 3 * CollectiveLines::kLineBytes, 0);
  const CollectiveLines lines(tail.data());
  CollectiveRecord* first = lines.line(42, "process 1");
  CHECK(first != nullptr);
  CHECK(lines.line(42, "process 1") == first);  // found again, from either side
  CollectiveRecord* other = lines.line(42, "process 2");
  CHECK(other != nullptr && other != first);
  CHECK(lines.line(7, "process 1") != first);
  // Raced by two threads on a fresh table: both get the same line.
  std::vector<char> fresh(CollectiveLines::kTableBytes + 3 * CollectiveLines::kLineBytes, 0);
  const CollectiveLines raced(fresh.data());
  CollectiveRecord* seenA = nullptr;
  CollectiveRecord* seenB = nullptr;
  std::thread a([&] { seenA = raced.line(9, "process 0"); });
  std::thread b([&] { seenB = raced.line(9, "process 0"); });
  a.join();
  b.join();
  CHECK(seenA != nullptr && seenA == seenB);
  static_assert(CollectiveLines::kLines >= 32, "room for the lines of a few groups and ranks");
}

}  // namespace
