// OpControl in-process: two ranks of one group, each an OpControl on fake peer links and fake
// channels (fake_engine.h), the control messages one sends delivered to the other by the test,
// in order, held or reordered. Each test walks ops through their states (OpState) and checks
// the messages, the calls made of the channel ops and what each caller was told.

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "engine/Failures.h"
#include "engine/GroupConfig.h"
#include "engine/OpControl.h"
#include "engine/PeerValue.h"
#include "engine/ProgressThread.h"

#include "check.h"
#include "fake_engine.h"

using namespace smfree::engine;
using testing::FakeChannelOp;
using testing::FakeChannels;
using testing::FakeLinks;

namespace {

constexpr int kGroupSize = 3;  // ranks 0 and 1 are the tests' two; rank 2 only a peer
constexpr auto kTimeout = std::chrono::milliseconds(60000);

// One process of the pair: its OpControl, the peers it reaches and what its channel ops and
// callers saw.
struct Rank {
  Rank(int rank, uint64_t firstOpId, bool joined = true) : rank(rank), nextId(firstOpId) {
    if (joined) join();
  }

  // Registers the group and connects its other ranks, as Group does.
  void join() {
    control.registerGroup(config);
    GroupState* group = control.findGroup(groupId);
    for (int other = 0; other < kGroupSize; ++other) {
      if (other == rank) continue;
      auto peer = std::make_unique<Peer>();
      peer->address.processKey = concat("key of rank ", other);
      peer->address.pid = 1000 + other;
      peer->address.hostname = concat("node", other);
      group->peers[other] = peer.get();
      peers[other] = std::move(peer);
    }
  }

  // The op as Group posts it: numbered in its (peer, tag) line, its channel's part made.
  std::shared_ptr<Op> make(OpKind kind, int peer, int tag, TensorDesc desc,
                           FakeChannelOp::Script script = {},
                           ChannelKind channel = ChannelKind::kUcx) {
    auto op = std::make_shared<Op>();
    op->id = nextId++;
    op->groupId = groupId;
    op->config = config;
    op->request.kind = kind;
    op->request.peer = peer;
    op->request.tag = tag;
    op->request.desc = std::move(desc);
    op->channel = channel;
    op->request.onComplete = [this, id = op->id](const Status& status, int) {
      told[id].push_back(status);
    };
    op->posted = Clock::now();
    op->deadline = op->posted + kTimeout;
    if (kind == OpKind::kSend) op->seq = nextSeq[{peer, tag, channel == ChannelKind::kCaptured}]++;
    op->channelOp = std::make_shared<FakeChannelOp>(calls, std::move(script));
    return op;
  }
  // An op of that channel, started.
  std::shared_ptr<Op> post(OpKind kind, int peer, int tag, ChannelKind channel) {
    auto op = make(kind, peer, tag, TensorDesc{16, "float32", "cpu", {4}}, {}, channel);
    control.startOp(op);
    return op;
  }
  std::shared_ptr<Op> send(int peer, int tag, TensorDesc desc, FakeChannelOp::Script script = {}) {
    auto op = make(OpKind::kSend, peer, tag, std::move(desc), std::move(script));
    control.startOp(op);
    return op;
  }
  std::shared_ptr<Op> recv(int peer, int tag, TensorDesc desc, FakeChannelOp::Script script = {}) {
    auto op = make(OpKind::kRecv, peer, tag, std::move(desc), std::move(script));
    control.startOp(op);
    return op;
  }
  // The channel is done with the op's buffer (Channel::Done).
  void finish(const std::shared_ptr<Op>& op, const Status& status = Status::success()) {
    op->outstanding = 0;
    control.onTransferDone(op, status);
  }
  // What the op's caller was told, if it was told once (and only once).
  const Status* outcome(const std::shared_ptr<Op>& op) const {
    auto it = told.find(op->id);
    return it == told.end() || it->second.size() != 1 ? nullptr : &it->second.front();
  }
  bool endedWith(const std::shared_ptr<Op>& op, StatusCode code, const std::string& part) const {
    const Status* status = outcome(op);
    if (!status) {
      std::printf("  op %llu: told %zu times\n", static_cast<unsigned long long>(op->id),
                  told.count(op->id) ? told.at(op->id).size() : 0);
      return false;
    }
    if (status->code == code && status->message.find(part) != std::string::npos) return true;
    std::printf("  op %llu ended %s: \"%s\", expected %s with \"%s\"\n",
                static_cast<unsigned long long>(op->id), toString(status->code),
                status->message.c_str(), toString(code), part.c_str());
    return false;
  }
  bool succeeded(const std::shared_ptr<Op>& op) const {
    const Status* status = outcome(op);
    return status && status->ok();
  }
  // The calls made of its channel ops since the last look.
  std::vector<std::string> takeCalls() {
    std::vector<std::string> out;
    out.swap(calls);
    return out;
  }
  // Marks the peer failed as PeerTable::fail does, and tells OpControl.
  void failPeer(int other, const std::string& why) {
    Peer& peer = *peers[other];
    peer.failed = true;
    peer.failure = concat("its peer process (", peer.describe(), ") failed: ", why);
    control.peerFailed(peer, why);
  }

