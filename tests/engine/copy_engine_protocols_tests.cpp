// The copy-engine protocols driven in-process on the fake CUDA driver (fake_cuda.h): this
// process is both sender and receiver, its peer itself (a Peer watched through a pidfd of
// this process). Each test walks a transfer through its protocol's states
// and checks the bytes, the words and how each op ended.

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/CudaOps.h"
#include "engine/GroupState.h"
#include "engine/Peer.h"
#include "engine/ProgressThread.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"
#include "engine/channels/copy_engine/DirectProtocol.h"
#include "engine/channels/copy_engine/EagerProtocol.h"
#include "engine/channels/copy_engine/StagedProtocol.h"
#include "engine/cuda/DeviceMemory.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/Stream.h"

#include "check.h"
#include "fake_cuda.h"
#include "test_copy_engine_op.h"
#include "test_peer.h"

namespace smfree::engine {

// As CopyEngineChannel.cpp defines them, which these tests do not build.
const std::string& processKeyOf(const Peer& peer) { return peer.address.processKey; }
int pidfdOf(const Peer& peer) { return peer.watch ? peer.watch->fd() : -1; }
std::string describePeer(const Peer& peer) { return "peer " + peer.address.processKey; }

}  // namespace smfree::engine

using namespace smfree::engine;
using testing::FakeCuda;
using testing::OwnPidfd;
using testing::TestCopyEngineOp;
using testing::throwsError;

namespace {

// Both sides of the transfers, in one process: its flag segment is also its peer's.
struct Node {
  FakeCuda fake;
  CudaOps cudaOps{16};
  ProgressThread thread;
  testing::Ends ended;
  std::vector<std::string> notices;
  CopyEngineContext context{
      cudaOps, thread, 4, 64ull << 20,
      [this](const std::shared_ptr<Op>& op, const Status& status) {
        ended.emplace_back(op, status);
      },
      [this](Peer&, std::string data) { notices.push_back(std::move(data)); }};
  OwnPidfd self;
  Peer peer = testing::ownPeer("this process");
  cuda::RemoteFlagSegment theirs{self.fd, context.flags().ref(), "this process"};
  cuda::Stream user{0, cuda::Stream::OnDestroy::kRelease};  // the callers' stream
  DirectProtocol direct{context};
  StagedProtocol staged{context, direct, kStagingMinBytes};
  EagerProtocol eager{context, 4096};

  cuda::FlagSegment& flags() { return context.flags(); }
  // How the op ended, once; null if it has not.
  const Status* endOf(const Op& op) const { return testing::endOf(ended, op); }
};

// An op as the copy engine posts it, its buffer in (fake) device memory.
struct Posted {
  cuda::DeviceMemory memory;
  std::shared_ptr<Op> op = std::make_shared<Op>();

