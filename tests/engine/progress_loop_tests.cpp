// ProgressLoop in-process: its thread driving fake channels, a fake control transport whose
// event fd is a pipe, fake peer links and a real OpControl. Commands, calls and their errors,
// what the loop drives each turn, expiry, and waking from its sleep. Waits on the loop's
// thread are bounded (kHangGuard) only so that a broken loop fails the test instead of hanging
// it; no check depends on how long anything took.

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "engine/Config.h"
#include "engine/CudaOps.h"
#include "engine/Failures.h"
#include "engine/GroupConfig.h"
#include "engine/OpControl.h"
#include "engine/ProgressLoop.h"
#include "engine/ProgressThread.h"
#include "engine/Spin.h"

#include "check.h"
#include "fake_engine.h"

using namespace smfree::engine;
using testing::FakeChannelOp;
using testing::FakeChannels;
using testing::throwsError;

namespace {

constexpr auto kHangGuard = std::chrono::seconds(20);

// A control transport whose event fd is a pipe: signal() writes a byte to it, arm() drains it.
class PipeTransport final : public ControlTransport {
 public:
  PipeTransport() {
    if (pipe2(fds_, O_NONBLOCK | O_CLOEXEC) != 0) fail("pipe2 failed");
  }
  ~PipeTransport() override {
    close(fds_[0]);
    close(fds_[1]);
  }

  unsigned progress() override {
    ++progressCalls;
    return 0;
  }
  bool deliver() override {
    ++deliverCalls;
    return false;
  }
  bool arm() override {
    char drained[64];
    while (read(fds_[0], drained, sizeof(drained)) > 0) {
    }
    return true;
  }
  int eventFd() const override { return fds_[0]; }
  void signal() override {
    ++signals;
    const char byte = 1;
    if (write(fds_[1], &byte, 1) < 0) {
      // Full: the fd is readable already.
    }
  }

  std::atomic<int> progressCalls{0};
  std::atomic<int> deliverCalls{0};
  std::atomic<int> signals{0};

 private:
  int fds_[2] = {-1, -1};
};

// Peer links for a loop on another thread: what was sent, guarded; and a gate that can hold
// the loop just before its poll (appendWatchFds is its last call there), so that a test knows
// the loop is asleep.
class LoopLinks final : public PeerLinks {
 public:
  void send(Peer& peer, const ControlMessage& message) override {
    std::lock_guard<std::mutex> lock(mutex_);
    sent_.push_back(message);
  }
  void probeIfSilent(Peer& peer, TimePoint) override {
    std::lock_guard<std::mutex> lock(mutex_);
    probed_.push_back(&peer);
  }
  std::optional<std::string> silence(const Peer&, TimePoint) const override {
    return std::nullopt;
  }
  bool applyReported() override {
    ++applyCalls;
    return false;
  }
  void check() override { ++checkCalls; }
  void appendWatchFds(std::vector<pollfd>&) const override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!hold_) return;
    held_ = true;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !hold_; });
  }

  // The loop's next sleep waits, before its poll, until release().
  void holdNextSleep() {
    std::lock_guard<std::mutex> lock(mutex_);
    hold_ = true;
    held_ = false;
  }
  // Whether the loop reached its poll and is held there (waits up to kHangGuard).
  bool awaitHeld() {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kHangGuard, [this] { return held_; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    hold_ = false;
    changed_.notify_all();
  }
  std::vector<ControlMessage> sent() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return sent_;
  }
  std::vector<Peer*> probed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return probed_;
  }

  std::atomic<int> applyCalls{0};
  std::atomic<int> checkCalls{0};

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  bool hold_ = false;
  mutable bool held_ = false;
  std::vector<ControlMessage> sent_;
  std::vector<Peer*> probed_;
};

Config spinning(std::chrono::microseconds spin) {
  Config config{};
  config.spin = spin;
  return config;
}

// A loop and what it drives. `spin`: how long it polls after its last event before it sleeps.
struct Loop {
  explicit Loop(std::chrono::microseconds spin) : config(spinning(spin)) {}

  template <typename T>
  T call(std::function<T()> command) {
    return loop.call<T>(std::move(command), std::chrono::milliseconds(kHangGuard), "a test call");
  }

