#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/Failures.h"
#include "engine/ProgressThread.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/CapturedChannelOp.h"
#include "engine/channels/captured/ChainStreams.h"
#include "engine/channels/captured/PostedRecvs.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// Same-host CUDA ops posted while their stream captures a CUDA graph (torch.cuda.graph): the
// graph holds their whole data path, copy-engine copies and stream memory operations, and its
// replays move the bytes with no CPU and no kernel.
//
// At capture both ranks run the capturing code, so the CPU rendezvous happens then, once: a
// captured send meets the captured recv of its (peer, tag) line (captured ops have lines of
// their own, GroupState), sizes and dtypes are checked, and the receiver learns where its
// bytes will come from. A captured recv tells its sender at its post where its buffer is
// (PostedRecvs); a send posted after that notice came (it waits up to kDirectPatience for it)
// copies straight into the buffer, one copy between the two GPUs; one posted before goes
// through a slot of its own, since it cannot wait at capture for a recv its peer may post only
// after it. What the two graphs hold for one message:
//  - direct: two words of the receiver's flag segment, `ready` and `arrived`, 0 at capture.
//    The receiver's nodes: at its post, ready = 1 (its graph has reached the recv, the buffer
//    is free); at its wait(), {wait arrived == 1; arrived = 0}. The sender's, at its post:
//    {wait ready == 1; ready = 0}, the copy of its tensor into the receiver's buffer,
//    arrived = 1;
//  - through the slot: the sender's slot, device memory of the message's size on the sender's
//    GPU, and two words of the sender's flag segment: `full`, 0 at capture, and `empty`, 1.
//    The sender's nodes, at its post: {wait empty == 1; empty = 0}, the copy of the tensor
//    into the slot (on its own GPU), full = 1; the receiver's, at its wait(): {wait full == 1;
//    full = 0}, the copy of the slot into the tensor (the receiver's copy engine reading over
//    NVLink), empty = 1. A send waits only for its receiver's previous replay to have emptied
//    its slot, never for the current one: it completes in any posting order, as an eager send
//    does.
// Each word is set by one side and reset by the other right after its wait, so its values stay
// 0 and 1 and the graphs replay any number of times with the values frozen at capture. (A
// recv's `ready` is set at every replay; only a direct send resets it.)
//
// Ordering: an op's nodes go on its capture's chain (ChainStreams), forked from the caller's
// stream at the post (the chain waits for `posted`, recorded there) and joined by the caller's
// stream at the op's wait() (which waits for `done`). A send's nodes are queued at the post, a
// recv's at its wait(): program order, as for the eager lanes. A recv's `ready` goes on the
// caller's stream at its post, and the chain waits for it at its next join (so a recv never
// waited for forks nothing, and its capture can end).
//
// Deadlock: every wait of a replay is for a node that existed when the waiting node was made: a
// recv's wait() is queued only once its send's nodes are (its announcement came), a direct
// send's only once its recv's `ready` was (its notice came), and within a process the chain
// and the caller's streams hold nodes in the order they were made; a slot's wait is for the
// peer's previous replay. So no wait depends on a node made after it, and the waits form no
// cycle; and since the chain holds every smfree wait of the process in the order they were
// made, each after every `ready` written before it, every node of this process that a wait
// depends on, through a peer, is an ancestor of that wait in the graph and runs before it,
// however the graph's nodes share hardware queues (CUDA_DEVICE_MAX_CONNECTIONS=1 too).
// (Another library's collective in the same graph waits for its peers outside this order, as
// it would beside NCCL's point-to-point kernels.)
//
// Faults: each wait is bracketed by writes of a watched word (GraphWait). A wait that lasts the
// group timeout (a peer that stopped replaying), or any wait of an op whose peer died, is
// released by the progress thread raising the awaited word; the group then refuses its next
// call, naming the op, and its graphs' waits are released at every replay from then on.
class CapturedChannel final : public Channel {
 public:
  // Sends a ChannelNotice's data to a peer (by process key).
  using Notify = std::function<void(const std::string&, std::string)>;

  // How long a captured send waits at its post for its recv's notice (PostedRecvs): ranks that
  // capture a batch of sends and recvs at once post within it of each other.
  static constexpr std::chrono::microseconds kDirectPatience{50000};

