// The pairing of ops to the rank itself (the loopback channel's), CPU tensors: per group and
// tag in posting order, bytes moved at the later post, ends told only to started ops, mismatches,
// an op that ends unpaired leaving its line, and ended ops let go of.

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/CudaOps.h"
#include "engine/GroupConfig.h"
#include "engine/channels/loopback/LoopbackPairing.h"

#include "check.h"

using namespace smfree::engine;

namespace {

// A pairing and the ends it reported, by op id, driven as LoopbackChannel drives it.
struct Loopback {
  CudaOps cudaOps{16};
  LoopbackPairing pairing{cudaOps};
  std::map<uint64_t, Status> ended;
  // Each op's LoopbackOp, as its LoopbackChannelOp holds it.
  std::map<uint64_t, std::shared_ptr<LoopbackOp>> halves;
  std::shared_ptr<const GroupConfig> group =
      std::make_shared<const GroupConfig>(GroupConfig{"pp", 3, 4});
  uint64_t nextId = 1;

  // The group timeout each op is posted with.
  std::chrono::milliseconds timeout{60000};

  std::shared_ptr<Op> post(OpKind kind, int tag, std::vector<float>& data,
                           uint64_t groupId = 1) {
    auto op = std::make_shared<Op>();
    op->id = nextId++;
    op->groupId = groupId;
    op->config = group;
    op->channel = ChannelKind::kLoopback;
    op->request.kind = kind;
    op->request.peer = group->rank;
    op->request.tag = tag;
    op->request.buffer = Buffer{data.data(), data.size() * sizeof(float)};
    op->request.desc = TensorDesc{data.size() * sizeof(float), "float32", "cpu",
                                  {static_cast<int64_t>(data.size())}};
    halves[op->id] = pairing.post(*op, timeout);
    return op;
  }
  // As the engine starts an op (OpControl::startOp) and then drives the channel.
  void start(const std::shared_ptr<Op>& op) {
    op->state = OpState::kWaiting;
    for (const LoopbackPairing::Report& report : pairing.progress()) {
      ended.emplace(report.op->id, report.status);
      pairing.ended(*report.op);  // as the engine's end does
    }
  }
  std::shared_ptr<Op> send(int tag, std::vector<float>& data, uint64_t groupId = 1) {
    return post(OpKind::kSend, tag, data, groupId);
  }
  std::shared_ptr<Op> recv(int tag, std::vector<float>& data, uint64_t groupId = 1) {
    return post(OpKind::kRecv, tag, data, groupId);
  }
  bool succeeded(const std::shared_ptr<Op>& op) const {
    auto it = ended.find(op->id);
    return it != ended.end() && it->second.ok();
  }
};

}  // namespace

TEST(loopbackPairsInEitherPostingOrder, "loopback: a send and a recv pair in either order") {
  for (bool sendFirst : {true, false}) {
    Loopback loopback;
    std::vector<float> mine{1, 2, 3, 4};
    std::vector<float> got(4, 0);
    auto first = sendFirst ? loopback.send(0, mine) : loopback.recv(0, got);
    CHECK(got[0] == 0);
    auto second = sendFirst ? loopback.recv(0, got) : loopback.send(0, mine);
    CHECK(got == mine);  // moved at the later post
    loopback.start(first);
    CHECK(loopback.succeeded(first));
    CHECK(loopback.ended.count(second->id) == 0);  // not started: not told yet
    loopback.start(second);
    CHECK(loopback.succeeded(second));
  }
}

TEST(loopbackDescribesWhetherAnOpIsPaired,
     "loopback: the pending-op table says whether an op met its partner in this process") {
  Loopback loopback;
  std::vector<float> mine{1};
  std::vector<float> got(1, 0);
  auto recv = loopback.recv(0, got);
  CHECK(loopback.pairing.describe(*recv, *loopback.halves[recv->id]) ==
        "its send in this process is not posted yet");
  auto send = loopback.send(0, mine);
  const std::string paired = "paired with its recv in this process; ends on the progress thread";
  CHECK(loopback.pairing.describe(*send, *loopback.halves[send->id]) == paired);
}

TEST(loopbackPairsPerTagInPostingOrder, "loopback: pairs per group and tag, in posting order") {
  Loopback loopback;
  std::vector<std::vector<float>> sent{{10}, {11}, {20}, {30}};
  loopback.send(1, sent[0]);
  loopback.send(1, sent[1]);
  loopback.send(2, sent[2]);
  loopback.send(1, sent[3], 2);  // another group, same tag
  std::vector<float> a(1), b(1), c(1), d(1);
  loopback.recv(2, a);
  loopback.recv(1, b);
  loopback.recv(1, c);
  loopback.recv(1, d, 2);
  CHECK(a[0] == 20 && b[0] == 10 && c[0] == 11 && d[0] == 30);
}

