#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "engine/Op.h"
#include "engine/channels/captured/GraphWait.h"
#include "engine/cuda/Bounce.h"
#include "engine/cuda/DeviceMemory.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// How a captured send's bytes reach its receiver's buffer (CapturedChannel.h).
enum class CapturedWay : uint32_t {
  kSlot = 1,    // through a slot of the sender's: the send waits for nothing of this replay
  kDirect = 2,  // straight into the buffer of a recv posted before the send: one copy
};

// Where a captured send's slot is, and the two words of the sender's flag segment its graph
// and the receiver's hand each other.
struct CapturedSlot {
  cuda::Flag full;   // 1 once the slot holds the bytes of the sender's latest replay
  cuda::Flag empty;  // 1 once the receiver's replay has copied them out
  cuda::IpcExport memory;
};

// What a captured send tells its receiver with its announcement: its way, and its slot where
// it has one.
struct CapturedAnnouncement {
  CapturedWay way = CapturedWay::kSlot;
  CapturedSlot slot;  // kSlot only

  void appendTo(std::string& out) const;
  // Throws BadPeerValue (PeerValue.h) on malformed bytes or a word out of the flag segment.
  static CapturedAnnouncement read(const std::string& data);
};

// One op captured in a CUDA graph: what its graph's nodes use, shared by the op (the progress
// thread, until the op has matched at capture), its fence (the caller's wait()) and the graph
// (which keeps it until the graph is destroyed, CapturedChannel's graveyard).
struct CapturedOp {
  enum class Phase : int {
    kPosted,   // a recv waiting for its match
    kMatched,  // a recv that knows its sender's slot: its wait() puts its nodes in the graph
    kQueued,   // its nodes are in the graph (a send's at its post), or it has none (0 B)
    kFailed,   // it failed at capture: its wait() raises
  };

  // Fixed at the post.
  bool isSend = false;
  std::string what;  // Op::describe()
  uint64_t groupId = 0;
  std::string peerKey;
  int peerRank = 0;
  uint64_t captureId = 0;
  Buffer buffer;
  // The caller's memory, held as long as the graph: its nodes read or write it at every replay,
  // and memory freed during the capture would go to later allocations of the same graph.
  std::shared_ptr<void> keepalive;
  std::chrono::milliseconds timeout{0};  // the group's: how long a replay's wait may last
  std::unique_ptr<cuda::OwnedFlag> waiting;  // the word of `watch`, in this process's segment
  // The caller's stream at the post (after a recv's `ready`: its chain waits for it too).
  std::shared_ptr<cuda::Event> posted;
  std::unique_ptr<cuda::Event> done;         // after the op's last node in the graph

  // A send's way, fixed at its post; a recv's, learnt at its match.
  CapturedWay way = CapturedWay::kSlot;

  // Send through a slot: its slot, and the words of its handshake (this process's). Where
  // copies within one GPU go through a peer GPU, the slot lies there, so that the copy into it
  // is one hop.
  std::unique_ptr<cuda::DeviceMemory> slot;
  std::unique_ptr<cuda::OwnedFlag> full;
  std::unique_ptr<cuda::OwnedFlag> empty;

  // Send straight into its recv's buffer: that buffer mapped here (at `destination`), and the
  // receiver's words of the handshake.
  std::unique_ptr<cuda::PeerMapping> destinationMapping;
  CUdeviceptr destination = 0;
  std::shared_ptr<cuda::RemoteFlagSegment> receiverWords;
  cuda::Flag receiverReady;
  cuda::Flag receiverArrived;

  // Recv: its words of a direct send's handshake (this process's), 0 at capture. Its graph
  // sets `ready` at the post (the buffer is free), the sender's takes it before its copy;
  // the sender's copy sets `arrived`, the recv's wait takes it.
  std::unique_ptr<cuda::OwnedFlag> ready;
  std::unique_ptr<cuda::OwnedFlag> arrived;

  // Recv through its sender's slot, once matched: that slot and the sender's words, mapped here.
  CapturedSlot source;
  std::shared_ptr<cuda::RemoteFlagSegment> sourceWords;
  std::unique_ptr<cuda::PeerMapping> sourceSlot;

  // What a copy within one GPU passes through, as long as the graph: a recv's where its
  // sender's slot lies on its own GPU, a send's where no other GPU holds its slot.
  std::unique_ptr<cuda::BounceLease> bounce;

  std::atomic<Phase> phase{Phase::kPosted};
  std::mutex mutex;  // callers' threads: a recv's nodes are queued once

  // Progress thread only: the watchdog's (CapturedChannel::sweep).
  std::optional<GraphWait> watch;
  std::optional<std::string> broken;  // why its graph's waits are released at every replay
};

}  // namespace smfree::engine