  CapturedChannel(CudaOps& cudaOps, const ProgressThread& thread, Failures& failures,
                  Done onDone, Notify notify);
  ~CapturedChannel() override;

  // Caller's thread (CapturedCaller.cpp).
  std::shared_ptr<ChannelOp> prepare(Op& op, const PostOptions& options) override;

  // Progress thread.
  void peerFailed(Peer& peer) override;
  // Nothing to wait for: what a graph's replays owe is theirs.
  void flush(Clock::time_point deadline) override {}
  // Sends the notices of the recvs posted since (PostedRecvs).
  Progress progress() override;
  // It watches no memory: its watchdog runs in sweep().
  bool busy() const override { return false; }
  // A peer's captured recv was posted: a send of this process may copy straight into it.
  // Announcements hold nothing to give back.
  void onNotice(const Notice& notice) override;
  // The watchdog: releases the replays' waits that lasted the group timeout or can no longer
  // end, and lets go of what destroyed graphs held.
  void sweep() override;
  // Process exit: releases every wait a replay may still make.
  void stop() override;
  void report(ChannelReport& report) const override;

 private:
  friend class CapturedChannelOp;

  // The op's part, for its CapturedChannelOp.
  std::string announce(const Op& send);
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                      const std::string& announced);
  void ended(Op& op, const Status& status);
  void waitOnStream(void* stream, CapturedOp& op);

  // Where destroyed graphs leave their ops (from a thread of the CUDA driver, which allows no
  // CUDA call there); the progress thread lets go of them. Once the channel is gone, ops are
  // left to the process's end.
  struct Graveyard {
    std::mutex mutex;
    bool open = true;
    std::vector<std::shared_ptr<CapturedOp>> buried;

    void bury(std::shared_ptr<CapturedOp> op);
  };

  // Caller's thread: the recv's `ready`, and its notice to its sender, at its post.
  // Whether the recv told its sender where its buffer is (and queued its `ready`).
  bool postRecv(CapturedOp& recv, const Op& op, const PostOptions& options, CUstream stream);
  // Caller's thread: the send's nodes, at its post, straight into its recv's buffer where the
  // recv's notice came in time, else through a slot.
  void queueSend(CapturedOp& send, const Op& op);
  void queueDirect(CapturedOp& send, const PostedRecvs::Entry& recv, CUstream chain);
  void queueThroughSlot(CapturedOp& send, CUstream chain);
  // Caller's thread: the recv's nodes, at its first wait().
  void queueRecv(CapturedOp& recv);
  // Progress thread: the watchdog's part.
  void adoptCaptured();
  void buryDestroyed();
  void breakGroup(uint64_t groupId, const std::string& why);
  // Raises the word the op's replays wait on, so a replay waiting there goes on.
  void release(const CapturedOp& op);
  static std::string stuck(const CapturedOp& op);

  const ProgressThread& thread_;
  Failures& failures_;
  cuda::FlagSegment& flags_;
  Done onDone_;
  Notify notify_;
  ChainStreams chains_;
  // Recvs' buffers are exported on callers' threads; the progress thread sweeps what was freed.
  std::mutex exportMutex_;
  cuda::IpcExporter exporter_;
  std::mutex outboxMutex_;
  std::vector<std::pair<std::string, std::string>> outbox_;  // (peer, notice) to send
  PostedRecvs postedRecvs_;
  std::atomic<int64_t> directSends_{0};
  std::shared_ptr<Graveyard> graveyard_ = std::make_shared<Graveyard>();
  mutable std::mutex capturedMutex_;
  std::vector<std::shared_ptr<CapturedOp>> captured_;  // posted, not yet watched
  // Progress thread only.
  std::vector<std::shared_ptr<CapturedOp>> watched_;
  std::map<std::string, std::shared_ptr<cuda::RemoteFlagSegment>> peerWords_;  // by process key

  // The peer's flag segment, mapped and registered with CUDA on first use.
  std::shared_ptr<cuda::RemoteFlagSegment> wordsOf(const Peer& peer);
};

}  // namespace smfree::engine