  const int rank;
  std::shared_ptr<const GroupConfig> config =
      std::make_shared<const GroupConfig>(GroupConfig{"g", rank, kGroupSize});
  const uint64_t groupId = groupIdOf("g");
  FakeLinks links;
  FakeChannels channels;
  Failures failures;
  ProgressThread thread;
  OpControl control{*channels.all, links, failures, thread};
  std::map<int, std::unique_ptr<Peer>> peers;  // by group rank
  std::vector<std::string> calls;              // of its channel ops, in order
  std::map<uint64_t, std::vector<Status>> told;  // by op id: what its caller was told
  std::map<std::tuple<int, int, bool>, uint64_t> nextSeq;  // by (peer, tag, captured)
  uint64_t nextId;
};

TensorDesc floats(int64_t count) {
  return TensorDesc{static_cast<uint64_t>(count) * 4, "float32", "cpu", {count}};
}

template <typename T>
const T* as(const FakeLinks::Sent& sent) {
  return std::get_if<T>(&sent.message);
}

// Hands `message` to `to`'s OpControl, as the engine does with what arrives.
void handle(Rank& to, const ControlMessage& message) {
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ReadyToSend>) to.control.onReadyToSend(m);
        if constexpr (std::is_same_v<T, ClearToSend>) to.control.onClearToSend(m);
        if constexpr (std::is_same_v<T, Refusal>) to.control.onRefusal(m);
        if constexpr (std::is_same_v<T, Cancellation>) to.control.onCancellation(m);
      },
      message);
}

// Delivers what `from` sent so far to `to`'s rank, in order; what went to other ranks stays.
void deliver(Rank& from, Rank& to) {
  for (FakeLinks::Sent& sent : from.links.take()) {
    if (sent.peer == from.peers[to.rank].get()) {
      handle(to, sent.message);
    } else {
      from.links.sent.push_back(std::move(sent));
    }
  }
}

// The usual pair: rank 0 (op ids from 100) and rank 1 (from 200).
struct Pair {
  Rank a{0, 100};
  Rank b{1, 200};
};

bool same(std::vector<std::string> got, std::vector<std::string> expected, bool anyOrder = false) {
  if (anyOrder) {
    std::sort(got.begin(), got.end());
    std::sort(expected.begin(), expected.end());
  }
  if (got == expected) return true;
  std::printf("  calls:");
  for (const std::string& call : got) std::printf(" [%s]", call.c_str());
  std::printf("\n  expected:");
  for (const std::string& call : expected) std::printf(" [%s]", call.c_str());
  std::printf("\n");
  return false;
}

constexpr size_t kSendAnnounced = 1;  // Notice's alternatives
constexpr size_t kSendUnarmed = 2;
constexpr size_t kGroupClosed = 4;

}  // namespace

TEST(opControlSendBeforeRecv, "op control: a send posted before its recv is announced, cleared, moved and released") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4), {"slot 5"});
  CHECK(send->state == OpState::kWaiting);
  CHECK(p.a.control.opsAwaitingProgress() == 1);
  CHECK(same(p.a.takeCalls(), {"announce 100"}));
  CHECK(p.a.links.sent.size() == 1);
  const ReadyToSend* rts = as<ReadyToSend>(p.a.links.sent.at(0));
  CHECK(rts && rts->source == 0 && rts->tag == 3 && rts->seq == 0 && rts->sendId == 100 &&
        rts->desc.bytes == 16 && rts->channelData == "slot 5" && rts->group == p.a.groupId);

  deliver(p.a, p.b);
  CHECK(p.b.links.sent.empty());  // nothing to match yet
  CHECK(p.b.channels.ucx->notices == std::vector<size_t>{kSendAnnounced});

  auto recv = p.b.recv(0, 3, floats(4), {"", "buffer 9"});
  CHECK(recv->state == OpState::kMoving);
  CHECK(recv->source == 0);
  CHECK(same(p.b.takeCalls(), {"arm 200 slot 5", "start 200"}));
  CHECK(p.b.links.sent.size() == 1);
  const ClearToSend* cts = as<ClearToSend>(p.b.links.sent.at(0));
  CHECK(cts && cts->receiver == 1 && cts->sendId == 100 && cts->recvId == 200 &&
        cts->channelData == "buffer 9");

  deliver(p.b, p.a);
  CHECK(send->state == OpState::kMoving);
  CHECK(same(p.a.takeCalls(), {"start 100 buffer 9"}));
  CHECK(p.a.outcome(send) == nullptr);  // not told before the bytes moved

  p.a.finish(send);
  p.b.finish(recv);
  CHECK(p.a.succeeded(send) && p.b.succeeded(recv));
  CHECK(send->state == OpState::kReleased && recv->state == OpState::kReleased);
  CHECK(same(p.a.takeCalls(), {"end 100 ok", "release 100"}));
  CHECK(same(p.b.takeCalls(), {"end 200 ok", "release 200"}));
  CHECK(p.a.control.liveOps() == 0 && p.b.control.liveOps() == 0);
  CHECK(p.a.control.opsAwaitingProgress() == 0 && p.b.control.opsAwaitingProgress() == 0);
  CHECK(p.a.links.sent.empty() && p.b.links.sent.empty());
}