  const Config config;
  Spin spin{config, 4};
  PipeTransport control;
  FakeChannels channels;
  LoopLinks links;
  Failures failures;
  ProgressThread thread;
  OpControl opControl{*channels.all, links, failures, thread};
  CudaOps cudaOps{16};
  ProgressLoop loop{spin, control, *channels.all, links, opControl, cudaOps, thread};
};

constexpr std::chrono::microseconds kSleepsAtOnce{0};
constexpr std::chrono::microseconds kNeverSleeps = std::chrono::hours(1);

// Whether `condition` holds within kHangGuard.
template <typename Condition>
bool eventually(Condition condition) {
  const auto deadline = std::chrono::steady_clock::now() + kHangGuard;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST(progressLoopRunsCommandsInOrder, "progress loop: submitted commands run in order, on the loop's thread") {
  Loop l(kSleepsAtOnce);
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  for (int i = 0; i < 100; ++i) {
    l.loop.submit([&, i] {
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    });
  }
  const std::thread::id loopThread =
      l.call<std::thread::id>([] { return std::this_thread::get_id(); });
  std::vector<int> expected;
  for (int i = 0; i < 100; ++i) expected.push_back(i);
  CHECK(order == expected);
  CHECK(loopThread != std::this_thread::get_id());
  CHECK(threads == std::vector<std::thread::id>(100, loopThread));
}

TEST(progressLoopCallReturnsAndRethrows, "progress loop: call returns a command's value and rethrows its error") {
  Loop l(kSleepsAtOnce);
  CHECK(l.call<int>([] { return 42; }) == 42);
  CHECK(l.call<std::string>([] { return std::string("from the loop"); }) == "from the loop");
  CHECK(throwsError([&] { l.call<int>([]() -> int { fail("the command failed"); }); },
                    "smfree: the command failed"));
  bool rethrown = false;
  try {
    l.call<void>([] { throw std::out_of_range("not an engine error"); });
  } catch (const std::out_of_range& error) {
    rethrown = std::string(error.what()) == "not an engine error";
  }
  CHECK(rethrown);
  CHECK(l.call<int>([] { return 7; }) == 7);  // and the loop goes on
}

TEST(progressLoopCallTimesOut, "progress loop: call fails, naming what it waited for, when the command does not finish in time") {
  Loop l(kSleepsAtOnce);
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  CHECK(throwsError(
      [&] {
        l.loop.call<int>(
            [opened] {
              opened.wait();
              return 1;
            },
            std::chrono::milliseconds(20), "registering the group");
      },
      "registering the group did not finish within 20 ms"));
  gate.set_value();  // the command ends; the loop goes on
  CHECK(l.call<int>([] { return 2; }) == 2);
}

TEST(progressLoopRefusesAfterStop, "progress loop: submit and call throw once the loop has stopped") {
  Loop l(kSleepsAtOnce);
  l.loop.stop();
  l.loop.stop();  // once is enough; twice does nothing
  CHECK(throwsError([&] { l.loop.submit([] {}); }, "the engine has shut down"));
  CHECK(throwsError([&] { l.call<int>([] { return 1; }); }, "the engine has shut down"));
}

TEST(progressLoopSurvivesErrors, "progress loop: a command or a channel that throws does not stop the loop") {
  Loop l(kSleepsAtOnce);
  l.loop.submit([] { fail("a command failed"); });
  l.loop.submit([] { throw std::logic_error("a command broke"); });
  CHECK(l.call<int>([] { return 3; }) == 3);

  l.channels.ucx->throwOnce = true;
  CHECK(eventually([&] { return !l.channels.ucx->throwOnce; }));  // it threw
  const int after = l.channels.ucx->progressCalls;
  CHECK(eventually([&] { return l.channels.ucx->progressCalls > after + 2; }));
  CHECK(l.call<int>([] { return 4; }) == 4);
}

TEST(progressLoopDrivesChannelsAndPeers, "progress loop: it drives the channels that declare progress and sweeps, the transport, and the peers' checks") {
  Loop l(kSleepsAtOnce);
  CHECK(eventually([&] {
    return l.channels.ucx->progressCalls > 0 && l.channels.copyEngine->progressCalls > 0 &&
           l.channels.captured->progressCalls > 0 && l.channels.ucx->sweepCalls > 0 &&
           l.channels.copyEngine->sweepCalls > 0 && l.control.progressCalls > 0 &&
           l.control.deliverCalls > 0 && l.links.applyCalls > 0 && l.links.checkCalls > 0;
  }));
  l.loop.stop();
  // The loopback channel declares neither group: the loop never asks it.
  CHECK(l.channels.loopback->progressCalls == 0 && l.channels.loopback->sweepCalls == 0);
}

TEST(progressLoopExpiresOps, "progress loop: an op past its deadline fails on the loop's own scan; one before it waits") {
  // What the loop's thread touches, declared before the loop, which stops first.
  auto config = std::make_shared<const GroupConfig>(GroupConfig{"g", 0, 2});
  Peer peer;
  peer.address.pid = 1001;
  peer.address.hostname = "node1";
  std::vector<std::string> calls;
  std::mutex mutex;
  std::vector<std::pair<uint64_t, Status>> told;
  Loop l(kSleepsAtOnce);
  auto make = [&](uint64_t id, Clock::time_point deadline) {
    auto op = std::make_shared<Op>();
    op->id = id;
    op->groupId = groupIdOf("g");
    op->config = config;
    op->request.peer = 1;
    op->request.tag = id;
    op->request.desc = TensorDesc{16, "float32", "cpu", {4}};
    op->request.onComplete = [&, id](const Status& status, int) {
      std::lock_guard<std::mutex> lock(mutex);
      told.emplace_back(id, status);
    };
    op->posted = Clock::now();
    op->deadline = deadline;
    op->channelOp = std::make_shared<FakeChannelOp>(calls, FakeChannelOp::Script{});
    return op;
  };
  auto late = make(1, Clock::now());
  auto early = make(2, Clock::now() + std::chrono::hours(1));
  l.call<void>([&] {
    l.opControl.registerGroup(config);
    l.opControl.findGroup(groupIdOf("g"))->peers[1] = &peer;
    l.opControl.startOp(late);
    l.opControl.startOp(early);
  });
  CHECK(eventually([&] {
    std::lock_guard<std::mutex> lock(mutex);
    return !told.empty();
  }));
  {
    std::lock_guard<std::mutex> lock(mutex);
    CHECK(told.size() == 1 && told.at(0).first == 1 &&
          told.at(0).second.code == StatusCode::kTimeout &&
          told.at(0).second.message.find("was not matched by a recv within the group timeout") !=
              std::string::npos);
  }
  CHECK(l.call<int>([&] { return static_cast<int>(early->state); }) ==
        static_cast<int>(OpState::kWaiting));
  // It probed the peer the op waited on, and told it the send gave up.
  const std::vector<Peer*> probed = l.links.probed();
  CHECK(!probed.empty() && probed.front() == &peer);
  const std::vector<ControlMessage> sent = l.links.sent();
  CHECK(sent.size() == 3 && std::holds_alternative<ReadyToSend>(sent.at(0)) &&
        std::holds_alternative<ReadyToSend>(sent.at(1)) &&
        std::holds_alternative<Cancellation>(sent.at(2)) &&
        std::get<Cancellation>(sent.at(2)).tag == 1);
}

TEST(progressLoopWakesOnSubmit, "progress loop: a command submitted to a sleeping loop fires its event fd and runs") {
  Loop l(kSleepsAtOnce);
  l.links.holdNextSleep();
  CHECK(l.links.awaitHeld());  // asleep, or about to poll
  const int before = l.control.signals;
  std::atomic<bool> ran{false};
  l.loop.submit([&] { ran = true; });
  CHECK(l.control.signals == before + 1);
  l.links.release();
  CHECK(eventually([&] { return ran.load(); }));
}

TEST(progressLoopPollsWithoutSignals, "progress loop: while the loop polls, submitting fires no event fd") {
  Loop l(kNeverSleeps);
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) l.loop.submit([&] { ++ran; });
  CHECK(l.call<int>([&] { return ran.load(); }) == 50);
  CHECK(l.control.signals == 0);
}
