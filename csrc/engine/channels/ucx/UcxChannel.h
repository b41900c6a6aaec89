#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/Channel.h"
#include "engine/channels/ucx/HostStaging.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Moves bytes with UCX tag send/recv straight between the users' buffers, host or CUDA. The
// receiver posts its recv under a tag it owns (its op id) before it clears the sender, so the
// data never lands in UCX's unexpected queue; the exception is an unstaged CUDA recv whose
// stream has not reached it yet, posted once it has (its sender may be cleared before).
//
// UCX is not stream-aware: a CUDA op waits, here, for its `streamReady` flag (written by the
// caller's stream) before UCX may touch the buffer. Completion reaches the caller through its
// Work on the CPU; no stream waits on UCX, whose own CUDA copies could otherwise queue behind
// that wait in a shared hardware queue (see CudaOp.h).
//
// Toward a peer that UCX reaches over TCP alone, CUDA buffers go through pinned host memory
// (HostStaging): a send is copied out once its stream reaches it, then UCX sends the host
// copy; a recv lands in host memory at once and is copied in once its stream reaches it.
class UcxChannel final : public Channel {
 public:
  UcxChannel(UcxWorker& worker, const cuda::FlagSegment& flags, Done onDone);

  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;
  bool progress() override;
  bool busy() const override { return !waiting_.empty() || !staged_.empty(); }
  // The device of the latest CUDA buffer handed to UCX; -1 before the first.
  int cudaDevice() const { return cudaDevice_; }
  uint64_t hostStagedSends() const { return hostStagedSends_; }
  uint64_t hostStagedRecvs() const { return hostStagedRecvs_; }
  uint64_t hostStagingCachedBytes() const { return staging_.cachedBytes(); }

 private:
  struct Transfer;
  // A CUDA op whose stream has not reached it; `destination` is null for a recv.
  struct Waiting {
    std::shared_ptr<Op> op;
    Peer* destination;
    ucp_tag_t tag;
  };
  // A CUDA op between its copy and UCX: a send copied out (then sent from `host`), or a recv
  // whose bytes are in `host` (copied in once its stream reaches it, then done).
  struct Staged {
    std::shared_ptr<Op> op;
    std::shared_ptr<cuda::PinnedMemory> host;
    std::shared_ptr<cuda::Event> copied;  // null: a recv not yet copied in
    Peer* destination;                   // null for a recv
    ucp_tag_t tag;
  };
  static void onSent(void* request, ucs_status_t status, void* userData);
  static void onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* userData);
  bool streamReached(const Op& op) const;
  // Whether the op's bytes go through host memory: a CUDA op toward a peer reached by TCP only.
  // Decided, and logged, once per peer.
  bool stagesThroughHost(const Op& op, Peer& peer);
  bool onlyTcpToward(const Peer& peer) const;
  void postRecv(const std::shared_ptr<Op>& recv, ucp_tag_t tag,
                std::shared_ptr<cuda::PinnedMemory> host);
  void postSend(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag);
  void transmit(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag,
                std::shared_ptr<cuda::PinnedMemory> host);
  void copyOut(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag);
  bool advanceWaiting();
  bool advanceStaged();
  // Posts one UCX request for `op` (on `host` when staged) through `call(params)`; the status
  // of the posting.
  template <typename Call>
  ucs_status_t post(const std::shared_ptr<Op>& op, std::shared_ptr<cuda::PinnedMemory> host,
                    Call&& call);
  void finish(Transfer& transfer, void* request, const Status& status);
  ucp_request_param_t requestParams(Transfer& transfer) const;

  UcxWorker& worker_;
  const cuda::FlagSegment& flags_;
  Done onDone_;
  std::vector<Waiting> waiting_;
  HostStaging staging_;
  std::vector<Staged> staged_;
  std::unordered_map<const Peer*, bool> stagingDecisions_;  // peers live as long as the engine
  int cudaDevice_ = -1;
  uint64_t hostStagedSends_ = 0;
  uint64_t hostStagedRecvs_ = 0;
};

}  // namespace smfree::engine