TEST(opControlRecvBeforeSend, "op control: a recv posted before its send matches on the announcement") {
  Pair p;
  auto recv = p.b.recv(0, 3, floats(4), {"", "buffer 9"});
  CHECK(recv->state == OpState::kWaiting);
  CHECK(p.b.takeCalls().empty() && p.b.links.sent.empty());

  auto send = p.a.send(1, 3, floats(4));
  deliver(p.a, p.b);
  CHECK(recv->state == OpState::kMoving);
  CHECK(same(p.b.takeCalls(), {"arm 200", "start 200"}));
  deliver(p.b, p.a);
  CHECK(same(p.a.takeCalls(), {"announce 100", "start 100 buffer 9"}));

  p.b.finish(recv);  // either side may end first
  CHECK(p.b.succeeded(recv) && p.a.outcome(send) == nullptr);
  p.a.finish(send);
  CHECK(p.a.succeeded(send));
  CHECK(p.a.control.liveOps() == 0 && p.b.control.liveOps() == 0);
}

TEST(opControlMatchesInPostingOrder, "op control: sends and recvs pair in posting order per (peer, tag), announcements in any order") {
  Pair p;
  auto onOtherTag = p.b.recv(0, 4, floats(1), {"", "into t"});
  auto r0 = p.b.recv(0, 3, floats(4), {"", "into r0"});
  auto r1 = p.b.recv(0, 3, floats(4), {"", "into r1"});
  auto r2 = p.b.recv(0, 3, floats(4), {"", "into r2"});
  auto s0 = p.a.send(1, 3, floats(4), {"s0"});
  auto s1 = p.a.send(1, 3, floats(4), {"s1"});
  auto s2 = p.a.send(1, 3, floats(4), {"s2"});
  auto t = p.a.send(1, 4, floats(1), {"t"});
  CHECK(s0->seq == 0 && s1->seq == 1 && s2->seq == 2 && t->seq == 0);
  p.a.takeCalls();

  // The announcements arrive out of order: s2, s0, t, s1.
  std::vector<FakeLinks::Sent> sent = p.a.links.take();
  CHECK(sent.size() == 4);
  for (size_t index : {2, 0, 3, 1}) handle(p.b, sent.at(index).message);

  CHECK(same(p.b.takeCalls(), {"arm 201 s0", "start 201", "arm 200 t", "start 200",
                               "arm 202 s1", "start 202", "arm 203 s2", "start 203"}));
  std::vector<std::pair<uint64_t, uint64_t>> pairs;  // (send, recv) of each clear-to-send
  for (const FakeLinks::Sent& cleared : p.b.links.sent) {
    if (const ClearToSend* cts = as<ClearToSend>(cleared)) {
      pairs.emplace_back(cts->sendId, cts->recvId);
    }
  }
  CHECK((pairs == std::vector<std::pair<uint64_t, uint64_t>>{{s0->id, r0->id},
                                                             {t->id, onOtherTag->id},
                                                             {s1->id, r1->id},
                                                             {s2->id, r2->id}}));
  deliver(p.b, p.a);
  CHECK(same(p.a.takeCalls(), {"start 100 into r0", "start 103 into t", "start 101 into r1",
                               "start 102 into r2"}));
}

TEST(opControlAnySourceRecv, "op control: an any-source recv matches the send announced and learns its rank") {
  Pair p;
  auto recv = p.b.make(OpKind::kRecv, kAnySource, 3, floats(4));
  int matched = -1;
  recv->request.onMatched = [&](int source) { matched = source; };
  p.b.control.startOp(recv);
  CHECK(recv->state == OpState::kWaiting);
  // Rank 2 fails meanwhile: a recv from any rank is not its op.
  p.b.failPeer(2, "the process exited");
  CHECK(recv->state == OpState::kWaiting);

  auto send = p.a.send(1, 3, floats(4));
  deliver(p.a, p.b);
  CHECK(matched == 0 && recv->source == 0 && recv->state == OpState::kMoving);
  deliver(p.b, p.a);
  p.a.finish(send);
  p.b.finish(recv);
  CHECK(p.a.succeeded(send) && p.b.succeeded(recv));
  CHECK(p.b.told.at(recv->id).size() == 1);
}

TEST(opControlZeroBytes, "op control: an empty send and recv end at the match, no bytes moved") {
  Pair p;
  auto send = p.a.send(1, 3, TensorDesc{0, "float32", "cpu", {0}});
  auto recv = p.b.recv(0, 3, TensorDesc{0, "float32", "cpu", {0}});
  deliver(p.a, p.b);
  CHECK(p.b.succeeded(recv));
  CHECK(same(p.b.takeCalls(), {"end 200 ok", "release 200"}));
  deliver(p.b, p.a);
  CHECK(p.a.succeeded(send));
  CHECK(same(p.a.takeCalls(), {"announce 100", "end 100 ok", "release 100"}));
  CHECK(p.a.control.liveOps() == 0 && p.b.control.liveOps() == 0);
}