  Posted(Node& node, OpKind kind, uint64_t bytes, uint64_t id, uint64_t seq = 0)
      : memory(0, bytes) {
    op->id = id;
    op->seq = seq;
    op->groupId = 7;
    op->request.kind = kind;
    op->request.peer = kind == OpKind::kSend ? 1 : 0;
    op->request.tag = 3;
    op->request.buffer.data = reinterpret_cast<void*>(memory.address());
    op->request.buffer.bytes = bytes;
    op->request.buffer.device = 0;
    op->config = std::make_shared<GroupConfig>(GroupConfig{"g", 0, 2});
    CopyEngineOp state;
    state.queued = node.flags().acquire();
    if (kind == OpKind::kSend) {
      state.produced = std::make_shared<cuda::Event>(0);
      state.copied = std::make_shared<cuda::Event>(0);
      state.produced->record(node.user.handle());
    } else {
      state.done = node.flags().acquire(kDoneSpan);
      state.ready = node.flags().acquire();
    }
    op->channelOp = std::make_shared<TestCopyEngineOp>(std::move(state));
  }
  char* bytes() { return reinterpret_cast<char*>(memory.address()); }
  const CopyEngineOp& state() const { return copyEngineOp(*op); }
};

void fill(Posted& posted, char seed) {
  for (uint64_t i = 0; i < posted.op->request.buffer.bytes; ++i) {
    posted.bytes()[i] = static_cast<char>(seed + i % 251);
  }
}

bool same(Posted& a, Posted& b) {
  return std::memcmp(a.bytes(), b.bytes(), a.op->request.buffer.bytes) == 0;
}

// The receiver arms `recv` (with `ring`: the staging ring it offers) and the sender reads the
// clear-to-send.
ClearedSend clear(Node& node, Posted& send, Posted& recv, const std::string& ring = {}) {
  const std::string data =
      node.direct.arm(recv.op, node.peer, node.direct.exportDestination(*recv.op, node.peer),
                      ring, "");
  ClearanceData read = readClearance(data);
  if (read.ring) node.staged.learn(node.peer, std::move(read.ring));
  return ClearedSend{send.op, &node.peer, &node.theirs, read.header, std::move(read.destination)};
}

TEST(directCopyWaitsForReady,
     "copy engine in-process: a direct send lands once its recv is ready") {
  Node node;
  Posted send(node, OpKind::kSend, 4096, 1);
  Posted recv(node, OpKind::kRecv, 4096, 2);
  fill(send, 'a');
  node.direct.submit(clear(node, send, recv));
  CHECK(node.flags().isSet(send.state().queued));
  CHECK(node.flags().isSet(recv.state().queued));  // the sender's CPU wrote the receiver's
  CHECK(!node.direct.progress());
  CHECK(!same(send, recv));  // parked on the receiver's `ready`
  node.flags().set(recv.state().ready);
  node.fake.run();
  CHECK(same(send, recv));
  CHECK(node.flags().wordOf(recv.state().done) == recv.state().done.value + kCopied);
  CHECK(node.direct.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*send.op)->ok());
  CHECK(node.endOf(*recv.op) && node.endOf(*recv.op)->ok());
  CHECK(send.op->outstanding == 0 && recv.op->outstanding == 0);
  CHECK(!node.direct.busy());
}

TEST(directCancelUnparks, "copy engine in-process: a cancelled direct send lets its copy run") {
  Node node;
  Posted send(node, OpKind::kSend, 256, 1);
  Posted recv(node, OpKind::kRecv, 256, 2);
  fill(send, 'b');
  node.direct.submit(clear(node, send, recv));
  node.direct.cancel(*send.op);
  CHECK(node.flags().isSet(recv.state().ready));  // forced: no stream stays parked on it
  node.fake.run();
  CHECK(same(send, recv));
  node.direct.cancel(*send.op);  // unparked already: stays so
  CHECK(node.direct.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*recv.op));
}

TEST(directQueueFailureGivesUp,
     "copy engine in-process: a send that cannot queue its copy gives up") {
  Node node;
  Posted send(node, OpKind::kSend, 256, 1);
  Posted recv(node, OpKind::kRecv, 256, 2);
  node.fake.failNext("cuMemcpyAsync");
  ClearedSend cleared = clear(node, send, recv);
  CHECK(throwsError([&] { node.direct.submit(std::move(cleared)); }, "CUDA cuMemcpyAsync failed"));
  CHECK(send.op->outstanding == 0);
  CHECK(node.flags().isSet(recv.state().queued));
  CHECK(node.flags().wordOf(recv.state().done) == recv.state().done.value + kSenderGaveUp);
  node.fake.run();
  CHECK(node.direct.progress());
  const Status* status = node.endOf(*recv.op);
  CHECK(status && !status->ok() && status->message.find("the sender gave up") != std::string::npos);
  CHECK(!node.endOf(*send.op));  // its caller has the error
}

