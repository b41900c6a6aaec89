// The collective protocol (collective lanes) driven in-process on the fake CUDA driver
// (fake_cuda.h): two sides, each with its own flag segment, lanes and protocol as two processes
// have, in this one process, each the other's peer through a pidfd of this process. Each test
// posts a piece's two halves as the channel does (CollectiveProtocol::post) and checks who
// queued the copy, the bytes, both `done` words and how each op ended.

#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/CudaOps.h"
#include "engine/GroupConfig.h"
#include "engine/PeerAddress.h"
#include "engine/ProgressThread.h"
#include "engine/channels/copy_engine/CollectiveProtocol.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/cuda/DeviceMemory.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/Stream.h"
#include "engine/cuda/StreamMemoryOps.h"

#include "check.h"
#include "fake_cuda.h"
#include "test_copy_engine_op.h"
#include "test_peer.h"

using namespace smfree::engine;
using testing::FakeCuda;
using testing::TestCopyEngineOp;
using testing::throwsError;

namespace {

// One side: what a process holds for collective lanes.
struct Side {
  std::string key;
  CudaOps cudaOps{16};
  ProgressThread thread;
  testing::Ends ended;
  size_t notices = 0;
  CopyEngineContext context{cudaOps, thread, 4, 64ull << 20,
                            [this](const std::shared_ptr<Op>& op, const Status& status) {
                              ended.emplace_back(op, status);
                            },
                            [this](Peer&, std::string) { ++notices; }};
  CollectiveProtocol collective;
  cuda::Stream user{0, cuda::Stream::OnDestroy::kRelease};  // its caller's stream
  PeerAddress address;  // what its peer knows of it

  Side(std::string name, bool enabled = true)
      : key(std::move(name)), collective(context, key, 4, enabled) {
    address.processKey = key;
    address.pid = getpid();
    address.flagSegment = flags().ref();
  }

  cuda::FlagSegment& flags() { return context.flags(); }
  // How the op ended through this side's protocol, once; null if it has not.
  const Status* endOf(const Op& op) const { return testing::endOf(ended, op); }
  int64_t stat(const char* name) const {
    std::map<std::string, int64_t> stats;
    collective.lanes().addStats(stats);
    return stats[name];
  }
};

// Two sides, each the other's peer.
struct Pair {
  FakeCuda fake;
  Side sender{"sending process"};
  Side receiver{"receiving process"};
  Peer senderPeer = testing::ownPeer(sender.key);  // the receiver's peer
  Peer receiverPeer = testing::ownPeer(receiver.key);

  Side& other(const Side& side) { return &side == &sender ? receiver : sender; }
  Peer& peerOf(const Side& side) { return &side == &sender ? receiverPeer : senderPeer; }
};

PostOptions optionsTo(const Side& peer) {
  PostOptions options;
  options.timeout = std::chrono::milliseconds(1000);
  options.peerKey = peer.key;
  options.peer = &peer.address;
  return options;
}

// Holds back what a side's caller's stream is given after it (the work before a post).
struct Gate {
  Side& side;
  cuda::Flag word = side.flags().acquire();

  explicit Gate(Side& side) : side(side) {
    cuda::waitAtLeast(side.user.handle(), side.flags().cudaAddress(word.index), word.value,
                      "gate");
  }
  void open(FakeCuda& fake) {
    side.flags().set(word);
    fake.run();
  }
};

// One half of a collective's piece, as the channel prepares it before it posts it to its lane
// (CopyEngineChannel::prepare), its buffer in (fake) device memory.
struct Half {
  Side& side;
  cuda::DeviceMemory memory;
  std::shared_ptr<Op> op = std::make_shared<Op>();