TEST(opControlRefusesMismatch, "op control: a size or dtype mismatch fails both sides with the same clear status") {
  for (const bool dtype : {false, true}) {
    Pair p;
    auto recv = p.b.recv(0, 3, dtype ? TensorDesc{16, "int32", "cpu", {4}} : floats(8));
    auto send = p.a.send(1, 3, floats(4), {"slot 5"});
    deliver(p.a, p.b);
    const std::string expected =
        dtype ? "size or dtype mismatch in group 'g', tag 3: rank 0 sends float32[4] (16 B) to "
                "rank 1, which receives into int32[4] (16 B)"
              : "size or dtype mismatch in group 'g', tag 3: rank 0 sends float32[4] (16 B) to "
                "rank 1, which receives into float32[8] (32 B)";
    CHECK(p.b.endedWith(recv, StatusCode::kMismatch, expected));
    CHECK(same(p.b.takeCalls(), {"end 200 mismatch", "release 200"}));  // never armed
    // What the announcement held is given back.
    CHECK((p.b.channels.ucx->notices == std::vector<size_t>{kSendAnnounced, kSendUnarmed}));
    CHECK(p.b.links.sent.size() == 1);
    const Refusal* refusal = as<Refusal>(p.b.links.sent.at(0));
    CHECK(refusal && refusal->sendId == send->id && refusal->receiver == 1 &&
          refusal->code == StatusCode::kMismatch && refusal->reason == expected);
    deliver(p.b, p.a);
    CHECK(p.a.endedWith(send, StatusCode::kMismatch, expected));
    CHECK(same(p.a.takeCalls(), {"announce 100", "end 100 mismatch", "release 100"}));
    CHECK(p.a.control.liveOps() == 0 && p.b.control.liveOps() == 0);
  }
}

TEST(opControlWaitingSendExpires, "op control: a send past its deadline while announced fails, and its recv hears it gave up") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4), {"slot 5"});
  deliver(p.a, p.b);
  p.a.control.expireOps(send->deadline);
  CHECK(p.a.endedWith(send, StatusCode::kTimeout,
                      "send on rank 0 to rank 1 (group 'g', tag 3, float32[4] (16 B)) was not "
                      "matched by a recv within the group timeout of 60000 ms"));
  CHECK(same(p.a.takeCalls(), {"announce 100", "end 100 timeout", "release 100"}));
  CHECK(p.a.links.sent.size() == 1);
  const Cancellation* cancel = as<Cancellation>(p.a.links.sent.at(0));
  CHECK(cancel && cancel->source == 0 && cancel->tag == 3 && cancel->seq == 0 &&
        cancel->recvId == 0 && cancel->reason == p.a.outcome(send)->message);

  deliver(p.a, p.b);
  auto recv = p.b.recv(0, 3, floats(4));
  CHECK(p.b.endedWith(recv, StatusCode::kTimeout,
                      "recv on rank 1 from rank 0 (group 'g', tag 3, float32[4] (16 B)) failed: "
                      "the matching send gave up: send on rank 0"));
  CHECK(same(p.b.takeCalls(), {"end 200 timeout", "release 200"}));
  CHECK(p.b.links.sent.empty());  // the sender knows
  CHECK((p.b.channels.ucx->notices == std::vector<size_t>{kSendAnnounced, kSendUnarmed}));

  // The line kept its place: the next pair matches.
  auto next = p.a.send(1, 3, floats(4));
  auto nextRecv = p.b.recv(0, 3, floats(4));
  deliver(p.a, p.b);
  deliver(p.b, p.a);
  p.a.finish(next);
  p.b.finish(nextRecv);
  CHECK(p.a.succeeded(next) && p.b.succeeded(nextRecv));
}

TEST(opControlTimeoutNamesSilence, "op control: an op that times out on a silent peer says what was seen") {
  Pair p;
  p.a.links.silent = "nothing came from its peer process for 9.0 s";
  auto send = p.a.send(1, 3, floats(4));
  p.a.control.probeSilentPeers(send->posted);
  CHECK(p.a.links.probed == std::vector<Peer*>{p.a.peers[1].get()});
  p.a.control.expireOps(send->deadline + std::chrono::milliseconds(5));
  CHECK(p.a.endedWith(send, StatusCode::kTimeout,
                      "failed at the group timeout of 60000 ms (posted 60005 ms ago, waiting for "
                      "its recv): nothing came from its peer process for 9.0 s"));
}