TEST(directDeviceFailure, "copy engine in-process: a device failure ends a queued send failed") {
  Node node;
  Posted send(node, OpKind::kSend, 256, 1);
  Posted recv(node, OpKind::kRecv, 256, 2);
  node.direct.submit(clear(node, send, recv));
  node.fake.failDevice();
  CHECK(node.direct.progress());
  const Status* status = node.endOf(*send.op);
  CHECK(status && status->code == StatusCode::kChannel);
  CHECK(status && status->message.find("send on rank 0 to rank 1") != std::string::npos);
  CHECK(status && status->message.find("fake CUDA error 700") != std::string::npos);
  CHECK(!node.endOf(*recv.op));  // its `done` word is still to come
}

TEST(directRecvAbandoned,
     "copy engine in-process: an armed recv ends when its sender gives up or fails") {
  Node node;
  Posted send(node, OpKind::kSend, 64, 1);
  Posted gaveUp(node, OpKind::kRecv, 64, 2);
  Posted failed(node, OpKind::kRecv, 64, 3);
  clear(node, send, gaveUp);
  ClearedSend queued = clear(node, send, failed);
  node.direct.cancel(*gaveUp.op);  // a recv's cancel leaves it armed
  CHECK(!node.endOf(*gaveUp.op));
  node.direct.partnerGaveUp(*gaveUp.op);
  const Status* status = node.endOf(*gaveUp.op);
  CHECK(status && status->code == StatusCode::kAborted);
  CHECK(gaveUp.op->outstanding == 0);
  node.direct.submit(std::move(queued));
  node.direct.peerFailed(node.peer, Status::failure(StatusCode::kPeerFailure, "peer gone"));
  status = node.endOf(*failed.op);
  CHECK(status && status->code == StatusCode::kPeerFailure);
  CHECK(node.flags().isSet(failed.state().ready));  // the queued send to it was unparked
  node.fake.run();
  CHECK(node.direct.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*send.op)->ok());
}

TEST(stagedThroughASlot, "copy engine in-process: a staged send goes through the receiver's slot") {
  Node node;
  Posted send(node, OpKind::kSend, kStagingMinBytes, 1);
  Posted recv(node, OpKind::kRecv, kStagingMinBytes, 2);
  fill(send, 'c');
  const std::string ring = node.staged.ringData(node.peer, *recv.op);
  CHECK(!ring.empty());
  node.staged.start(clear(node, send, recv, ring));
  // Not ready, a slot free: the copy goes to the slot, and the receiver is told which.
  CHECK(node.notices.size() == 1);
  CHECK(node.flags().isSet(send.state().queued));
  CHECK(!node.flags().isSet(recv.state().queued));  // the receiver's own, once it copies out
  node.fake.run();
  node.staged.onNotice(node.peer, node.notices[0]);
  CHECK(node.flags().isSet(recv.state().queued));
  CHECK(!same(send, recv));  // the copy out waits for `ready`
  node.flags().set(recv.state().ready);
  node.fake.run();
  CHECK(same(send, recv));
  CHECK(node.staged.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*send.op)->ok());
  CHECK(node.endOf(*recv.op) && node.endOf(*recv.op)->ok());
  CHECK(!node.staged.busy() && !node.direct.busy());
  std::map<std::string, int64_t> stats;
  node.staged.addStats(stats);
  CHECK(stats["staged_sends"] == 1 && stats["staged_recvs"] == 1);
}