TEST(loopbackMismatchFailsBoth, "loopback: a size mismatch fails both ops, moving nothing") {
  Loopback loopback;
  std::vector<float> small{1, 2};
  std::vector<float> large(4, 0);
  auto send = loopback.send(0, small);
  auto recv = loopback.recv(0, large);
  loopback.start(send);
  loopback.start(recv);
  const std::string expected =
      "size or dtype mismatch in group 'pp', tag 0: rank 3 sends float32[2] (8 B) to rank 3, "
      "which receives into float32[4] (16 B)";
  for (const auto& op : {send, recv}) {
    auto it = loopback.ended.find(op->id);
    CHECK(it != loopback.ended.end() && it->second.code == StatusCode::kMismatch &&
          it->second.message == expected);
  }
  CHECK(large == std::vector<float>(4, 0));
}

TEST(loopbackEndedUnpairedLeavesItsLine, "loopback: an op that ends unpaired leaves its line") {
  Loopback loopback;
  std::vector<float> lost(1, -1);
  auto expired = loopback.recv(9, lost);
  loopback.start(expired);
  // As the engine ends it at the group timeout.
  loopback.pairing.ended(*expired);
  std::vector<float> mine{3};
  std::vector<float> got(1, 0);
  auto send = loopback.send(9, mine);
  auto recv = loopback.recv(9, got);
  loopback.start(send);
  loopback.start(recv);
  CHECK(got[0] == 3 && lost[0] == -1);
  CHECK(loopback.succeeded(send) && loopback.succeeded(recv));
  CHECK(loopback.ended.count(expired->id) == 0);  // its end was the engine's, not reported
}

TEST(loopbackPastItsDeadlineIsNotPaired,
     "loopback: an op past its group timeout, not yet failed, is no partner for a later post") {
  Loopback loopback;
  std::vector<float> stale(2, 0);
  loopback.timeout = std::chrono::milliseconds(0);
  auto expired = loopback.recv(0, stale);  // the progress thread has yet to fail it
  loopback.timeout = std::chrono::milliseconds(60000);
  std::vector<float> mine{5, 6};
  std::vector<float> got(2, 0);
  loopback.send(0, mine);
  loopback.recv(0, got);
  CHECK(got == mine);
  CHECK(stale == std::vector<float>(2, 0));
  loopback.pairing.ended(*expired);  // as the engine's end of the failed op does
  CHECK(loopback.ended.count(expired->id) == 0);
}

TEST(loopbackZeroBytes, "loopback: empty tensors pair and succeed") {
  Loopback loopback;
  std::vector<float> none;
  std::vector<float> alsoNone;
  auto recv = loopback.recv(0, none);
  auto send = loopback.send(0, alsoNone);
  loopback.start(recv);
  loopback.start(send);
  CHECK(loopback.succeeded(send) && loopback.succeeded(recv));
}

TEST(loopbackLetsGoOfEndedOps, "loopback: busy until started ops are told; ended ops let go") {
  Loopback loopback;
  std::vector<float> mine{5};
  std::vector<float> got(1, 0);
  auto send = loopback.send(4, mine);
  auto recv = loopback.recv(4, got);
  CHECK(loopback.pairing.busy());  // the pair's outcome waits for its ops to start
  loopback.start(send);
  CHECK(loopback.succeeded(send) && loopback.ended.count(recv->id) == 0);
  // The op holds its LoopbackOp (Op::channelOp): the LoopbackOp holding the op back would
  // keep both forever.
  CHECK(loopback.halves[send->id]->op == nullptr);
  CHECK(loopback.halves[recv->id]->op == recv);
  CHECK(loopback.pairing.busy());
  loopback.start(recv);
  CHECK(loopback.succeeded(recv) && !loopback.pairing.busy());
  CHECK(loopback.halves[recv->id]->op == nullptr);
  std::vector<float> lost(1);
  auto unpaired = loopback.recv(5, lost);
  CHECK(!loopback.pairing.busy());  // nothing to tell until it pairs
  loopback.pairing.ended(*unpaired);
  CHECK(loopback.halves[unpaired->id]->op == nullptr);
}
