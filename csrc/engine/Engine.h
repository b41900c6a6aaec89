#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "engine/Channels.h"
#include "engine/Config.h"
#include "engine/CudaOps.h"
#include "engine/Failures.h"
#include "engine/GroupEngine.h"
#include "engine/GroupState.h"
#include "engine/Op.h"
#include "engine/Peer.h"
#include "engine/PeerTable.h"
#include "engine/ProgressLoop.h"
#include "engine/ProgressThread.h"
#include "engine/OpControl.h"
#include "engine/Spin.h"
#include "engine/Store.h"
#include "engine/Wire.h"

namespace smfree::engine {

class Group;
class UcxControl;
class UcxContext;
class UcxWorker;

// One per process, shared by every group: the UCX worker and control transport, the data
// channels, the peer table, the op control and the progress loop that drives them. Its
// methods are for any thread; they reach the progress thread's state through the loop.
class Engine : public GroupEngine, public std::enable_shared_from_this<Engine> {
  struct Private {};

 public:
  // The process's engine, created on first use and destroyed with its last group.
  static std::shared_ptr<Engine> acquire();
  // Stops the live engine, if any, failing its pending ops (process exit).
  static void stopProcessEngine();

  explicit Engine(Private);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Publishes this process in the group's store and registers the group.
  std::shared_ptr<Group> joinGroup(GroupConfig config, std::shared_ptr<KeyValueStore> store,
                                   std::chrono::milliseconds timeout);
  const Config& config() const override { return config_; }
  const Spin& spin() const override { return spin_; }
  const PeerAddress& localAddress() const override { return local_; }
  Failures& failures() override { return failures_; }
  Channel& channel(ChannelKind kind) override { return channels_->of(kind); }
  uint64_t nextOpId() override { return nextOpId_.fetch_add(1); }

  PeerRoute connect(uint64_t groupId, int rank, const PeerAddress& address,
                    std::chrono::milliseconds timeout) override;
  void post(std::shared_ptr<Op> op) override;
  void awaitReleasedOps(std::optional<uint64_t> groupId, Clock::time_point deadline) override;
  void closeGroup(uint64_t groupId, StatusCode code, const std::string& reason) override;
  std::string dumpPending(uint64_t groupId) override;
  std::map<std::string, int64_t> stats() override;

 private:
  // Stops the progress thread and the channels' threads: at process exit, before UCX and
  // CUDA tear down under them; waits for the peers up to `deadline`.
  void stop(Clock::time_point deadline);
  // When an exit that starts now stops waiting for peers (SMFREE_EXIT_TIMEOUT_MS).
  Clock::time_point exitDeadline() const;
  // Once the progress thread is gone: waits, up to `deadline`, until every peer on another
  // host has taken what was sent to it.
  void flushPeers(Clock::time_point deadline);
  // Progress thread.
  PeerRoute attachPeer(uint64_t groupId, int rank, const PeerAddress& address);
  void onControlMessage(const void* data, size_t length);
  // The peer a control message came from, if it is known here.
  Peer* senderOf(const ControlMessage& message);
  // Sends `message` to the peer with process key `key`, unless it is unknown or failed.
  void sendToLive(const std::string& key, const ControlMessage& message);
  void onPeerFailure(Peer& peer, const std::string& why);

  const Config config_;
  Spin spin_;
  std::unique_ptr<UcxContext> ucx_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<CudaOps> cudaOps_;
  ProgressThread thread_;
  std::unique_ptr<Channels> channels_;
  PeerAddress local_;
  std::unique_ptr<UcxControl> control_;
  Failures failures_;
  std::unique_ptr<PeerTable> peers_;
  std::unique_ptr<OpControl> opControl_;
  std::unique_ptr<ProgressLoop> loop_;  // last: its thread starts once the rest is in place
  std::atomic<uint64_t> nextOpId_{1};
};

}  // namespace smfree::engine