TEST(stagedHeldPeerFails, "copy engine in-process: a send held for a slot fails with its peer") {
  Node node;
  std::vector<std::unique_ptr<Posted>> ops;
  for (uint64_t i = 0; i < 6; ++i) {
    ops.push_back(std::make_unique<Posted>(node, i % 2 ? OpKind::kRecv : OpKind::kSend,
                                           kStagingMinBytes, i));
  }
  const std::string ring = node.staged.ringData(node.peer, *ops[1]->op);
  for (size_t i = 0; i < 6; i += 2) node.staged.start(clear(node, *ops[i], *ops[i + 1], ring));
  CHECK(node.notices.size() == 2);  // the third is held
  node.staged.peerFailed(node.peer, Status::failure(StatusCode::kPeerFailure, "peer gone"));
  const Status* status = node.endOf(*ops[4]->op);
  CHECK(status && status->code == StatusCode::kPeerFailure && status->message == "peer gone");
  CHECK(ops[4]->op->outstanding == 0);
  CHECK(!node.endOf(*ops[0]->op) && !node.endOf(*ops[2]->op));  // queued: they run on
  node.staged.dropPeer(processKeyOf(node.peer));
  CHECK(node.staged.ringData(node.peer, *ops[1]->op) != ring);  // a new ring for a new peer
  node.fake.run();
  CHECK(node.staged.progress());
  CHECK(node.endOf(*ops[0]->op) && node.endOf(*ops[2]->op));
}

TEST(stagedReadyGoesDirect,
     "copy engine in-process: a stageable send to a ready recv goes direct") {
  Node node;
  Posted send(node, OpKind::kSend, kStagingMinBytes, 1);
  Posted recv(node, OpKind::kRecv, kStagingMinBytes, 2);
  fill(send, 'd');
  node.flags().set(recv.state().ready);
  node.staged.start(clear(node, send, recv, node.staged.ringData(node.peer, *recv.op)));
  CHECK(node.notices.empty());
  node.fake.run();
  CHECK(same(send, recv));
  CHECK(node.direct.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*recv.op));
}

TEST(stagedHeldSends, "copy engine in-process: sends held for a slot go staged, direct, or fail") {
  Node node;
  std::vector<std::unique_ptr<Posted>> sends;
  std::vector<std::unique_ptr<Posted>> recvs;
  for (uint64_t i = 0; i < 5; ++i) {
    sends.push_back(std::make_unique<Posted>(node, OpKind::kSend, kStagingMinBytes, 10 + i));
    recvs.push_back(std::make_unique<Posted>(node, OpKind::kRecv, kStagingMinBytes, 20 + i));
    fill(*sends.back(), static_cast<char>('e' + i));
  }
  const std::string ring = node.staged.ringData(node.peer, *recvs[0]->op);
  for (size_t i = 0; i < 5; ++i) node.staged.start(clear(node, *sends[i], *recvs[i], ring));
  // Two slots: the first two staged, the other three held until a slot's last use is emptied.
  CHECK(node.notices.size() == 2);
  CHECK(node.staged.describeWait(*sends[2]->op).find("held for a staging slot") !=
        std::string::npos);
  // One held send fails: its receiver's words say the sender gave up.
  node.staged.cancel(*sends[4]->op);
  const Status* cancelled = node.endOf(*sends[4]->op);
  CHECK(cancelled && cancelled->message.find("failed before its copy") != std::string::npos);
  CHECK(node.flags().wordOf(recvs[4]->state().done) ==
        recvs[4]->state().done.value + kSenderGaveUp);
  // Its receiver turns ready: the next goes direct.
  node.flags().set(recvs[3]->state().ready);
  CHECK(node.staged.advanceHeld());
  node.fake.run();
  CHECK(same(*sends[3], *recvs[3]));
  // The first slot emptied: the next held send takes it.
  node.fake.run();
  node.staged.onNotice(node.peer, node.notices[0]);
  node.flags().set(recvs[0]->state().ready);
  node.fake.run();
  CHECK(same(*sends[0], *recvs[0]));
  CHECK(node.staged.advanceHeld());
  CHECK(node.notices.size() == 3);
  node.staged.onNotice(node.peer, node.notices[1]);
  node.staged.onNotice(node.peer, node.notices[2]);
  node.flags().set(recvs[1]->state().ready);
  node.flags().set(recvs[2]->state().ready);
  node.fake.run();
  CHECK(same(*sends[1], *recvs[1]) && same(*sends[2], *recvs[2]));
  node.staged.progress();
  node.direct.progress();
  for (size_t i = 0; i < 4; ++i) {
    CHECK(node.endOf(*sends[i]->op) && node.endOf(*sends[i]->op)->ok());
    CHECK(node.endOf(*recvs[i]->op) && node.endOf(*recvs[i]->op)->ok());
  }
  CHECK(node.endOf(*recvs[4]->op) && !node.endOf(*recvs[4]->op)->ok());  // its sender gave up
}

