#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine/Channel.h"
#include "engine/channels/ucx/HostStaging.h"
#include "engine/channels/ucx/UcxReceiveLane.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Moves bytes with UCX tag send/recv straight between the users' buffers, host or CUDA. Sends
// go out through the engine's worker, to the peer's receive lane (UcxReceiveLane), where recvs
// are posted; each side's two threads move the two directions. The
// receiver posts its recv under tags it owns (from its op id) before it clears the sender, so
// the data never lands in UCX's unexpected queue; the exception is an unstaged CUDA recv whose
// stream has not reached it yet, posted once it has (its sender may be cleared before).
//
// UCX is not stream-aware: a CUDA op waits, here, for its `streamReady` flag (written by the
// caller's stream) before UCX may touch the buffer. Completion reaches the caller through its
// Work on the CPU; no stream waits on UCX, whose own CUDA copies could otherwise queue behind
// that wait in a shared hardware queue (see CudaOp.h). The exception is a staged op, whose
// caller's stream waits for its copies, queued before that wait (UcxCudaState).
//
// Toward a peer that UCX reaches over TCP alone, CUDA buffers go through pinned host memory
// (HostStaging), in pieces so that copies and the network overlap. The caller's thread queues
// those copies (CallerStaging), so this channel makes no CUDA call for them: a send's copies
// out at its post, in pieces of the sender's size, each followed by a stream write of a flag
// word read here, and each piece UCX moves goes once the bytes it spans are out. The receiver
// chooses those pieces and tells the sender with its clear-to-send. A recv's copies in are
// queued by its wait(), each behind a stream wait on a flag word that the receive lane raises
// as the pieces land in order (markLanded). A CUDA recv from any source learns only here
// whether it is staged: its copies in are queued here as its pieces land.
class UcxChannel final : public Channel {
 public:
  // `pieceBytes`: size of the pieces of a staged recv (SMFREE_HOST_STAGING_PIECE_BYTES); 0 for
  // one piece.
  // `sendWorker` is the engine's (its thread calls every method here); `receiveLane` the one
  // that recvs are posted on.
  UcxChannel(UcxWorker& sendWorker, UcxReceiveLane& receiveLane, const cuda::FlagSegment& flags,
             uint64_t pieceBytes, Done onDone);
  ~UcxChannel() override;

  void prepareSend(const std::shared_ptr<Op>& send, Peer& destination) override;
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;
  bool progress() override;
  bool busy() const override;
  // The device of the latest CUDA buffer handed to UCX; -1 before the first.
  int cudaDevice() const { return cudaDevice_; }
  uint64_t hostStagedSends() const { return hostStagedSends_; }
  uint64_t hostStagedRecvs() const { return hostStagedRecvs_; }
  uint64_t hostStagingCachedBytes() const { return staging_.cachedBytes(); }
  HostStaging& staging() { return staging_; }
  // Whether CUDA buffers to or from `peer` go through host memory; decided, and logged, once.
  bool stagesCudaToward(Peer& peer);

 private:
  struct Movement;
  struct Transfer;
  // A UCX request's end, as its callback saw it: applied to its movement in progress().
  struct Completion {
    Transfer* transfer;  // owned from here
    void* request;
    ucs_status_t status;
    size_t length;  // bytes received (recvs)
  };
  static void onSent(void* request, ucs_status_t status, void* userData);
  static void onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* userData);
  bool streamReached(const Op& op) const;
  // Whether the op's bytes go through host memory: a CUDA op toward a peer reached by TCP only.
  // Decided, and logged, once per peer.
  bool stagesThroughHost(const Op& op, Peer& peer);
  bool onlyTcpToward(const Peer& peer) const;
  Movement& track(const std::shared_ptr<Op>& op, Peer* destination);
  // Moves what the movement's state allows; true if anything changed.
  bool advance(Movement& movement);
  bool startOnceStreamReached(Movement& movement);
  bool transmitCopiedPieces(Movement& movement);
  bool copyInLandedPieces(Movement& movement);
  bool countCopiedInPieces(Movement& movement);
  bool countCopiedOut(Movement& movement);
  // A failed caller-staged recv whose copies in its caller queued: lets them run.
  void releaseWaitingCopiesIn(Movement& movement);
  // Receive lane's thread: a caller-staged recv's piece has landed.
  void markLanded(Movement& movement, uint32_t piece);
  void postPiece(Movement& movement, uint32_t piece);
  bool ended(const Movement& movement) const;
  void enqueue(const Completion& completion, bool wakeEngine);
  bool applyCompletions();
  void finish(const Completion& completion);
  ucp_worker_h workerOf(const Movement& movement);

  UcxWorker& sendWorker_;
  UcxReceiveLane& receiveLane_;
  const cuda::FlagSegment& flags_;
  uint64_t pieceBytes_;
  Done onDone_;
  HostStaging staging_;
  // By op id. Only progress() changes a movement after a post, applying what the callbacks
  // queued: they run on the receive lane's thread, or inside the calls that post and cancel.
  std::unordered_map<uint64_t, std::unique_ptr<Movement>> movements_;
  std::unordered_map<const Peer*, bool> stagingDecisions_;  // peers live as long as the engine
  // Filled by callbacks on either thread.
  mutable std::mutex completionsMutex_;
  std::vector<Completion> completions_;
  int cudaDevice_ = -1;
  uint64_t hostStagedSends_ = 0;
  uint64_t hostStagedRecvs_ = 0;
};

}  // namespace smfree::engine
