// Captured ops' bookkeeping without a GPU: the watchdog's view of a graph's wait (GraphWait),
// the lines of their own that captured ops match in, and the slot a captured send announces.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/GroupState.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/GraphWait.h"

#include "check.h"

using namespace smfree::engine;
using std::chrono::milliseconds;

namespace {

const GraphWait::Clock::time_point t0{};

TEST(graphWaitIdleWordIsIdle, "graph wait: a word the GPU left idle never counts as waiting") {
  volatile uint32_t word = GraphWait::kIdle;
  GraphWait wait(&word);
  CHECK(wait.check(t0, milliseconds(10)) == GraphWait::Verdict::kIdle);
  CHECK(wait.check(t0 + milliseconds(1000), milliseconds(10)) == GraphWait::Verdict::kIdle);
  CHECK(!wait.waiting());
}

TEST(graphWaitStuckAfterItsLimit, "graph wait: the same wait is stuck once it lasts the limit") {
  volatile uint32_t word = GraphWait::kWaiting;  // the GPU reached the wait
  GraphWait wait(&word);
  CHECK(wait.check(t0, milliseconds(10)) == GraphWait::Verdict::kWaiting);
  CHECK(word == GraphWait::kSeen);  // marked: a GPU write past the wait would clear it
  CHECK(wait.waiting());
  CHECK(wait.check(t0 + milliseconds(9), milliseconds(10)) == GraphWait::Verdict::kWaiting);
  CHECK(wait.check(t0 + milliseconds(10), milliseconds(10)) == GraphWait::Verdict::kStuck);
}

TEST(graphWaitReplaysInBetween, "graph wait: replays passing the wait restart its clock") {
  volatile uint32_t word = GraphWait::kWaiting;
  GraphWait wait(&word);
  CHECK(wait.check(t0, milliseconds(10)) == GraphWait::Verdict::kWaiting);
  // The GPU passed the wait (kIdle) and a later replay reached it again (kWaiting), all
  // between two checks: the mark is gone, so this is a new wait, not a stuck one.
  word = GraphWait::kIdle;
  word = GraphWait::kWaiting;
  CHECK(wait.check(t0 + milliseconds(50), milliseconds(10)) == GraphWait::Verdict::kWaiting);
  CHECK(wait.check(t0 + milliseconds(55), milliseconds(10)) == GraphWait::Verdict::kWaiting);
  CHECK(wait.check(t0 + milliseconds(60), milliseconds(10)) == GraphWait::Verdict::kStuck);
  word = GraphWait::kIdle;  // released: the GPU went on
  CHECK(wait.check(t0 + milliseconds(61), milliseconds(10)) == GraphWait::Verdict::kIdle);
}

std::shared_ptr<Op> recv(uint64_t id, ChannelKind channel) {
  auto op = std::make_shared<Op>();
  op->id = id;
  op->request.kind = OpKind::kRecv;
  op->request.peer = 1;
  op->channel = channel;
  return op;
}

ReadyToSend announcement(uint64_t sendId, ChannelKind channel) {
  ReadyToSend message;
  message.source = 1;
  message.sendId = sendId;
  message.channel = channel;
  return message;
}

TEST(capturedOpsMatchOnlyOneAnother, "captured ops match only captured ops, in lines of their own") {
  GroupState group;
  // An ordinary send and a captured one, both message 0 of (rank 1, tag 0) in their lines.
  auto ordinary = announcement(10, ChannelKind::kCopyEngine);
  auto captured = announcement(20, ChannelKind::kCaptured);
  CHECK(group.matcherFor(captured.channel).announce(captured).empty());
  CHECK(group.matcherFor(ordinary.channel).announce(ordinary).empty());
  auto capturedRecv = recv(1, ChannelKind::kCaptured);
  auto ordinaryRecv = recv(2, ChannelKind::kCopyEngine);
  auto first = group.matcherFor(capturedRecv->channel).postRecv(capturedRecv);
  auto second = group.matcherFor(ordinaryRecv->channel).postRecv(ordinaryRecv);
  CHECK(first && first->announcement.rts.sendId == 20);
  CHECK(second && second->announcement.rts.sendId == 10);
  CHECK(&group.matcherFor(ChannelKind::kUcx) == &group.matcherFor(ChannelKind::kCopyEngine));
}

TEST(capturedSlotRoundTrips, "a captured send's slot round-trips; malformed bytes are refused") {
  CapturedSlot slot;
  slot.full = cuda::Flag{3, 1};
  slot.empty = cuda::Flag{4, 1};
  slot.memory.kind = cuda::IpcExport::Kind::kIpcHandle;
  slot.memory.device = 1;
  slot.memory.address = slot.memory.base = 0x7000;
  slot.memory.bufferId = 9;
  std::string bytes;
  slot.appendTo(bytes);
  const CapturedSlot back = CapturedSlot::read(bytes);
  CHECK(back.full.index == 3 && back.empty.index == 4);
  CHECK(back.memory.device == 1 && back.memory.address == 0x7000 && back.memory.bufferId == 9);
  CHECK(testing::throwsError([&] { CapturedSlot::read(bytes.substr(0, 8)); },
                             "malformed captured slot: 8 B"));
}

}  // namespace
