#pragma once

#include <poll.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/Channel.h"
#include "engine/Config.h"
#include "engine/CudaOps.h"
#include "engine/Error.h"
#include "engine/GroupState.h"
#include "engine/Op.h"
#include "engine/Peer.h"
#include "engine/Store.h"
#include "engine/Wire.h"

namespace smfree::engine {

class Group;
class UcxControl;
class UcxContext;
class UcxWorker;

// One per process, shared by every group: the UCX worker, the control transport, the data
// channels and the progress thread that drives them. Everything below "progress thread"
// runs on that thread only; other threads reach it through submit().
class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // The process's engine, created on first use and destroyed with its last group.
  static std::shared_ptr<Engine> acquire();
  // Stops the live engine, if any, failing its pending ops (process exit).
  static void stopProcessEngine();

  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Publishes this process in the group's store and registers the group.
  std::shared_ptr<Group> joinGroup(GroupConfig config, std::shared_ptr<KeyValueStore> store,
                                   std::chrono::milliseconds timeout);
  const Config& config() const { return config_; }

 private:
  friend class Group;
  struct Private {};

 public:
  explicit Engine(Private);

 private:
  // Any thread.
  void submit(std::function<void()> command);
  template <typename T>
  T call(std::function<T()> command, std::chrono::milliseconds timeout, const char* what);
  // Stops both threads, the progress thread and the receive lane's: at process exit, before
  // UCX and CUDA tear down under them.
  void stop();
  // Waits, until `deadline` at most, for the ops whose wait() returned before they ended
  // (staged UCX ops, UcxCudaState) to finish their copies: of one group, or of all.
  void awaitReleasedOps(std::optional<uint64_t> groupId, Clock::time_point deadline);
  std::optional<std::string> failureOf(const std::string& processKey);
  // Why the group's calls are refused: an op of it failed after its wait() had returned.
  std::optional<std::string> failureAfterWait(uint64_t groupId);
  // The first such failure of the group is kept; later ones add nothing the caller can act on.
  void recordFailureAfterWait(uint64_t groupId, std::string why);
  // An entry of `failures` (failures_ or failedAfterWait_), under failuresMutex_.
  template <typename Key>
  std::optional<std::string> recordedFailure(
      const std::unordered_map<Key, std::string>& failures, const Key& key);
  uint64_t nextOpId() { return nextOpId_.fetch_add(1); }
  // The channel of that kind; its caller-thread methods are for any thread.
  Channel& channel(ChannelKind kind) {
    return *channels_[kind == ChannelKind::kCopyEngine ? 0 : 1];
  }
  // Joins the progress thread; the channels' threads keep running.
  void stopProgressThread();

  // Progress thread.
  void run();
  bool runCommands();
  void registerGroup(std::shared_ptr<const GroupConfig> config);
  // Returns whether CUDA buffers to and from the peer go through pinned host memory.
  bool attachPeer(uint64_t groupId, int rank, const PeerAddress& address);
  struct NewPeer {
    std::unique_ptr<Peer> peer;
    std::optional<std::string> unreachable;  // why it has no endpoints
  };
  NewPeer makePeer(const PeerAddress& address);
  void closeGroup(uint64_t groupId, StatusCode code, const std::string& reason);
  std::string dumpPending(uint64_t groupId);
  size_t releasedOpsInFlight(std::optional<uint64_t> groupId);
  std::map<std::string, int64_t> stats();

  void startOp(const std::shared_ptr<Op>& op);
  // Whether a channel has commitments in flight (Channel::committed).
  bool committed() const;
  // Starts the ops held back while commitments were in flight, once none is.
  void startHeldOps();
  void onControlMessage(const void* data, size_t length);
  void onReadyToSend(const ReadyToSend& message);
  void onClearToSend(const ClearToSend& message);
  void onRefusal(const Refusal& message);
  void onCancellation(const Cancellation& message);
  void onMemoryReleased(const MemoryReleased& message);
  void onChannelNotice(const ChannelNotice& message);
  void announceReleasedMemory();
  void onMatched(GroupState& group, Matcher::Match& match);
  void onTransferDone(const std::shared_ptr<Op>& op, const Status& status);
  void onPeerFailure(const std::string& processKey, const std::string& why);
  void checkPeers();
  bool referencedByOpenGroup(const Peer& peer) const;
  void sleep();
  void expireOps(Clock::time_point now);
  void expire(const std::shared_ptr<Op>& op, Clock::time_point now);
  void complete(const std::shared_ptr<Op>& op, const Status& status);
  void release(const std::shared_ptr<Op>& op);
  void sendControl(Peer& peer, const ControlMessage& message);
  GroupState* findGroup(uint64_t groupId);
  std::shared_ptr<Op> findLive(uint64_t opId);
  Peer* partnerOf(const Op& op);
  Channel& channelFor(const Op& op) { return channel(op.channel); }

  const Config config_;
  std::unique_ptr<UcxContext> ucx_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<CudaOps> cudaOps_;
  PeerAddress local_;
  std::unique_ptr<UcxControl> control_;
  // The copy engines, then UCX: the order in which the progress loop drives them.
  std::array<std::unique_ptr<Channel>, 2> channels_;

  std::mutex commandsMutex_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  // The progress thread is in (or about to enter) its poll and needs its event fd fired to
  // see new commands. While it spins it does not: the signal is a syscall of about 1 µs on
  // the path that posts every op.
  bool sleeping_ = false;
  std::atomic<uint64_t> nextOpId_{1};
  std::thread progress_;

  std::mutex failuresMutex_;
  std::unordered_map<std::string, std::string> failures_;  // processKey -> why
  std::unordered_map<uint64_t, std::string> failedAfterWait_;  // group id -> why
  std::atomic<bool> anyFailure_{false};  // lets the post path skip the lookup

  // Progress thread only.
  std::unordered_map<uint64_t, GroupState> groups_;
  std::unordered_map<std::string, std::unique_ptr<Peer>> peers_;
  std::unordered_map<uint64_t, std::shared_ptr<Op>> live_;
  std::unordered_map<uint64_t, std::vector<ReadyToSend>> orphans_;  // for groups not joined yet
  std::vector<pollfd> sleepEvents_;
  // Ops that make CUDA calls on this thread, held while a channel is committed, and the ops
  // posted after them (ops start in posting order).
  std::deque<std::shared_ptr<Op>> heldOps_;
};

template <typename T>
T Engine::call(std::function<T()> command, std::chrono::milliseconds timeout, const char* what) {
  auto promise = std::make_shared<std::promise<T>>();
  auto future = promise->get_future();
  submit([promise, command = std::move(command)] {
    try {
      if constexpr (std::is_void_v<T>) {
        command();
        promise->set_value();
      } else {
        promise->set_value(command());
      }
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  if (future.wait_for(timeout) != std::future_status::ready) {
    fail(what, " did not finish within ", timeout.count(), " ms");
  }
  return future.get();
}

}  // namespace smfree::engine