TEST(opControlWaitingRecvExpires, "op control: a recv past its deadline fails, keeps its place and refuses its send") {
  Pair p;
  auto recv = p.b.recv(0, 3, floats(4));
  p.b.control.expireOps(recv->deadline);
  CHECK(p.b.endedWith(recv, StatusCode::kTimeout,
                      "recv on rank 1 from rank 0 (group 'g', tag 3, float32[4] (16 B)) was not "
                      "matched by a send within the group timeout of 60000 ms"));
  CHECK(p.b.links.sent.empty());
  auto second = p.b.recv(0, 3, floats(4));

  auto send = p.a.send(1, 3, floats(4));
  auto secondSend = p.a.send(1, 3, floats(4));
  deliver(p.a, p.b);
  CHECK(p.b.links.sent.size() == 2);
  const Refusal* refusal = as<Refusal>(p.b.links.sent.at(0));
  CHECK(refusal && refusal->sendId == send->id && refusal->code == StatusCode::kTimeout);
  CHECK(as<ClearToSend>(p.b.links.sent.at(1)) &&
        as<ClearToSend>(p.b.links.sent.at(1))->sendId == secondSend->id &&
        as<ClearToSend>(p.b.links.sent.at(1))->recvId == second->id);
  deliver(p.b, p.a);
  CHECK(p.a.endedWith(send, StatusCode::kTimeout,
                      "the matching recv on rank 1 from rank 0 (group 'g', tag 3, float32[4] "
                      "(16 B)) had already failed"));
  CHECK(secondSend->state == OpState::kMoving);
}

TEST(opControlMovingOpsExpire, "op control: moving ops past their deadline fail, cancel their transfer and are released once the channel lets go") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4));
  auto recv = p.b.recv(0, 3, floats(4));
  deliver(p.a, p.b);
  deliver(p.b, p.a);
  p.a.takeCalls();
  p.b.takeCalls();
  for (Rank* rank : {&p.a, &p.b}) {
    auto& op = rank == &p.a ? send : recv;
    rank->control.expireOps(op->deadline);
    CHECK(rank->endedWith(op, StatusCode::kTimeout,
                          "did not finish within the group timeout of 60000 ms"));
    const std::string id = std::to_string(op->id);
    CHECK(same(rank->takeCalls(), {"end " + id + " timeout", "cancel " + id + " failed"}));
    CHECK(op->state == OpState::kEnded);  // the channel still holds the buffer
    CHECK(rank->control.liveOps() == 1);
    CHECK(rank->links.sent.empty());  // its channel's cancel is what the partner sees
    rank->finish(op, Status::failure(StatusCode::kChannel, "cancelled"));
    CHECK(same(rank->takeCalls(), {"release " + id}));
    CHECK(op->state == OpState::kReleased && rank->control.liveOps() == 0);
    CHECK(rank->outcome(op) && rank->outcome(op)->code == StatusCode::kTimeout);  // told once
  }
}

TEST(opControlSendGivesUpAfterArm, "op control: a send that failed before its clear-to-send came frees its armed recv") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4));
  auto recv = p.b.recv(0, 3, floats(4));
  deliver(p.a, p.b);  // the recv is armed, its clear-to-send held
  CHECK(recv->state == OpState::kMoving);
  p.a.control.expireOps(send->deadline);
  deliver(p.a, p.b);  // the send's cancellation: its announcement was matched already
  CHECK(recv->state == OpState::kMoving);
  deliver(p.b, p.a);  // the clear-to-send, for a send gone
  CHECK(p.a.links.sent.size() == 1);
  const Cancellation* cancel = as<Cancellation>(p.a.links.sent.at(0));
  CHECK(cancel && cancel->recvId == recv->id);
  p.b.takeCalls();
  deliver(p.a, p.b);
  CHECK(p.b.endedWith(recv, StatusCode::kTimeout,
                      "recv on rank 1 from rank 0 (group 'g', tag 3, float32[4] (16 B)) failed: "
                      "the matching send gave up: rank 0 had already failed it"));
  CHECK(same(p.b.takeCalls(), {"end 200 timeout", "cancel 200 partner gave up"}));
  p.b.finish(recv);
  CHECK(recv->state == OpState::kReleased && p.b.control.liveOps() == 0);
}

TEST(opControlPeerFailure, "op control: a failed peer fails its ops at each state, naming it; other peers' ops go on") {
  Pair p;
  auto waiting = p.a.send(1, 3, floats(4));
  auto moving = p.a.send(1, 4, floats(4));
  auto waitingRecv = p.a.recv(1, 5, floats(4));
  auto toRank2 = p.a.send(2, 3, floats(4));
  auto recv = p.b.recv(0, 4, floats(4));
  deliver(p.a, p.b);
  deliver(p.b, p.a);
  CHECK(waiting->state == OpState::kWaiting && moving->state == OpState::kMoving);
  p.a.takeCalls();
  p.a.links.take();

  p.a.failPeer(1, "the process exited");
  const std::string named =
      "failed: its peer process (pid 1001 on host node1) failed: the process exited";
  CHECK(p.a.endedWith(waiting, StatusCode::kPeerFailure,
                      "send on rank 0 to rank 1 (group 'g', tag 3, float32[4] (16 B)) " + named));
  CHECK(p.a.endedWith(moving, StatusCode::kPeerFailure, named));
  CHECK(p.a.endedWith(waitingRecv, StatusCode::kPeerFailure, named));
  CHECK(moving->state == OpState::kEnded);  // its channel still holds it
  CHECK(toRank2->state == OpState::kWaiting && p.a.outcome(toRank2) == nullptr);
  const std::vector<std::string> calls = p.a.takeCalls();
  auto count = [&](const std::string& call) {
    return std::count(calls.begin(), calls.end(), call);
  };
  CHECK(count("cancel 101 failed") == 1 && count("cancel 100 failed") == 0 &&
        count("cancel 102 failed") == 0);
  CHECK(count("release 100") == 1 && count("release 102") == 1 && count("release 101") == 0);
  CHECK(p.a.links.sent.empty());

  // An op that starts toward the failed peer is refused at once, and nothing is sent.
  auto late = p.a.send(1, 3, floats(4));
  CHECK(p.a.endedWith(late, StatusCode::kPeerFailure, named));
  CHECK(late->state == OpState::kReleased && p.a.links.sent.empty());
  p.a.finish(moving);
  CHECK(p.a.control.liveOps() == 1);  // the send to rank 2
}

