// Captured ops' bookkeeping without a GPU: the watchdog's view of a graph's wait (GraphWait),
// the lines of their own that captured ops match in, what a captured send announces, and the
// notices of captured recvs that let a send copy straight into its receiver's buffer.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "engine/GroupState.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/GraphWait.h"
#include "engine/channels/captured/PostedRecvs.h"

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

TEST(capturedAnnouncementRoundTrips,
     "a captured send's announcement round-trips, with its slot or direct; malformed bytes are "
     "refused") {
  CapturedAnnouncement announced;
  announced.slot.full = cuda::Flag{3, 1};
  announced.slot.empty = cuda::Flag{4, 1};
  announced.slot.memory.kind = cuda::IpcExport::Kind::kIpcHandle;
  announced.slot.memory.device = 1;
  announced.slot.memory.address = announced.slot.memory.base = 0x7000;
  announced.slot.memory.bufferId = 9;
  std::string bytes;
  announced.appendTo(bytes);
  const CapturedAnnouncement back = CapturedAnnouncement::read(bytes);
  CHECK(back.way == CapturedWay::kSlot);
  CHECK(back.slot.full.index == 3 && back.slot.empty.index == 4);
  CHECK(back.slot.memory.device == 1 && back.slot.memory.address == 0x7000 &&
        back.slot.memory.bufferId == 9);
  CHECK(testing::throwsError([&] { CapturedAnnouncement::read(bytes.substr(0, 8)); },
                             "bad length in a captured send announcement: 8 B"));

  std::string direct;
  CapturedAnnouncement{CapturedWay::kDirect, {}}.appendTo(direct);
  CHECK(CapturedAnnouncement::read(direct).way == CapturedWay::kDirect);
  // A slot's announcement without its slot, or a way nobody sends, is refused.
  std::string bare = direct;
  bare[0] = static_cast<char>(CapturedWay::kSlot);
  CHECK(testing::throwsError([&] { CapturedAnnouncement::read(bare); },
                             "bad way in a captured send announcement: 1 in"));
  bare[0] = 7;
  CHECK(testing::throwsError([&] { CapturedAnnouncement::read(bare); },
                             "bad way in a captured send announcement: 7 in"));
}

PostedRecv postedRecv(uint64_t seq) {
  PostedRecv recv;
  recv.group = 5;
  recv.tag = -3;
  recv.seq = seq;
  recv.bytes = 1 << 20;
  recv.dtype = "float32";
  recv.ready = cuda::Flag{11, 0};
  recv.arrived = cuda::Flag{12, 0};
  recv.buffer.kind = cuda::IpcExport::Kind::kIpcHandle;
  recv.buffer.device = 2;
  recv.buffer.address = 0x9100;
  recv.buffer.base = 0x9000;
  recv.buffer.bufferId = 77;
  return recv;
}

TEST(postedRecvRoundTrips, "a captured recv's notice to its sender round-trips") {
  std::string bytes;
  postedRecv(6).appendTo(bytes);
  const PostedRecv back = PostedRecv::read(bytes);
  CHECK(back.group == 5 && back.tag == -3 && back.seq == 6 && back.bytes == (1u << 20));
  CHECK(back.dtype == "float32" && back.ready.index == 11 && back.arrived.index == 12);
  CHECK(back.buffer.device == 2 && back.buffer.address == 0x9100 && back.buffer.base == 0x9000 &&
        back.buffer.bufferId == 77);
  CHECK(testing::throwsError([&] { PostedRecv::read(bytes.substr(0, 10)); },
                             "bad length in a captured recv notice: 10 B"));
}

TEST(postedRecvsTakeTheirOwnPlace,
     "a captured send takes the notice of its place in its line, and forgets earlier ones") {
  PostedRecvs posted;
  for (uint64_t seq : {1, 2, 4}) posted.add("peer", PostedRecvs::Entry{postedRecv(seq), {}, {}});
  const std::chrono::microseconds none{0};
  // Another peer, group or tag is another line.
  CHECK(!posted.take("other", 5, -3, 1, none));
  CHECK(!posted.take("peer", 6, -3, 1, none));
  CHECK(!posted.take("peer", 5, 0, 1, none));
  // Place 3 has no notice (its recv was posted too late): the send goes without, and place 1,
  // which a send passed, is forgotten with it.
  CHECK(!posted.take("peer", 5, -3, 3, none));
  CHECK(!posted.take("peer", 5, -3, 2, none));
  const auto fourth = posted.take("peer", 5, -3, 4, none);
  CHECK(fourth && fourth->recv.seq == 4);
  CHECK(!posted.take("peer", 5, -3, 4, none));  // taken once
}

TEST(postedRecvsWaitForANoticeOnTheWay,
     "a captured send waits its patience for its recv's notice, and no longer") {
  PostedRecvs posted;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    posted.add("peer", PostedRecvs::Entry{postedRecv(0), {}, {}});
  });
  const auto start = std::chrono::steady_clock::now();
  const auto found = posted.take("peer", 5, -3, 0, std::chrono::seconds(5));
  later.join();
  CHECK(found && found->recv.seq == 0);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(4));
  const auto waited = std::chrono::steady_clock::now();
  CHECK(!posted.take("peer", 5, -3, 1, std::chrono::milliseconds(30)));
  CHECK(std::chrono::steady_clock::now() - waited >= std::chrono::milliseconds(30));
  posted.add("peer", PostedRecvs::Entry{postedRecv(2), {}, {}});
  posted.dropPeer("peer");
  CHECK(!posted.take("peer", 5, -3, 2, std::chrono::microseconds(0)));
}

}  // namespace
