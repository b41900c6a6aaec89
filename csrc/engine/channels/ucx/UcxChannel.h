#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/Channel.h"
#include "engine/Config.h"
#include "engine/CudaOps.h"
#include "engine/ProgressThread.h"
#include "engine/Spin.h"
#include "engine/channels/ucx/HostRelay.h"
#include "engine/channels/ucx/UcxReceiveWorker.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/transports/ucx/UcxContext.h"
#include "engine/transports/ucx/UcxEndpoint.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

class UcxChannelOp;
struct UcxMovement;
struct UcxTransfer;

// Moves bytes with UCX tag send/recv straight between the users' buffers, host or CUDA. Sends
// go out through the engine's worker, to the peer's receive worker (UcxReceiveWorker), where recvs
// are posted; each side's two threads move the two directions. The
// receiver posts its recv under tags it owns (from its op id) before it clears the sender, so
// the data never lands in UCX's unexpected queue; the exception is an unrelayed CUDA recv whose
// stream has not reached it yet, posted once it has (its sender may be cleared before).
//
// UCX is not stream-aware: a CUDA op waits, here, for its `streamReady` flag (written by the
// caller's stream) before UCX may touch the buffer. Completion reaches the caller through its
// Work on the CPU; no stream waits on UCX, whose own CUDA copies could otherwise queue behind
// that wait in a shared hardware queue (see CudaFence.h). The exception is a relayed op, whose
// caller's stream waits for its copies, queued before that wait (UcxCudaOp).
//
// Toward a peer that UCX reaches over TCP alone, CUDA buffers go through pinned host memory
// (HostRelay), in pieces so that copies and the network overlap. The caller's thread queues
// those copies (CallerRelay), so this channel makes no CUDA call for them: a send's copies
// out at its post, in pieces of the sender's size, each followed by a stream write of a flag
// word read here, and each piece UCX moves goes once the bytes it spans are out. The receiver
// chooses those pieces and tells the sender with its clear-to-send. A recv's copies in are
// queued by its wait(), each behind a stream wait on a flag word that the receive worker raises
// as the pieces land in order (markLanded). A CUDA recv from any source learns only here
// whether it is relayed: its copies in are queued here as its pieces land.
//
// Promises (UcxCommitments.cpp): while neither the progress thread nor the receive worker has
// made a CUDA call, relayed sends are announced as promised, and a relayed recv matched with a
// promised send lets its caller queue its copies in at once, to wait on the GPU for pieces
// still on the network. The first op that needs a CUDA call on the progress thread ends that
// for good; it is held back (admit(), the admission hook) until no commitment is in flight: no
// promised send still moving (a receiver's stream may wait for it), no recv whose copies in
// wait on one; and so are the ops started after it, of every channel (ops start in posting
// order: they match in it).
class UcxChannel final : public Channel {
 public:
  // Starts an op that admit() held back, once it may start.
  using Start = std::function<void(const std::shared_ptr<Op>&)>;

  // `sendWorker` is the engine's (its thread calls every progress-thread method here); the
  // channel's receive worker, where recvs are posted, gets a worker of its own on `context`.
  UcxChannel(const UcxContext& context, UcxWorker& sendWorker, CudaOps& cudaOps,
             const ProgressThread& thread, const Config& config, const Spin& spin,
             Done onDone, Start start);
  ~UcxChannel() override;

  // Where peers send data: the receive worker's worker address.
  std::vector<uint8_t> receiveAddress();

  // Caller's thread (UcxCaller.cpp).
  std::shared_ptr<ChannelOp> prepare(Op& op, const PostOptions& options) override;

  // Progress thread.
  PeerRoute connect(Peer& peer, const PeerError& onError) override;
  void disconnect(Peer& peer) override;
  // Nothing to do: UCX ends a failed peer's requests itself, and its endpoint goes at
  // disconnect().
  void peerFailed(Peer& peer) override {}
  // Flushes the endpoints, then ends the recvs still inside UCX (settleRecvs), and fails the
  // ops admit() still holds.
  void flush(Clock::time_point deadline) override;
  bool admit(const std::shared_ptr<Op>& op) override;
  // Its peers send it none; a closed group's ops that admit() holds fail.
  void onNotice(const Notice& notice) override;
  Progress progress() override;
  bool busy() const override;
  void stop() override { ownedReceiveWorker_->stop(); }
  void report(ChannelReport& report) const override;