  Half(Side& side, OpKind kind, uint64_t bytes, uint64_t seq, const std::string& dtype = "float32")
      : side(side), memory(0, bytes) {
    op->id = seq + 1;
    op->seq = seq;
    op->groupId = 7;
    op->request.kind = kind;
    op->request.peer = kind == OpKind::kSend ? 1 : 0;
    op->request.tag = kCollectiveTag;
    op->request.buffer.data = reinterpret_cast<void*>(memory.address());
    op->request.buffer.bytes = bytes;
    op->request.buffer.device = 0;
    op->request.buffer.memory = MemoryKind::kCuda;
    op->request.desc.bytes = bytes;
    op->request.desc.dtype = dtype;
    op->request.stream = side.user.handle();
    op->config = std::make_shared<GroupConfig>(GroupConfig{"g", 0, 2});
    cuda::FlagSegment& flags = side.flags();
    CopyEngineOp state;
    state.queued = flags.acquire();
    state.produced = std::make_shared<cuda::Event>(0);
    if (kind == OpKind::kSend) {
      state.copied = std::make_shared<cuda::Event>(0);
    } else {
      state.done = flags.acquire(kDoneSpan);
      state.ready = flags.acquire();
      side.cudaOps.writeFromStream(*op, state.ready);
    }
    state.produced->record(side.user.handle());
    op->channelOp = std::make_shared<TestCopyEngineOp>(std::move(state));
  }

