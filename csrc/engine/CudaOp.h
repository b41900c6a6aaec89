#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/PinnedMemory.h"

namespace smfree::engine {

// The stream-side state of an op on a CUDA buffer.
//
// The rule that keeps streams from deadlocking: no stream waits for work that has not been
// submitted to the GPU yet. Streams of one process share hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), so a wait queued ahead of a later-submitted copy in the
// same queue holds that copy back for good. Hence `queued`: the user's stream waits for the
// copy only once `queued` says the copy has been submitted. The one exception, a staged recv
// matched with a promised send (CallerStaging), waits for bytes on the network, and only for
// ones whose path is submitted work and threads that make no CUDA call: once a caller's CPU
// has filled the command queue behind such a wait, any CUDA call may block inside the driver
// (a four-stage megatron-core run over TCP hung so when the progress thread set the words).
//
// What a signal costs decides its form. On the DMA stream every memory write after a copy
// costs about 3 µs (measured on H200: 4 writes made a 16 MiB copy 27 % slower), an event
// record nothing. So a send, whose signals stay inside its process, uses events; a recv,
// signalled by the sender's process, uses words of its flag segment, and the copy writes one.
struct CudaOpState {
  cuda::Flag queued;  // the copy is submitted, or the op failed (set by a CPU)

  // Recv: written by the caller's stream when it reaches the op (the buffer is free).
  cuda::Flag ready;
  // Recv: what user streams wait on (>= value). The word goes to `value` when the receiver
  // fails the op, `value + 1` (kCopied) when the copy has written the buffer, `value + 2`
  // (kSenderGaveUp) when the sender's CPU gave up before submitting it.
  cuda::Flag done;

  // Send: recorded on the caller's stream when it reaches the op (the source is produced).
  std::shared_ptr<cuda::Event> produced;
  // Send: recorded on the DMA stream after the copy; user streams wait on it.
  std::shared_ptr<cuda::Event> copied;
};

// A CUDA op over UCX staged through pinned host memory whose copies its caller's thread
// submits: a send's copies out at its post, before its announcement, a recv's copies in at its
// wait() once it has matched (Engine::queueCopiesInOnceMatched). The progress thread makes no
// CUDA call for it.
struct CallerStaging {
  std::shared_ptr<cuda::PinnedMemory> host;
  void* data = nullptr;  // the op's CUDA buffer
  uint64_t bytes = 0;
  int device = -1;
  uint64_t pieceBytes = 0;  // 0: one piece
  uint32_t pieces = 1;
  // Send: the DMA stream raises it to `progress.value + k` once pieces 0..k are in host memory.
  // Recv: the receive lane raises it so once pieces 0..k have landed.
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
// waits for such an op to end; but an op staged through host memory touches the buffer only
// with copy engines, so there the caller's stream waits for those copies (`copied`) and the
// CPU only for them to be queued (`queued`): a send's once its receiver has cleared it (its
// copy out is queued at the post), a recv's once its wait() has queued its copies in. An
// unstaged op sets `queued` when it ends, and never records `copied`.
struct UcxCudaState {
  cuda::Flag queued;
  // Recorded on the caller's stream at the post: a staged op's copies wait for it (the source
  // is produced, or the destination free).
  std::shared_ptr<cuda::Event> reached;
  std::shared_ptr<cuda::Event> copied;
  std::shared_ptr<CallerStaging> staging;  // staged through host memory by the caller
};

// Values of a recv's `done` word above the flag's own.
constexpr uint32_t kCopied = 1;
constexpr uint32_t kSenderGaveUp = 2;
constexpr uint32_t kDoneSpan = 3;

// Flag words per op, and words kept back for staging rings (two per ring, one ring per
// sending process and device): the flag segment holds
// (FlagSegment::kWords - kStagingFlagWords) / kFlagsPerCudaOp ops.
constexpr size_t kFlagsPerCudaOp = 4;  // a staged recv: ready, queued, progress, copiedIn
constexpr size_t kStagingFlagWords = 256;

// What a caller needs to make its stream wait for a CUDA op: a recv's `done` flag, or a
// send's `copied` event.
struct CudaFence {
  cuda::Flag queued;
  cuda::Flag done;
  std::shared_ptr<cuda::Event> copied;
  std::shared_ptr<CallerStaging> stagedRecv;  // its wait() queues its copies in
};

}  // namespace smfree::engine
