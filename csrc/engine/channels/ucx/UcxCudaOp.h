#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "engine/Channel.h"
#include "engine/Op.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/PinnedMemory.h"

namespace smfree::engine {

// A CUDA op over UCX relayed through pinned host memory whose copies its caller's thread
// submits: a send's copies out at its post, before its announcement, a recv's copies in at its
// wait() once it has matched (UcxChannelOp::queued). The progress thread makes
// no CUDA call for it.
struct CallerRelay {
  std::shared_ptr<cuda::PinnedMemory> host;
  void* data = nullptr;  // the op's CUDA buffer
  uint64_t bytes = 0;
  int device = -1;
  uint64_t pieceBytes = 0;  // 0: one piece
  uint32_t pieces = 1;
  // Send: the DMA stream raises it to `progress.value + k` once pieces 0..k are in host memory.
  // Recv: the receive worker raises it so once pieces 0..k have landed.
  cuda::Flag progress;
  cuda::Flag copiedIn;  // recv: written by the DMA stream after the last copy in
  std::atomic<int> matched{0};  // recv: kUnmatched, kMatchedPromised or kMatchedUnpromised
  // Recv: who queues the copies in. A caller's thread claims it (kByCaller) once the match
  // allows; a failure that comes first claims it (kNever) so that no copy is queued.
  std::atomic<int> copiesIn{0};  // kCopiesInOpen, kCopiesInByCaller or kCopiesInNever
  std::shared_ptr<cuda::Event> reached;
  std::shared_ptr<cuda::Event> copied;
  cuda::Flag queued;

  // Matched with a promised send (ReadyToSend::promised), the clear-to-send sent: the copies
  // in may be queued at once. Unpromised: only once every piece has landed.
  static constexpr int kUnmatched = 0;
  static constexpr int kMatchedPromised = 1;
  static constexpr int kMatchedUnpromised = 2;
  static constexpr int kCopiesInOpen = 0;
  static constexpr int kCopiesInByCaller = 1;
  static constexpr int kCopiesInNever = 2;
  cuda::Flag lastPiece() const { return progress.plus(pieces - 1); }
};

// The stream-side state of a CUDA op over UCX. UCX is not stream-aware, so the caller's CPU
// waits for such an op to end; but an op relayed through host memory touches the buffer only
// with copy engines, so there the caller's stream waits for those copies (`copied`) and the
// CPU only for them to be queued (`queued`): a send's once its receiver has cleared it (its
// copy out is queued at the post), a recv's once its wait() has queued its copies in. An
// unrelayed op sets `queued` when it ends, and never records `copied`.
struct UcxCudaOp {
  // Written by the caller's stream once the work queued before the op is done; UCX touches
  // the buffer only after that.
  cuda::Flag streamReady;
  cuda::Flag queued;
  // Recorded on the caller's stream at the post: a relayed op's copies wait for it (the source
  // is produced, or the destination free).
  std::shared_ptr<cuda::Event> reached;
  std::shared_ptr<cuda::Event> copied;
  std::shared_ptr<CallerRelay> relay;  // relayed through host memory by the caller
  // A send announced as promised, or a recv matched with one whose copies in may wait on the
  // GPU (UcxChannel's commitments).
  bool promised = false;
};

// The UCX channel's part of an op (Op::channelOp) holds its UcxCudaOp, none for a CPU tensor,
// which the channel's files reach from the op alone (ucxCudaOp()). Its steps are the
// channel's (UcxChannelOp.h).
class UcxCudaOpHolder : public ChannelOp {
 public:
  UcxCudaOpHolder(OpTraits traits, std::optional<UcxCudaOp> cuda)
      : ChannelOp(traits), cuda_(std::move(cuda)) {}
  UcxCudaOp* cuda() { return cuda_ ? &*cuda_ : nullptr; }

 private:
  std::optional<UcxCudaOp> cuda_;
};

// The op's UCX CUDA state; null for a CPU tensor.
inline UcxCudaOp* ucxCudaOp(const Op& op) {
  return static_cast<UcxCudaOpHolder*>(op.channelOp.get())->cuda();
}

}  // namespace smfree::engine
