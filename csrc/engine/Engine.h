#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
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

#include "engine/Config.h"
#include "engine/Error.h"
#include "engine/GroupState.h"
#include "engine/Op.h"
#include "engine/Peer.h"
#include "engine/Store.h"
#include "engine/Wire.h"

namespace smfree::engine {

class Channel;
class CopyEngineChannel;
class Group;
class UcxChannel;
class UcxControl;
class UcxContext;
class UcxReceiveLane;
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
  // UCX and CUDA tear down under them. In between, flushPeers().
  void stop();
  // Once the progress thread is gone: waits, bounded by the group timeout for each endpoint,
  // until every peer on another host has taken what was sent to it.
  void flushPeers();
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
  // On the caller's thread: a CUDA op's flags and events, and what its stream signals at
  // posting (a recv's `ready` write, a send's `produced` record).
  CudaFence prepareCuda(Op& op, std::chrono::milliseconds timeout);
  // On the caller's thread, for a CUDA op over UCX: its stream's `streamReady` write and
  // `reached` record, and its fence (see UcxCudaState).
  // `staged`: the op goes through pinned host memory (CallerStaging); a send's copies out are
  // queued here.
  CudaFence prepareUcxCuda(Op& op, std::chrono::milliseconds timeout, bool staged);
  std::shared_ptr<CallerStaging> stageFromCaller(const Op& op);
  // Caller's thread, a caller-staged recv: queues its copies in, which wait on the GPU for
  // their pieces to land, and sets `queued`, if its match allows that now; true once `queued`
  // is set (also by a failure).
  bool queueCopiesInOnceMatched(CallerStaging& staging);
  // The same, blocking until it can (a recv's wait()); false if `deadline` comes first.
  bool queueCopiesInBy(CallerStaging& staging, Clock::time_point deadline);
  // Queues the write of `flag` on the op's stream (the caller's), in its device's context.
  void writeFromStream(const Op& op, const cuda::Flag& flag);
  // Bounds the CUDA ops in flight (flag words, tensors held), blocking the caller before it
  // enqueues anything on its stream.
  void admitCuda(std::chrono::milliseconds timeout);
  void retireCuda();
  // Blocks the caller until the copy that writes the op's `done` is submitted.
  void awaitQueued(const cuda::Flag& queued, Clock::time_point deadline);
  void waitOnStream(void* stream, int device, const CudaFence& fence);
  // Joins the progress thread; the receive lane keeps running.
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
  // Whether the progress thread makes CUDA calls for the op (copy engines, or UCX moving
  // CUDA memory itself): all but caller-staged ones.
  static bool needsCudaOnProgressThread(const Op& op);
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
  void recycleFlags();
  void releaseOnceWritten(const cuda::Flag& ready);
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
  Channel& channelFor(const Op& op);

  const Config config_;
  std::unique_ptr<UcxContext> ucx_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<UcxReceiveLane> receiveLane_;
  std::unique_ptr<cuda::FlagSegment> flags_;
  PeerAddress local_;
  std::unique_ptr<UcxControl> control_;
  std::unique_ptr<UcxChannel> ucxChannel_;
  std::unique_ptr<CopyEngineChannel> copyEngine_;

  std::mutex commandsMutex_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  // The progress thread is in (or about to enter) its poll and needs its event fd fired to
  // see new commands. While it spins it does not: the signal is a syscall of about 1 µs on
  // the path that posts every op.
  bool sleeping_ = false;
  std::atomic<uint64_t> nextOpId_{1};
  std::thread progress_;

  std::mutex cudaInflightMutex_;
  std::condition_variable cudaInflightFreed_;
  size_t cudaInflight_ = 0;

  std::mutex failuresMutex_;
  std::unordered_map<std::string, std::string> failures_;  // processKey -> why
  std::unordered_map<uint64_t, std::string> failedAfterWait_;  // group id -> why
  std::atomic<bool> anyFailure_{false};  // lets the post path skip the lookup

  // Progress thread only.
  std::unordered_map<uint64_t, GroupState> groups_;
  std::unordered_map<std::string, std::unique_ptr<Peer>> peers_;
  // How long closing a peer's endpoints waits for it to take what was sent: the longest
  // timeout of the groups joined so far.
  std::chrono::milliseconds longestGroupTimeout_{0};
  std::unordered_map<uint64_t, std::shared_ptr<Op>> live_;
  std::unordered_map<uint64_t, std::vector<ReadyToSend>> orphans_;  // for groups not joined yet
  std::vector<cuda::Flag> unreachedReadyFlags_;  // freed once their stream has written them
  std::vector<pollfd> sleepEvents_;
  // While true, this thread and the receive lane have made no CUDA call, so staged sends are
  // announced as promised. The first op that needs one ends it for good; that op waits in
  // heldOps_ until no commitment is in flight: no promised send still moving (a receiver's
  // stream may wait for it), no recv whose copies in wait on a promised send.
  bool promising_ = true;
  std::string stoppedPromising_;  // the op that ended it
  size_t commitments_ = 0;
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