TEST(opControlPeerNotConnected, "op control: an op to a rank not connected is refused at its start") {
  Pair p;
  p.a.control.findGroup(p.a.groupId)->peers[2] = nullptr;
  auto send = p.a.send(2, 3, floats(4));
  CHECK(p.a.endedWith(send, StatusCode::kPeerFailure, "failed: the peer is not connected"));
  CHECK(same(p.a.takeCalls(), {"end 100 peer failure", "release 100"}));
  CHECK(p.a.control.liveOps() == 0 && p.a.links.sent.empty());
}

TEST(opControlBadValueFromPeer, "op control: a bad value from a peer fails that peer's ops, naming the field") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4));
  auto toRank2 = p.a.send(2, 3, floats(4));
  p.a.control.badValueFrom(*p.a.peers[1],
                           BadPeerValue("flag index", "smfree: bad flag index in a channel "
                                                      "notice: 99 is out of bounds (0 to 3)"));
  CHECK(p.a.endedWith(send, StatusCode::kChannel,
                      "failed: its peer process (pid 1001 on host node1) sent a bad flag index "
                      "in a channel notice: 99 is out of bounds (0 to 3)"));
  CHECK(toRank2->state == OpState::kWaiting);
}

TEST(opControlBadSendIdInClearToSend, "op control: a clear-to-send that names a recv as its send fails the peer's ops") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4));
  auto recv = p.a.recv(1, 4, floats(4));
  p.a.links.take();
  p.a.control.onClearToSend(ClearToSend{p.a.groupId, 1, recv->id, 7, "x"});
  const std::string named = concat("sent a bad send id in a clear-to-send: op ", recv->id,
                                   " is not a send of this group to rank 1");
  CHECK(p.a.endedWith(send, StatusCode::kChannel, named));
  CHECK(p.a.endedWith(recv, StatusCode::kChannel, named));
  CHECK(p.a.links.sent.empty());
  // The same for a refusal.
  Pair q;
  auto qSend = q.a.send(1, 3, floats(4));
  auto qRecv = q.a.recv(1, 4, floats(4));
  q.a.control.onRefusal(Refusal{q.a.groupId, 1, qRecv->id, StatusCode::kMismatch, "no"});
  CHECK(q.a.endedWith(qSend, StatusCode::kChannel, "sent a bad send id in a refusal"));
}

TEST(opControlRepeatedSequenceNumber, "op control: a sequence number announced twice fails the sender's ops, naming the field") {
  Pair p;
  auto recv = p.b.recv(0, 9, floats(4));  // an op of rank 1 with rank 0
  auto send = p.a.send(1, 3, floats(4));
  const ReadyToSend rts = *as<ReadyToSend>(p.a.links.sent.at(0));
  deliver(p.a, p.b);
  handle(p.b, rts);
  CHECK(p.b.endedWith(recv, StatusCode::kChannel,
                      "sent a bad sequence number in a ready-to-send: 0 of rank 0 tag 3 was "
                      "announced before"));
  CHECK(p.b.links.sent.empty());
}

TEST(opControlDropsStrayReplies, "op control: replies naming a rank outside the group or an unknown op leave the other ops alone") {
  Pair p;
  auto send = p.a.send(1, 3, floats(4));
  auto recv = p.a.recv(1, 4, floats(4));
  p.a.takeCalls();
  p.a.links.take();
  // Ranks outside the group: dropped (logged).
  p.a.control.onClearToSend(ClearToSend{p.a.groupId, 7, send->id, 5, "x"});
  p.a.control.onClearToSend(ClearToSend{p.a.groupId, -1, send->id, 5, "x"});
  p.a.control.onRefusal(Refusal{p.a.groupId, kGroupSize, send->id, StatusCode::kMismatch, "no"});
  // An unknown group: nothing to act on.
  p.a.control.onClearToSend(ClearToSend{p.a.groupId + 1, 1, send->id, 5, "x"});
  // Unknown ops: a refusal or a cancellation for them is dropped.
  p.a.control.onRefusal(Refusal{p.a.groupId, 1, 999, StatusCode::kMismatch, "no"});
  p.a.control.onCancellation(Cancellation{p.a.groupId, 1, 4, 0, 999, "gave up", ChannelKind::kUcx});
  // A ready-to-send from a rank outside the group: dropped, matching nothing.
  p.a.control.onReadyToSend(ReadyToSend{p.a.groupId, 9, 4, 0, 555, floats(4), ChannelKind::kUcx,
                                        false, ""});
  CHECK(send->state == OpState::kWaiting && recv->state == OpState::kWaiting);
  CHECK(p.a.told.empty() && p.a.takeCalls().empty() && p.a.links.sent.empty());

  // A clear-to-send for an unknown send: its receiver is told not to wait for the bytes.
  p.a.control.onClearToSend(ClearToSend{p.a.groupId, 1, 999, 77, "x"});
  CHECK(p.a.links.sent.size() == 1);
  const Cancellation* cancel = as<Cancellation>(p.a.links.sent.at(0));
  CHECK(cancel && cancel->recvId == 77 &&
        cancel->reason == "the matching send gave up: rank 0 had already failed it");
  CHECK(send->state == OpState::kWaiting && recv->state == OpState::kWaiting && p.a.told.empty());
}

