#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "engine/Status.h"
#include "engine/TensorDesc.h"
#include "engine/Wire.h"
#include "engine/cuda/Capture.h"

namespace smfree::engine {

using Clock = std::chrono::steady_clock;

constexpr int kAnySource = -1;
// The line the backend's collectives post their messages on; users' tags are 0 and up. All
// ranks call a group's collectives in one order, so the n-th message of this line between two
// ranks is the same collective's on both. Its peers post their halves at about the same time:
// its messages go by rendezvous, one copy into the receiver's tensor, never through a slot.
constexpr int kCollectiveTag = -1;

enum class OpKind : uint8_t { kSend, kRecv };
enum class MemoryKind : uint8_t { kHost, kCuda };

struct Buffer {
  void* data = nullptr;
  uint64_t bytes = 0;
  MemoryKind memory = MemoryKind::kHost;
  int device = -1;
};

// Runs once, on the progress thread; `source` is the rank the op was matched with (-1 if never).
using OpCallback = std::function<void(const Status& status, int source)>;

// One point-to-point op as a caller asks for it.
struct OpRequest {
  OpKind kind = OpKind::kSend;
  int peer = 0;  // group rank, or kAnySource for a recv
  int tag = 0;
  Buffer buffer;
  TensorDesc desc;
  std::shared_ptr<void> keepalive;  // the caller's memory, held until no transport touches it
  // Sends, optional: why the caller's memory no longer holds the call's bytes (freed or resized
  // since), or nothing; asked on the progress thread as the bytes start moving, before kReleased.
  std::function<std::optional<std::string>()> bufferCheck;
  OpCallback onComplete;
  // Recvs from any source: runs on the progress thread with the sender's rank once the op has
  // matched a send, before any of its bytes move.
  std::function<void(int source)> onMatched;
  void* stream = nullptr;  // CUDA buffers: the caller's current stream (CUstream)
  // CUDA buffers: the CUDA graph capture `stream` takes part in, as Group::checkCapture found
  // it at the call; none: the op is not captured.
  std::optional<cuda::Capture> capture;
};

struct GroupConfig;
class ChannelOp;

// An op's life on the progress thread, in order; OpControl::transition() is the one place
// it changes, and only forward.
enum class OpState : uint8_t {
  kPosted,    // handed to the progress thread, not started (or held back, see OpControl)
  kWaiting,   // send: announced, waiting for its clear-to-send; recv: waiting for a match
  kMoving,    // a channel moves the bytes
  kEnded,     // the caller was told the outcome; a channel may still hold the buffer
  kReleased,  // no channel holds the buffer: the op is forgotten
};

// An op inside the engine. Touched only on the progress thread once posted.
// Shared: a channel that must keep an ended op past its end (a copy still writing its buffer)
// takes a reference from it.
struct Op : std::enable_shared_from_this<Op> {

  uint64_t id = 0;
  OpRequest request;
  uint64_t groupId = 0;
  std::shared_ptr<const GroupConfig> config;
  Clock::time_point posted;
  Clock::time_point deadline;

  OpState state = OpState::kPosted;
  uint64_t seq = 0;        // send: position in its (group, receiver, tag) stream
  int source = -1;         // recv: the rank it was matched with
  int outstanding = 0;     // channel requests that still reference the buffer
  bool awaitsProgress = false;  // live, and its caller's wait() may wait for the progress thread
  ChannelKind channel = ChannelKind::kUcx;  // chosen at the post; CPU tensors go over UCX
  // Its channel's part of it (Channel::prepare, at the post): what the channel took for the op
  // (flags, events, staging) and what it keeps while the op lives.
  std::shared_ptr<ChannelOp> channelOp;

  bool isSend() const { return request.kind == OpKind::kSend; }
  bool isCollective() const { return request.tag == kCollectiveTag; }
  bool finished() const { return state >= OpState::kEnded; }
  // The rank this op talks to: its requested peer, or for any-source recvs the matched one.
  int partner() const { return request.peer != kAnySource ? request.peer : source; }
  // e.g. "send to rank 1 (group '0', tag 3, float32[4] (16 B))"
  std::string describe() const;
};

}  // namespace smfree::engine