 private:
  friend class UcxChannelOp;
  // A UCX request's end, as its callback saw it: applied to its movement in progress().
  struct Completion {
    UcxTransfer* transfer;  // owned from here
    void* request;
    ucs_status_t status;
    size_t length;  // bytes received (recvs)
  };
  static void onSent(void* request, ucs_status_t status, void* userData);
  static void onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* userData);
  // The op's part, for its UcxChannelOp (UcxTransfers.cpp, UcxCommitments.cpp, UcxCaller.cpp).
  ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer& destination);
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source);
  void cleared(const std::shared_ptr<Op>& recv, bool sendPromised);
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData);
  void cancel(Op& op);
  void ended(Op& op);
  void release(Op& op);
  bool outlivesWait(const Op& op) const;

  // Sender, as the send starts: whether it is promised (ReadyToSend::promised).
  bool promiseSend(Op& send);
  // Sender, as the send starts: tracks a caller-relayed send, whose copies out are queued.
  void prepareSend(const std::shared_ptr<Op>& send, Peer& destination);
  // The progress thread makes CUDA calls from now on, the first time for `op`.
  void progressThreadCallsCuda(const Op& op);
  // Starts the ops admit() held, once no commitment is in flight.
  void startHeldOps();
  // The part CPU tensors' ops share (hostOp_), made beside prepare(), which makes every op's.
  std::shared_ptr<UcxChannelOp> makeHostOp();
  // Caller's thread: relays a CUDA op through host memory; a send's copies out are queued.
  std::shared_ptr<CallerRelay> relayFromCaller(const Op& op, const UcxCudaOp& state);
  // Caller's thread, a caller-relayed recv: queues its copies in, which wait on the GPU for
  // their pieces to land, and sets `queued`, if its match allows that now; true once `queued`
  // is set (also by a failure).
  bool queueCopiesInOnceMatched(CallerRelay& relay);
  // Whether CUDA buffers to or from `peer` go through host memory; decided, and logged, once.
  bool relaysCudaToward(const Peer& peer);
  UcxEndpoint* endpointOf(const Peer& peer) const;
  bool streamReached(const Op& op) const;
  // Whether the op's bytes go through host memory: a CUDA op toward a peer reached by TCP only.
  // Decided, and logged, once per peer.
  bool relaysThroughHost(const Op& op, const Peer& peer);
  bool onlyTcpToward(const UcxEndpoint& endpoint, const Peer& peer) const;
  UcxMovement& track(const std::shared_ptr<Op>& op, Peer& peer);
  // Moves what the movement's state allows; true if anything changed. Runs once the queued
  // completions are applied: a failed movement's requests are cancelled here.
  bool advance(UcxMovement& movement);
  // The movement's requests whose completions are not applied: UCX ends them (cancelled)
  // unless they completed meanwhile.
  void cancelRequests(UcxMovement& movement);
  bool startOnceStreamReached(UcxMovement& movement);
  bool transmitCopiedPieces(UcxMovement& movement);
  bool copyInLandedPieces(UcxMovement& movement);
  bool countCopiedInPieces(UcxMovement& movement);
  bool countCopiedOut(UcxMovement& movement);
  // A failed caller-relayed recv whose copies in its caller queued: lets them run.
  void releaseWaitingCopiesIn(UcxMovement& movement);
  // Receive worker's thread: a caller-relayed recv's piece has landed.
  void markLanded(UcxMovement& movement, uint32_t piece);
  void postPiece(UcxMovement& movement, uint32_t piece);
  bool movementEnded(const UcxMovement& movement) const;
  void enqueue(const Completion& completion, bool wakeEngine);
  bool applyCompletions();
  void finish(const Completion& completion);
  // Shutdown, the progress thread gone: cancels the recvs still posted, and waits, up to
  // `deadline` and a few keepalive rounds, for those UCX had matched to end. UCX destroys the
  // receive worker's worker only if no endpoint of it still tracks a request, and asserts so
  // (Debian's UCX aborts): a matched recv from a peer that died stays tracked until UCX's
  // keepalive finds the peer gone and ends it.
  void settleRecvs(Clock::time_point deadline);
  bool recvsInUcx() const;

  // First: it outlives the endpoints, whose flushes peers' sends to it may wait on.
  std::unique_ptr<UcxReceiveWorker> ownedReceiveWorker_;
  UcxReceiveWorker& receiveWorker_;
  UcxWorker& sendWorker_;
  CudaOps& cudaOps_;
  const ProgressThread& thread_;
  cuda::FlagSegment& flags_;
  const uint64_t pieceBytes_;
  const CudaChannel cudaChannel_;
  const std::chrono::milliseconds peerCheck_;  // UCX's keepalive interval
  Done onDone_;
  Start start_;
  HostRelay relay_;
  // CPU tensors' ops keep nothing here from their post: they share this part.
  std::shared_ptr<UcxChannelOp> hostOp_;
  std::once_flag announcedCuda_;
  // By peer: to its receive worker. Dropped when the channel goes, or a failed same-host peer is
  // disconnected.
  std::unordered_map<const Peer*, std::unique_ptr<UcxEndpoint>> endpoints_;
  // By op id. Only progress() changes a movement after a post, applying what the callbacks
  // queued: they run on the receive worker's thread, or inside the calls that post and cancel.
  std::unordered_map<uint64_t, std::unique_ptr<UcxMovement>> movements_;
  std::unordered_map<const Peer*, bool> relayDecisions_;  // peers live as long as the engine
  // Progress thread: see the class comment.
  bool promising_ = true;
  std::string stoppedPromising_;  // the op that ended it
  size_t commitments_ = 0;
  // Ops that make CUDA calls on this thread, held while commitments are in flight, and the
  // ops started after them.
  std::deque<std::shared_ptr<Op>> heldOps_;
  // Filled by callbacks on either thread.
  mutable std::mutex completionsMutex_;
  std::vector<Completion> completions_;
  int cudaDevice_ = -1;
  uint64_t relayedSends_ = 0;
  uint64_t relayedRecvs_ = 0;
};

}  // namespace smfree::engine