// The sender's lane opened with the receiver's eager ring, as a clear-to-send opens it.
void openLane(Node& node, Posted& recv, Posted& send) {
  const std::string ring = node.eager.ringData(*recv.op, node.peer);
  CHECK(!ring.empty());
  node.eager.open(*send.op, node.peer, RemoteStagingRing::read(ring.data(), ring.size()),
                  node.theirs);
}

// The caller's post of an eager send (CopyEngineChannel::prepare), then its announcement.
std::string postEager(Node& node, Posted& send) {
  CopyEngineOp& state = copyEngineOp(*send.op);
  const LaneKey lane = CopyEngineContext::laneOf(*send.op, processKeyOf(node.peer));
  state.eager = node.eager.lanes().push(*send.op, lane, *state.produced, *state.copied);
  CHECK(state.eager.has_value());
  node.eager.prepareSend(send.op, node.peer);
  return node.eager.announce(*send.op);
}

TEST(eagerSendAndCopyOut,
     "copy engine in-process: an eager send lands in its slot, its recv copies it out") {
  Node node;
  Posted send(node, OpKind::kSend, 1000, 1);
  Posted recv(node, OpKind::kRecv, 1000, 2);
  fill(send, 'f');
  openLane(node, recv, send);
  const std::string notice = postEager(node, send);
  node.fake.run();  // the copy into the slot ran at the post
  CHECK(node.eager.arm(recv.op, node.peer, notice).empty());
  CHECK(node.flags().isSet(recv.state().queued));
  node.eager.cleared(send.op);
  // A step its table does not list is refused, naming the op: a second clearance.
  CHECK(throwsError([&] { node.eager.cleared(send.op); },
                    "send on rank 0 to rank 1 (group 'g', tag 3, [] (0 B)): its eager send cannot "
                    "go from queued, cleared to queued, cleared"));
  CHECK(!same(send, recv));
  node.flags().set(recv.state().ready);
  node.fake.run();
  CHECK(same(send, recv));
  CHECK(node.eager.progress());
  CHECK(node.endOf(*send.op) && node.endOf(*send.op)->ok());
  CHECK(node.endOf(*recv.op) && node.endOf(*recv.op)->ok());
  CHECK(!node.eager.busy());
}

TEST(eagerLandsBeforeClearance,
     "copy engine in-process: an eager send that lands first ends at its clearance") {
  Node node;
  Posted send(node, OpKind::kSend, 64, 1);
  Posted recv(node, OpKind::kRecv, 64, 2);
  openLane(node, recv, send);
  postEager(node, send);
  node.fake.run();
  CHECK(node.eager.progress());
  CHECK(!node.endOf(*send.op));  // landed: it waits for its receiver's clearance
  CHECK(send.op->outstanding == 0 && !node.eager.busy());
  node.eager.cancel(*send.op);  // nothing of it is held
  node.eager.cleared(send.op);
  CHECK(node.endOf(*send.op) && node.endOf(*send.op)->ok());
}

