#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "engine/Op.h"
#include "engine/channels/ucx/UcxCudaOp.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/PinnedMemory.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// A relayed buffer's pieces: their size (0 for one piece) as `preferred` allows, and count.
constexpr uint64_t kMostRelayPieces = uint64_t{1} << 20;
uint64_t relayPieceBytes(uint64_t bytes, uint64_t preferred);
uint64_t relayPieceCount(uint64_t bytes, uint64_t pieceBytes);

// Copies between CUDA buffers and page-locked host memory on the copy engines, for UCX
// paths that move host memory faster than CUDA memory. Over TCP, UCX copies CUDA memory in
// pieces of one TCP segment, each copy synchronous ("fragmented copy-in copy-out"): a 16 MiB
// exchange between two H200s took 18 ms that way and 8 ms from pinned host memory.
// Thread-safe: the progress thread and callers' threads queue copies.
class HostRelay {
 public:
  HostRelay();
  HostRelay(const HostRelay&) = delete;
  HostRelay& operator=(const HostRelay&) = delete;

  // Host memory of at least `bytes`, allocated in `device`'s context when the cache has none
  // of its size class; it goes back to the cache when its last holder drops it.
  std::shared_ptr<cuda::PinnedMemory> take(int device, uint64_t bytes);
  // A recv from any source, relayed by the progress thread: queues the copy of `bytes` at
  // `offset` of the host memory to the same offset of the buffer on the device's copy-in
  // stream; the returned event is recorded after it.
  std::shared_ptr<cuda::Event> copyToDevice(const cuda::PinnedMemory& from, const Buffer& to,
                                            uint64_t offset, uint64_t bytes);
  // Copies queued from now on for `device` wait for `event`'s last record.
  void copyToDeviceAfter(int device, const cuda::Event& event);
  // Records `event` after the copies queued so far for `device`.
  void recordAfterCopiesToDevice(int device, cuda::Event& event);
  // A caller-relayed send (CallerRelay): its copies out, piece by piece, after `reached`;
  // the stream raises `progress` after each, and records `copied` after the last.
  void copyOutInPieces(const CallerRelay& relay, cuda::FlagSegment& flags);
  // A caller-relayed recv: its copies in, each after its piece has landed (the stream waits
  // for `progress`) and after `reached`; then the stream writes `copiedIn` and records
  // `copied`.
  void copyInAsPiecesLand(const CallerRelay& relay, cuda::FlagSegment& flags);
  uint64_t cachedBytes() const;

 private:
  struct Cache;
  using Streams = std::map<int, std::unique_ptr<cuda::Stream>>;
  cuda::Stream& streamOf(Streams& streams, int device, const char* direction);
  // Queues `bytes` from `from` to `to` on the device's stream in `streams`.
  std::shared_ptr<cuda::Event> copy(Streams& streams, int device, const char* direction,
                                    const void* to, const void* from, uint64_t bytes);

  std::shared_ptr<Cache> cache_;
  std::mutex streamsMutex_;  // guards the maps and keeps each caller's copies together
  // After cache_, so they are destroyed first: a stream waits for its copies when it goes.
  Streams toHost_;
  Streams toDevice_;
};

}  // namespace smfree::engine