  // Its post to its lane: what CollectiveProtocol::post decided (null: rendezvous).
  CollectivePiece* post(Pair& pair) {
    const PostOptions options = optionsTo(pair.other(side));
    CHECK(side.collective.takes(*op, options));
    side.collective.post(*op, options, copyEngineOp(*op));
    return state().collective.get();
  }
  CollectiveRole role() const {
    return state().collective ? state().collective->role : CollectiveRole::kRendezvous;
  }
  CopyEngineOp& state() const { return copyEngineOp(*op); }
  char* bytes() { return reinterpret_cast<char*>(memory.address()); }
  void fill(char seed) {
    for (uint64_t i = 0; i < op->request.buffer.bytes; ++i) {
      bytes()[i] = static_cast<char>(seed + i % 251);
    }
  }
  uint32_t doneWord() const { return side.flags().wordOf(state().done); }
  bool copied() const { return doneWord() == state().done.value + kCopied; }
  bool gaveUp() const { return doneWord() == state().done.value + kSenderGaveUp; }
  // Its op failed (the op control's end): the lane's part of Channel::ended.
  void failed() {
    op->state = OpState::kEnded;
    side.collective.ended(*op);
  }
};

bool same(Half& a, Half& b) {
  return std::memcmp(a.bytes(), b.bytes(), a.op->request.buffer.bytes) == 0;
}

// The ops reached their match and clearance (armRecv, startSend): they move until `done`.
void moveBoth(Half& send, Half& recv) {
  send.side.collective.move(send.op);
  recv.side.collective.move(recv.op);
}

void checkEndedOk(Half& half) {
  const Status* status = half.side.endOf(*half.op);
  CHECK(status && status->ok());
  CHECK(half.op->outstanding == 0);
}

TEST(collectiveTakes, "collective protocol: it takes uncaptured CUDA collective pieces only") {
  Pair pair;
  Side disabled{"disabled", false};
  Half send(pair.sender, OpKind::kSend, 64, 0);
  PostOptions options = optionsTo(pair.receiver);
  CHECK(pair.sender.collective.takes(*send.op, options));
  CHECK(!disabled.collective.takes(*send.op, options));  // SMFREE_COLLECTIVE_LANES=0
  options.peerKey.clear();
  CHECK(!pair.sender.collective.takes(*send.op, options));  // no known peer
  options = optionsTo(pair.receiver);
  send.op->request.tag = 0;
  CHECK(!pair.sender.collective.takes(*send.op, options));  // a user's tag
  send.op->request.tag = kCollectiveTag;
  send.op->request.buffer.bytes = 0;
  CHECK(!pair.sender.collective.takes(*send.op, options));  // nothing to copy
}

TEST(collectiveSendFirstRecvPulls,
     "collective protocol: a send posted first publishes, its recv's post pulls the bytes") {
  Pair pair;
  Gate produced(pair.sender);  // the sender's stream has not produced the bytes yet
  Half first(pair.sender, OpKind::kSend, 4096, 0);
  first.fill('a');
  CHECK(first.post(pair) != nullptr);
  CHECK(first.role() == CollectiveRole::kFirst);
  CHECK(pair.sender.flags().isSet(first.state().queued));  // its wait() waits for `done` at once
  CHECK(first.state().done.value != 0 && first.state().producedWord.value != 0);
  CHECK(pair.fake.calls("cuMemcpyAsync") == 0);
  CHECK(pair.sender.collective.describeWait(*first.op).find("posted first") != std::string::npos);

  Half recv(pair.receiver, OpKind::kRecv, 4096, 0);
  CHECK(recv.post(pair) != nullptr);
  CHECK(recv.role() == CollectiveRole::kSecond);
  CHECK(pair.receiver.flags().isSet(recv.state().queued));
  CHECK(pair.fake.calls("cuMemcpyAsync") == 1);  // queued at its post, on the receiver's side
  CHECK(pair.receiver.collective.describeWait(*recv.op).find("copy queued at its post") !=
        std::string::npos);
  CHECK(recv.state().collective->mapped.has_value());  // the sender's buffer, mapped here
  pair.fake.run();
  CHECK(!same(first, recv));  // the pull waits for the sender's `produced` word
  CHECK(!first.copied() && !recv.copied());

  moveBoth(first, recv);
  CHECK(!pair.sender.collective.progress() && !pair.receiver.collective.progress());
  CHECK(first.op->outstanding == 1 && recv.op->outstanding == 1);
  produced.open(pair.fake);
  CHECK(same(first, recv));
  CHECK(first.copied() && recv.copied());  // the copy wrote both sides' `done` words
  CHECK(pair.sender.collective.progress() && pair.receiver.collective.progress());
  checkEndedOk(first);
  checkEndedOk(recv);
  CHECK(!pair.sender.collective.busy() && !pair.receiver.collective.busy());
  CHECK(pair.sender.stat("collective_first") == 1 && pair.sender.stat("collective_second") == 0);
  CHECK(pair.receiver.stat("collective_second") == 1 &&
        pair.receiver.stat("collective_first") == 0);
  pair.receiver.collective.lanes().finished(*recv.state().collective);  // the op's release
  CHECK(!recv.state().collective->mapped.has_value());
  CHECK(pair.sender.notices == 0 && pair.receiver.notices == 0);
}

TEST(collectiveRecvFirstSendPushes,
     "collective protocol: a recv posted first publishes, its send's post pushes the bytes") {
  Pair pair;
  Gate bufferFree(pair.receiver);  // the receiver's stream still uses its buffer
  Half recv(pair.receiver, OpKind::kRecv, 1000, 0);
  CHECK(recv.post(pair) != nullptr);
  CHECK(recv.role() == CollectiveRole::kFirst);
  CHECK(pair.receiver.flags().isSet(recv.state().queued));
  Gate producing(pair.sender);  // the sender's stream has not produced its bytes
  Half send(pair.sender, OpKind::kSend, 1000, 0);
  send.fill('p');
  CHECK(send.post(pair) != nullptr);
  CHECK(send.role() == CollectiveRole::kSecond);
  CHECK(pair.fake.calls("cuMemcpyAsync") == 1);
  moveBoth(send, recv);
  // The push waits for both: the receiver's `ready` word and its own stream's `produced`.
  bufferFree.open(pair.fake);
  CHECK(!same(send, recv) && !recv.copied());
  producing.open(pair.fake);
  CHECK(same(send, recv));
  CHECK(send.copied() && recv.copied());
  CHECK(pair.sender.collective.progress() && pair.receiver.collective.progress());
  checkEndedOk(send);
  checkEndedOk(recv);
}

TEST(collectiveLineReusesRecords,
     "collective protocol: a line's record serves its next use, in either order of posts") {
  Pair pair;
  std::vector<std::unique_ptr<Half>> sends;
  std::vector<std::unique_ptr<Half>> recvs;
  // Pieces 0 and 1 take records 0 and 1; piece kCollectiveRecords takes record 0 again.
  const uint64_t seqs[] = {0, 1, kCollectiveRecords};
  for (size_t i = 0; i < 3; ++i) {
    sends.push_back(std::make_unique<Half>(pair.sender, OpKind::kSend, 256, seqs[i]));
    recvs.push_back(std::make_unique<Half>(pair.receiver, OpKind::kRecv, 256, seqs[i]));
    sends.back()->fill(static_cast<char>('k' + i));
    const bool sendFirst = i != 1;
    Half& first = sendFirst ? *sends.back() : *recvs.back();
    Half& second = sendFirst ? *recvs.back() : *sends.back();
    CHECK(first.post(pair) && first.role() == CollectiveRole::kFirst);
    CHECK(second.post(pair) && second.role() == CollectiveRole::kSecond);
    pair.fake.run();
    CHECK(same(*sends.back(), *recvs.back()));
    CHECK(sends.back()->copied() && recvs.back()->copied());
    moveBoth(*sends.back(), *recvs.back());
  }
  CHECK(pair.sender.collective.progress() && pair.receiver.collective.progress());
  for (size_t i = 0; i < 3; ++i) {
    checkEndedOk(*sends[i]);
    checkEndedOk(*recvs[i]);
  }
  CHECK(pair.sender.stat("collective_first") == 2 && pair.sender.stat("collective_second") == 1);
}

TEST(collectiveUnpublishableGoesByRendezvous,
     "collective protocol: a side that cannot publish sends the piece by rendezvous for both") {
  Pair pair;
  // A dtype name longer than a record holds: the first side cannot write its half.
  const std::string longName(kCollectiveDtypeBytes, 'x');
  Half send(pair.sender, OpKind::kSend, 64, 0, longName);
  CHECK(send.post(pair) == nullptr);
  CHECK(!pair.sender.flags().isSet(send.state().queued));  // it waits for its clearance
  Half recv(pair.receiver, OpKind::kRecv, 64, 0, longName);
  CHECK(recv.post(pair) == nullptr);  // the record says rendezvous
  CHECK(!pair.receiver.flags().isSet(recv.state().queued));
  CHECK(pair.fake.calls("cuMemcpyAsync") == 0);
  CHECK(pair.sender.stat("collective_by_rendezvous") == 1);
  CHECK(pair.receiver.stat("collective_by_rendezvous") == 1);
  CHECK(pair.sender.stat("collective_first") == 0 && pair.receiver.stat("collective_second") == 0);
}

TEST(collectiveMismatchGoesByRendezvous,
     "collective protocol: halves whose sizes or dtypes differ go by rendezvous, no copy") {
  for (const bool sizes : {true, false}) {
    Pair pair;
    // Sizes: the send first; dtypes: the recv first.
    Half send(pair.sender, OpKind::kSend, 256, 0, sizes ? "float32" : "int32");
    Half recv(pair.receiver, OpKind::kRecv, sizes ? 128 : 256, 0);
    send.fill('m');
    Half& first = sizes ? send : recv;
    Half& second = sizes ? recv : send;
    CHECK(first.post(pair) && first.role() == CollectiveRole::kFirst);
    CHECK(second.post(pair) == nullptr);
    CHECK(!second.side.flags().isSet(second.state().queued));
    CHECK(second.side.stat("collective_by_rendezvous") == 1);
    CHECK(second.side.stat("collective_ipc_mappings") == 0);  // nothing of the first's mapped
    // The rendezvous's match fails both ops: the first's end holds nothing, no copy comes.
    first.failed();
    CHECK(!first.side.collective.busy());
    CHECK(first.op->outstanding == 0);
    pair.fake.run();
    CHECK(pair.fake.calls("cuMemcpyAsync") == 0);
    CHECK(!first.copied() && !first.gaveUp());
  }
}

TEST(collectiveFirstFailsBeforeItsPartner,
     "collective protocol: a first whose op fails before its partner posts cancels the copy") {
  Pair pair;
  Half send(pair.sender, OpKind::kSend, 64, 0);
  send.fill('c');
  CHECK(send.post(pair) && send.role() == CollectiveRole::kFirst);
  CollectiveProtocol::cancel(*send.op);  // a first has nothing queued to let go
  send.failed();
  CHECK(!pair.sender.collective.busy());
  CHECK(send.op->outstanding == 0);
  // Its partner, posted later, goes by rendezvous: its own match fails it.
  Half recv(pair.receiver, OpKind::kRecv, 64, 0);
  CHECK(recv.post(pair) == nullptr);
  pair.fake.run();
  CHECK(!same(send, recv));
  CHECK(pair.fake.calls("cuMemcpyAsync") == 0);
}

TEST(collectiveFirstFailsAfterItWasTaken,
     "collective protocol: a first whose op fails after its partner took it keeps its buffer "
     "until the copy ran") {
  Pair pair;
  Gate produced(pair.sender);
  Half send(pair.sender, OpKind::kSend, 512, 0);
  send.fill('t');
  CHECK(send.post(pair) && send.role() == CollectiveRole::kFirst);
  Half recv(pair.receiver, OpKind::kRecv, 512, 0);
  CHECK(recv.post(pair) && recv.role() == CollectiveRole::kSecond);
  recv.side.collective.move(recv.op);
  send.failed();  // e.g. its deadline passed
  CHECK(pair.sender.collective.busy());
  CHECK(send.op->outstanding == 1);  // the copy will still read its buffer
  send.failed();  // its end again (a cancel's): held once
  CHECK(send.op->outstanding == 1);
  CHECK(!pair.sender.collective.progress());
  produced.open(pair.fake);
  CHECK(same(send, recv));
  CHECK(pair.sender.collective.progress() && pair.receiver.collective.progress());
  checkEndedOk(send);  // its buffer is free: the op control already told its caller
  checkEndedOk(recv);
}

TEST(collectiveCancelReleasesTheSecondsCopy,
     "collective protocol: a cancelled second lets its copy run, and ends as the copy did") {
  Pair pair;
  Gate bufferFree(pair.receiver);  // a receiver whose stream never gets to its recv
  Half recv(pair.receiver, OpKind::kRecv, 300, 0);
  CHECK(recv.post(pair) && recv.role() == CollectiveRole::kFirst);
  Half send(pair.sender, OpKind::kSend, 300, 0);
  send.fill('r');
  CHECK(send.post(pair) && send.role() == CollectiveRole::kSecond);
  pair.sender.collective.move(send.op);
  CHECK(!send.copied());  // parked on the receiver's `ready`
  CollectiveProtocol::cancel(*send.op);
  CHECK(pair.receiver.flags().isSet(recv.state().ready));  // forced by the sender's CPU
  pair.fake.run();
  CHECK(same(send, recv));
  CHECK(send.copied() && recv.copied());
  CHECK(pair.sender.collective.progress());
  checkEndedOk(send);
  CollectiveProtocol::cancel(*recv.op);  // a first's cancel leaves its words alone
  CHECK(recv.copied());
  bufferFree.open(pair.fake);
}

TEST(collectivePeerFailsUnderASecond,
     "collective protocol: a second whose peer fails releases its copy, and ends as it ran") {
  Pair pair;
  Gate bufferFree(pair.receiver);
  Half recv(pair.receiver, OpKind::kRecv, 128, 0);
  CHECK(recv.post(pair) && recv.role() == CollectiveRole::kFirst);
  Half send(pair.sender, OpKind::kSend, 128, 0);
  send.fill('d');
  CHECK(send.post(pair) && send.role() == CollectiveRole::kSecond);
  pair.sender.collective.move(send.op);
  const Status gone = Status::failure(StatusCode::kPeerFailure, "peer gone");
  pair.sender.collective.peerFailed(pair.peerOf(pair.sender), gone);
  pair.sender.collective.peerFailed(pair.peerOf(pair.sender), gone);  // released already
  CHECK(pair.sender.collective.lanes().gone(pair.receiver.key));
  CHECK(!pair.sender.endOf(*send.op));  // its copy still reads its buffer
  CHECK(pair.sender.collective.busy());
  pair.fake.run();
  CHECK(same(send, recv));
  CHECK(pair.sender.collective.progress());
  checkEndedOk(send);
  bufferFree.open(pair.fake);
}

TEST(collectivePeerFailsUnderAFirst,
     "collective protocol: a first whose peer fails ends with the failure, and holds nothing") {
  Pair pair;
  Gate produced(pair.sender);
  Half moving(pair.sender, OpKind::kSend, 64, 0);
  Half ending(pair.sender, OpKind::kSend, 64, 1);
  Half recvMoving(pair.receiver, OpKind::kRecv, 64, 0);
  Half recvEnding(pair.receiver, OpKind::kRecv, 64, 1);
  for (Half* first : {&moving, &ending}) {
    CHECK(first->post(pair) && first->role() == CollectiveRole::kFirst);
  }
  for (Half* second : {&recvMoving, &recvEnding}) {
    CHECK(second->post(pair) && second->role() == CollectiveRole::kSecond);
  }
  pair.sender.collective.move(moving.op);
  const Status gone = Status::failure(StatusCode::kPeerFailure, "peer gone");
  pair.sender.collective.peerFailed(pair.peerOf(pair.sender), gone);
  // The dead peer's copy will never run: the moving op ends failed at once.
  const Status* status = pair.sender.endOf(*moving.op);
  CHECK(status && status->code == StatusCode::kPeerFailure && status->message == "peer gone");
  CHECK(moving.op->outstanding == 0);
  CHECK(!pair.sender.collective.busy());
  // One taken by the dead peer, whose op then fails, is not held for a copy that never comes.
  ending.failed();
  CHECK(!pair.sender.collective.busy() && ending.op->outstanding == 0);
  CHECK(!pair.sender.endOf(*ending.op));
  produced.open(pair.fake);
}

TEST(collectivePartnerCannotQueueTheCopy,
     "collective protocol: a second that cannot queue the copy fails its post, and its first "
     "ends told so") {
  // Each driver call the second's post queues with; the first's signal held back so that the
  // copy waits for it.
  for (const char* call :
       {"cuStreamWaitEvent", "cuStreamWaitValue32", "cuMemcpyAsync", "cuStreamWriteValue32"}) {
    Pair pair;
    Gate produced(pair.sender);
    Half send(pair.sender, OpKind::kSend, 96, 0);
    CHECK(send.post(pair) && send.role() == CollectiveRole::kFirst);
    Half recv(pair.receiver, OpKind::kRecv, 96, 0);
    pair.fake.failNext(call);
    CHECK(throwsError([&] { recv.post(pair); },
                      "could not queue its copy in a collective lane: CUDA " + std::string(call)));
    CHECK(!recv.state().collective);
    CHECK(pair.receiver.stat("collective_second") == 0);
    CHECK(send.gaveUp());  // the receiver's CPU told the sender's stream
    pair.sender.collective.move(send.op);
    CHECK(pair.sender.collective.progress());
    const Status* status = pair.sender.endOf(*send.op);
    CHECK(status && status->code == StatusCode::kAborted);
    CHECK(status && status->message.find("its partner could not queue the copy") !=
                        std::string::npos);
    CHECK(send.op->outstanding == 0);
    produced.open(pair.fake);
  }
}

TEST(collectiveMapFailureLeavesTheFirstCancellable,
     "collective protocol: a second that cannot map the first's buffer fails its post, the record "
     "stays the first's") {
  Pair pair;
  Half recv(pair.receiver, OpKind::kRecv, 64, 0);
  CHECK(recv.post(pair) && recv.role() == CollectiveRole::kFirst);
  Half send(pair.sender, OpKind::kSend, 64, 0);
  pair.fake.failNext("cuIpcOpenMemHandle");
  std::string error;
  try {
    send.post(pair);
  } catch (const Error& thrown) {
    error = thrown.what();
  }
  // Named: which op could not map, and the driver's call.
  CHECK(error.find(send.op->describe() + ": cannot map its partner's buffer") != std::string::npos);
  CHECK(error.find("cuIpcOpenMemHandle") != std::string::npos);
  CHECK(pair.fake.calls("cuMemcpyAsync") == 0);
  // Not taken: the first's failure cancels it, and nothing holds its buffer.
  recv.failed();
  CHECK(!pair.receiver.collective.busy() && recv.op->outstanding == 0);
}

}  // namespace
