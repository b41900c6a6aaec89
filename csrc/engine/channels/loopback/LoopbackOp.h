#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

struct LoopbackPair;

// One op to the rank itself, from its post to its end (LoopbackChannelOp holds it). The first
// fields are set at the post and only read after it; `copied` is set before `queued`; the rest
// is under the pairing's mutex.
struct LoopbackOp {
  // Until it has ended and its pair's exchange is done: the op holds this through its
  // ChannelOp, so keeping it longer would keep the op forever.
  std::shared_ptr<Op> op;
  std::shared_ptr<void> keepalive;  // the caller's memory, held until no copy touches it
  // A CUDA op: the CUDA graph capture its stream took part in at the call, if any. Two ops
  // meet only within one capture, or both outside any: a graph waits only for its own work.
  std::optional<uint64_t> capture;
  // A CUDA op: its stream as it was at its post, which the copy waits for if its partner
  // comes later.
  std::shared_ptr<cuda::Event> posted;
  // Its group timeout from its post: past it, the progress thread fails it. It tells its
  // caller so before it leaves its line (LoopbackPairing::ended), so a later post must not
  // pair with it meanwhile.
  Clock::time_point deadline = Clock::time_point::max();
  // Recorded after the copy of a CUDA pair with bytes: what the waiting stream waits for.
  std::shared_ptr<cuda::Event> copied;
  // Its copy is queued, done or failed, or the op ended: its wait() may return.
  std::atomic<bool> queued{false};

  std::shared_ptr<LoopbackPair> pair;  // set once its partner is posted
  bool reported = false;               // it has ended
};

// A send and the recv it met. Its ops hold it, not the reverse: an op is forgotten once it
// ended, while an uncaptured copy in flight keeps the pair, and with it both buffers.
struct LoopbackPair {
  std::weak_ptr<LoopbackOp> send;
  std::weak_ptr<LoopbackOp> recv;
  std::shared_ptr<void> sendMemory;
  std::shared_ptr<void> recvMemory;
  // An uncaptured CUDA copy: the word its stream sets after it, which the progress thread reads.
  std::optional<cuda::Flag> done;
  std::optional<Status> outcome;  // once known
  bool exchanged = false;         // the later post is done with both ops
};

}  // namespace smfree::engine