TEST(opControlCloseGroup, "op control: closing a group fails its pending ops, gives back what waits, and refuses new ops") {
  Pair p;
  auto waiting = p.a.send(1, 3, floats(4));
  auto moving = p.a.send(1, 4, floats(4));
  auto recv = p.b.recv(0, 4, floats(4));
  p.b.send(0, 5, floats(4), {"slot 1"});  // announced to rank 0, not matched there
  deliver(p.a, p.b);
  deliver(p.b, p.a);
  CHECK(moving->state == OpState::kMoving);
  p.a.takeCalls();
  p.a.links.take();

  p.a.control.closeGroup(p.a.groupId, StatusCode::kAborted, "the group was aborted");
  CHECK(p.a.endedWith(waiting, StatusCode::kAborted,
                      "send on rank 0 to rank 1 (group 'g', tag 3, float32[4] (16 B)) failed: "
                      "the group was aborted"));
  CHECK(p.a.endedWith(moving, StatusCode::kAborted, "failed: the group was aborted"));
  // In any order between the ops (OpControl keeps them in a hash map).
  CHECK(same(p.a.takeCalls(), {"end 100 aborted", "release 100", "end 101 aborted",
                               "cancel 101 failed"}, true));
  // Each channel that takes notices hears the group closed; the waiting announcement's channel
  // data is given back.
  CHECK((p.a.channels.ucx->notices ==
         std::vector<size_t>{kSendAnnounced, kSendUnarmed, kGroupClosed}));
  CHECK(p.a.channels.copyEngine->notices == std::vector<size_t>{kGroupClosed});
  CHECK(p.a.channels.loopback->notices.empty());
  CHECK(p.a.links.sent.empty());

  auto late = p.a.send(1, 6, floats(4));
  CHECK(p.a.endedWith(late, StatusCode::kAborted, "failed: the group is closed"));
  CHECK(p.a.links.sent.empty());
  // What arrives for the closed group is dropped, its channel data given back.
  p.a.control.onReadyToSend(ReadyToSend{p.a.groupId, 1, 7, 0, 999, floats(4), ChannelKind::kUcx,
                                        false, "slot 2"});
  CHECK(p.a.channels.ucx->notices.back() == kSendUnarmed);
  CHECK(p.a.links.sent.empty());
  p.a.finish(moving);
  CHECK(p.a.control.liveOps() == 0);
}

TEST(opControlChannelErrors, "op control: a channel that cannot announce or arm fails the op, and its partner hears why") {
  {
    Pair p;
    auto send = p.a.send(1, 3, floats(4), {"", "at", true, false});
    CHECK(p.a.endedWith(send, StatusCode::kChannel, "the channel could not announce"));
    // Announced all the same, and cancelled: the receiver's line keeps its place.
    CHECK(p.a.links.sent.size() == 2 && as<ReadyToSend>(p.a.links.sent.at(0)) &&
          as<Cancellation>(p.a.links.sent.at(1)));
    deliver(p.a, p.b);
    auto recv = p.b.recv(0, 3, floats(4));
    CHECK(p.b.endedWith(recv, StatusCode::kTimeout,
                        "failed: the matching send gave up: smfree: the channel could not "
                        "announce"));
    auto next = p.a.send(1, 3, floats(4));
    auto nextRecv = p.b.recv(0, 3, floats(4));
    deliver(p.a, p.b);
    CHECK(nextRecv->state == OpState::kMoving);
    deliver(p.b, p.a);
    CHECK(next->state == OpState::kMoving);
  }
  {
    Pair p;
    auto send = p.a.send(1, 3, floats(4));
    auto recv = p.b.recv(0, 3, floats(4), {"", "at", false, true});
    deliver(p.a, p.b);
    CHECK(p.b.endedWith(recv, StatusCode::kChannel, "the channel could not arm"));
    const Refusal* refusal = as<Refusal>(p.b.links.sent.at(0));
    CHECK(refusal && refusal->code == StatusCode::kChannel);
    deliver(p.b, p.a);
    CHECK(p.a.endedWith(send, StatusCode::kChannel, "the channel could not arm"));
  }
}

