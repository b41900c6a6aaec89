// Fakes of what OpControl and ProgressLoop reach, for in-process tests: the peer links (each
// control message sent is kept for the test to deliver, hold or reorder) and a channel whose
// per-op parts record every call OpControl makes of them.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/Channel.h"
#include "engine/Channels.h"
#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/PeerLinks.h"

namespace smfree::engine::testing {

// Keeps what is sent, as PeerTable would hand it to the transport.
class FakeLinks final : public PeerLinks {
 public:
  struct Sent {
    Peer* peer;
    ControlMessage message;
  };

  void send(Peer& peer, const ControlMessage& message) override {
    if (!peer.failed) sent.push_back({&peer, message});  // as PeerTable: dropped once failed
  }
  void probeIfSilent(Peer& peer, TimePoint) override { probed.push_back(&peer); }
  std::optional<std::string> silence(const Peer&, TimePoint) const override { return silent; }
  bool applyReported() override {
    ++applyCalls;
    return false;
  }
  void check() override { ++checkCalls; }
  void appendWatchFds(std::vector<pollfd>&) const override {}

  // Takes what was sent so far, oldest first.
  std::vector<Sent> take() {
    std::vector<Sent> out;
    out.swap(sent);
    return out;
  }

  std::vector<Sent> sent;
  std::vector<Peer*> probed;
  std::optional<std::string> silent;  // what silence() says of every peer
  std::atomic<int> applyCalls{0};
  std::atomic<int> checkCalls{0};
};

// A channel op that records the calls made of it, in one log per rank ("arm 7 <announced>").
class FakeChannelOp final : public ChannelOp {
 public:
  struct Script {
    std::string announced;     // what announce() returns as channel data
    std::string armed = "at"; // what arm() returns
    bool announceThrows = false;
    bool armThrows = false;
  };

  FakeChannelOp(std::vector<std::string>& calls, Script script)
      : ChannelOp(OpTraits{}), calls_(calls), script_(std::move(script)) {}

  ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer&) override {
    record("announce", *send);
    if (script_.announceThrows) fail("the channel could not announce");
    return ChannelAnnouncement{false, script_.announced};
  }
  std::string arm(const std::shared_ptr<Op>& recv, Peer&, const std::string& announced) override {
    record("arm", *recv, announced);
    if (script_.armThrows) fail("the channel could not arm");
    recv->outstanding = 1;  // it holds the buffer until the test ends its transfer
    return script_.armed;
  }
  void start(const std::shared_ptr<Op>& op, Peer&, const std::string& channelData,
             bool) override {
    record("start", *op, channelData);
    op->outstanding = 1;
  }
  void cancel(Op& op, Cancel why) override {
    record("cancel", op, why == Cancel::kFailed ? "failed" : "partner gave up");
  }
  void end(Op& op, const Status& status) override { record("end", op, toString(status.code)); }
  void release(Op& op) override { record("release", op); }
  std::string describe(const Op&) const override { return ""; }
  bool outlivesWait(const Op&) const override { return false; }
  bool queued() override { return true; }
  void waitOnStream(void*, int) override {}

 private:
  void record(const char* call, const Op& op, const std::string& detail = "") {
    calls_.push_back(concat(call, " ", op.id, detail.empty() ? "" : " ", detail));
  }

  std::vector<std::string>& calls_;
  const Script script_;
};

// A channel that counts what the loop asks of it; by default it declares notices and the
// loop's groups (progress, sweep).
class FakeChannel final : public Channel {
 public:
  explicit FakeChannel(Capabilities capabilities = {Capability::kNotices, Capability::kProgress,
                                                     Capability::kSweep})
      : Channel(capabilities) {}

  std::shared_ptr<ChannelOp> prepare(Op&, const PostOptions&) override {
    fail("FakeChannel: the tests make their ops' parts themselves");
  }
  void peerFailed(Peer&) override {}
  void flush(Clock::time_point) override {}
  void stop() override {}
  void report(ChannelReport&) const override {}
  void onNotice(const Notice& notice) override { notices.push_back(notice.index()); }
  Progress progress() override {
    ++progressCalls;
    if (throwOnce.exchange(false)) fail("the fake channel's progress failed");
    return Progress{active.load(), -1};
  }
  bool busy() const override { return false; }
  void sweep() override { ++sweepCalls; }

  std::vector<size_t> notices;  // Notice's alternative, in arrival order
  std::atomic<int> progressCalls{0};
  std::atomic<int> sweepCalls{0};
  std::atomic<bool> active{false};  // what progress() reports
  std::atomic<bool> throwOnce{false};  // the next progress() throws
};

// Four fake channels, one per kind; the loopback one declares no optional group.
struct FakeChannels {
  FakeChannels() {
    auto make = [](FakeChannel*& slot, Capabilities capabilities) {
      auto channel = std::make_unique<FakeChannel>(capabilities);
      slot = channel.get();
      return std::unique_ptr<Channel>(std::move(channel));
    };
    const Capabilities loop{Capability::kNotices, Capability::kProgress, Capability::kSweep};
    auto copyEngineChannel = make(copyEngine, loop);
    auto capturedChannel = make(captured, loop);
    auto ucxChannel = make(ucx, loop);
    auto loopbackChannel = make(loopback, {});
    all = std::make_unique<Channels>(std::move(copyEngineChannel), std::move(capturedChannel),
                                     std::move(ucxChannel), std::move(loopbackChannel));
  }

  FakeChannel* copyEngine = nullptr;
  FakeChannel* captured = nullptr;
  FakeChannel* ucx = nullptr;  // the channel of CPU ops, which the tests post
  FakeChannel* loopback = nullptr;
  std::unique_ptr<Channels> all;
};

}  // namespace smfree::engine::testing