TEST(eagerHeldSends,
     "copy engine in-process: a held eager send waits for its slot, or fails first") {
  Node node;
  Posted recv(node, OpKind::kRecv, 64, 1);
  Posted first(node, OpKind::kSend, 64, 2, 0);
  Posted held(node, OpKind::kSend, 64, 3, kEagerSlots);           // slot 0, use 1
  Posted cancelled(node, OpKind::kSend, 64, 4, 2 * kEagerSlots);  // slot 0, use 2
  fill(held, 'h');
  const std::string ring = node.eager.ringData(*recv.op, node.peer);
  const auto remote = RemoteStagingRing::read(ring.data(), ring.size());
  node.eager.open(*first.op, node.peer, remote, node.theirs);
  const std::string firstNotice = postEager(node, first);
  // The receiver's wait() claimed uses 1 and 2 of slot 0 eager (their way words).
  const cuda::Flag way = remote->wayOf(0);
  node.flags().set(cuda::Flag{way.index, way.value + 2});
  postEager(node, held);
  CHECK(copyEngineOp(*held.op).eager->after == std::optional<uint32_t>(0));
  CHECK(node.eager.describeWait(*held.op).find("held until its receiver empties") !=
        std::string::npos);
  node.eager.cleared(held.op);
  node.fake.run();
  CHECK(node.eager.progress());  // the first landed; the held one waits for use 0's copy out
  CHECK(!node.endOf(*held.op));
  node.flags().set(cuda::Flag{way.index, way.value + 4});
  postEager(node, cancelled);
  node.eager.cancel(*cancelled.op);
  const Status* status = node.endOf(*cancelled.op);
  CHECK(status && status->message.find("before its eager slot was emptied") != std::string::npos);
  // The receiver copies use 0 out: the held send's copy is queued, and it ends (cleared).
  node.eager.arm(recv.op, node.peer, firstNotice);
  node.flags().set(recv.state().ready);
  node.fake.run();
  CHECK(node.eager.progress());
  node.fake.run();
  node.eager.progress();
  CHECK(node.flags().isSet(copyEngineOp(*held.op).queued));
  CHECK(node.endOf(*held.op) && node.endOf(*held.op)->ok());
  CHECK(held.op->outstanding == 0);
}

TEST(eagerHeldRecvs,
     "copy engine in-process: a recv of a held send waits for the slot, or gives up") {
  Node node;
  Posted send(node, OpKind::kSend, 64, 1);
  Posted waits(node, OpKind::kRecv, 64, 2);
  Posted ends(node, OpKind::kRecv, 64, 3);
  openLane(node, waits, send);
  const std::shared_ptr<StagingRing> ring =
      node.eager.lanes().ring(CopyEngineContext::laneOf(*waits.op, processKeyOf(node.peer)));
  const StagedSlot slot{2, 0};
  node.eager.arm(waits.op, node.peer, toBytes(EagerNotice{0, slot.slot, slot.use, 1}));
  node.eager.arm(ends.op, node.peer, toBytes(EagerNotice{0, 3, 0, 1}));
  CHECK(!node.eager.progress());
  CHECK(!node.flags().isSet(waits.state().queued));  // no copy out waits for unqueued work
  std::memcpy(reinterpret_cast<char*>(ring->slotAddress(slot.slot)), "held", 5);
  node.flags().set(ring->full(slot));
  node.flags().set(waits.state().ready);
  ends.op->state = OpState::kEnded;  // failed before its slot filled
  CHECK(node.eager.progress());      // the fake ran the copy out as it was queued
  CHECK(!node.eager.busy());
  CHECK(std::string(waits.bytes()) == "held");
  CHECK(node.endOf(*waits.op) && node.endOf(*waits.op)->ok());
  const Status* status = node.endOf(*ends.op);
  CHECK(status && status->message.find("the sender gave up") != std::string::npos);
  // A slot whose recv did not match is emptied once its held send fills it.
  const StagedSlot other{4, 0};
  node.eager.discard(node.peer, toBytes(EagerNotice{0, other.slot, other.use, 1}),
                     CopyEngineContext::laneOf(*waits.op, processKeyOf(node.peer)));
  CHECK(!node.eager.emptyHeldSlots());
  node.flags().set(ring->full(other));
  CHECK(node.eager.emptyHeldSlots());
  node.fake.run();
  CHECK(node.flags().isSet(ring->emptied(other)));
}

}  // namespace