TEST(opControlSendBufferGone, "op control: a send whose buffer is gone at its clear-to-send fails, and so does its armed recv") {
  Pair p;
  auto send = p.a.make(OpKind::kSend, 1, 3, floats(4));
  send->request.bufferCheck = [] { return std::optional<std::string>("its tensor was freed"); };
  p.a.control.startOp(send);
  auto recv = p.b.recv(0, 3, floats(4));
  deliver(p.a, p.b);
  p.b.takeCalls();
  deliver(p.b, p.a);
  CHECK(p.a.endedWith(send, StatusCode::kChannel,
                      "send on rank 0 to rank 1 (group 'g', tag 3, float32[4] (16 B)) failed: its "
                      "tensor was freed"));
  CHECK(same(p.a.takeCalls(), {"announce 100", "end 100 channel error", "release 100"}));
  deliver(p.a, p.b);
  CHECK(p.b.endedWith(recv, StatusCode::kTimeout,
                      "failed: the matching send failed: send on rank 0 to rank 1 (group 'g', tag "
                      "3, float32[4] (16 B)) failed: its tensor was freed"));
  CHECK(same(p.b.takeCalls(), {"end 200 timeout", "cancel 200 partner gave up"}));
}

TEST(opControlShutDown, "op control: shutting down fails every op left, at any state") {
  Pair p;
  auto waiting = p.a.send(1, 3, floats(4));
  auto moving = p.a.send(1, 4, floats(4));
  auto recv = p.b.recv(0, 4, floats(4));
  auto waitingRecv = p.a.recv(1, 5, floats(4));
  deliver(p.a, p.b);
  deliver(p.b, p.a);
  CHECK(moving->state == OpState::kMoving);
  p.a.control.shutDown();
  for (const auto& op : {waiting, moving, waitingRecv}) {
    CHECK(p.a.endedWith(op, StatusCode::kAborted, "failed: the smfree engine shut down"));
  }
  CHECK(p.a.control.liveOps() == 0);
  CHECK(recv->state == OpState::kMoving);  // the other rank's are its own
}

TEST(opControlKeepsEarlyAnnouncements, "op control: a send announced for a group not joined yet waits for the group and matches") {
  Rank a{0, 100};
  Rank b{1, 200, false};
  auto send = a.send(1, 3, floats(4));
  deliver(a, b);
  CHECK(b.links.sent.empty());
  b.join();
  auto recv = b.recv(0, 3, floats(4));
  CHECK(recv->state == OpState::kMoving);
  CHECK(b.links.sent.size() == 1 && as<ClearToSend>(b.links.sent.at(0)) &&
        as<ClearToSend>(b.links.sent.at(0))->sendId == send->id);
}

TEST(opControlRefusesOtherChannel, "op control: a send over another channel than its recv's is refused on both sides") {
  Pair p;
  auto send = p.a.post(OpKind::kSend, 1, 3, ChannelKind::kCopyEngine);
  auto recv = p.b.post(OpKind::kRecv, 0, 3, ChannelKind::kUcx);
  deliver(p.a, p.b);
  const std::string expected =
      "channel mismatch in group 'g', tag 3: rank 0 sends float32[4] (16 B) over the copy "
      "engines, rank 1 receives into float32[4] (16 B) over UCX (SMFREE_CHANNEL must be alike "
      "on every rank)";
  CHECK(p.b.endedWith(recv, StatusCode::kMismatch, expected));
  deliver(p.b, p.a);
  CHECK(p.a.endedWith(send, StatusCode::kMismatch, expected));
}

TEST(opControlCapturedLinesApart, "op control: captured ops match only captured ops, in lines of their own") {
  Pair p;
  auto captured = p.a.post(OpKind::kSend, 1, 3, ChannelKind::kCaptured);
  auto ordinary = p.b.post(OpKind::kRecv, 0, 3, ChannelKind::kUcx);
  deliver(p.a, p.b);
  CHECK(ordinary->state == OpState::kWaiting && p.b.links.sent.empty());
  auto capturedRecv = p.b.post(OpKind::kRecv, 0, 3, ChannelKind::kCaptured);
  CHECK(capturedRecv->state == OpState::kMoving);
  auto ordinarySend = p.a.post(OpKind::kSend, 1, 3, ChannelKind::kUcx);
  CHECK(captured->seq == 0 && ordinarySend->seq == 0);
  deliver(p.a, p.b);
  CHECK(ordinary->state == OpState::kMoving);
  std::vector<std::pair<uint64_t, uint64_t>> pairs;  // (send, recv) of each clear-to-send
  for (const FakeLinks::Sent& cleared : p.b.links.sent) {
    if (const ClearToSend* cts = as<ClearToSend>(cleared)) {
      pairs.emplace_back(cts->sendId, cts->recvId);
    }
  }
  CHECK((pairs == std::vector<std::pair<uint64_t, uint64_t>>{{captured->id, capturedRecv->id},
                                                             {ordinarySend->id, ordinary->id}}));
}
