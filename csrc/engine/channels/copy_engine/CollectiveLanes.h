#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/Channel.h"
#include "engine/Op.h"
#include "engine/ProcessWatch.h"
#include "engine/channels/copy_engine/CollectiveRecords.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// Collective lanes: a collective's piece is copied at the post of whichever of its two ranks posts
// second, on that rank's caller's thread, so neither rank's wait() waits for the other's CPU
// (a rendezvous's wait() returns only once both have posted). For uncaptured CUDA pieces on
// the collective line (kCollectiveTag) between ranks of one host; CollectiveRecords.h says how the
// two sides decide who is second.
//
//  - First: it writes its half of the record (its buffer's IPC export, its signal and `done`
//    words) and publishes it. Its `queued` is set at once: its wait() makes the stream wait for
//    its `done` word.
//  - Second: it reads the first's half, maps the first's buffer, takes the record and queues,
//    on a stream of its own per (local device, peer device): a sender waits for its `produced`
//    event and the receiver's `ready` word and pushes; a receiver waits for its own event and
//    the sender's `produced` word and pulls. The copy then writes both sides' `done` words.
//  Ready-to-send and clear-to-send still pass, in the background: matching, mismatch errors,
//  timeouts and dead peers stay the rendezvous's, and each side's op ends once its `done` word
//  says the copy ran.
//
// Deadlock: every stream wait is for work queued at a post of a program: the first's stream
// waits for a copy that the second queues at its post; that copy waits for what both sides'
// streams were given at their posts. No post waits. So a cycle of waits is a cycle in the
// programs, which hangs NCCL's collectives too (c10d has every rank call a group's collectives
// in one order, so the n-th piece between two ranks is the same piece on both).
struct CollectivePiece {
  CollectiveRole role = CollectiveRole::kRendezvous;
  bool sender = false;
  CollectiveRecord* record = nullptr;
  uint32_t use = 0;
  std::string peerKey;
  cuda::RemoteFlagSegment* peerWords = nullptr;
  // Second: the first's signal word its copy waits for (released if the peer fails), and the
  // first's buffer, mapped here until the op is released.
  cuda::Flag theirSignal;
  std::optional<cuda::IpcExport> mapped;
  int device = -1;
};

// What a piece's post gives its collective lane: the words its half names, and the event its
// caller's stream recorded at the post (a send's `produced`; a recv's, that its buffer is free).
struct PieceWords {
  cuda::Flag signal;
  cuda::Flag done;
  cuda::Event* posted = nullptr;
};

class CollectiveLanes {
 public:
  // The peer's flag segment mapped in this process (the channel's, shared by every thread),
  // taken through `ownerPidfd` on first use.
  using PeerWords = std::function<cuda::RemoteFlagSegment&(
      const std::string& key, const PeerAddress& address, int ownerPidfd)>;

  // `localKey`: this process's key, which names its lines in its receivers' files.
  CollectiveLanes(cuda::FlagSegment& flags, std::string localKey, size_t ipcCacheSize,
                  PeerWords peerWords);

  // Caller's thread, at the post of an uncaptured CUDA piece of a collective to a peer on this
  // host: first (published) or second (copy queued); null where the piece goes by rendezvous,
  // as its partner also finds. Throws Error naming `op` (the record is then as it was).
  std::unique_ptr<CollectivePiece> post(const Op& op, const PostOptions& options,
                                        const PieceWords& words);
  // Progress thread. A first side's op failed: true if no copy will come, false if its partner
  // took the record (the copy comes, and writes the buffer).
  static bool cancel(CollectivePiece& piece) {
    return cancelCollective(*piece.record, piece.use, piece.sender);
  }
  // A second side's copy waits for the first's stream: let it run (the peer is gone or wedged).
  static void release(CollectivePiece& piece) { piece.peerWords->set(piece.theirSignal); }
  // Any thread, once the op is released: the first's buffer is no longer mapped for it.
  void finished(CollectivePiece& piece);

  // Per peer, the ids of memory exported to it that has since been freed (IpcExporter::sweep).
  std::map<std::string, std::vector<uint64_t>> sweep();
  void forget(const std::string& owner, const std::vector<uint64_t>& ids);
  void dropPeer(const std::string& key);
  bool gone(const std::string& key);
  void addStats(std::map<std::string, int64_t>& stats) const;

 private:
  struct Peer {
    cuda::RemoteFlagSegment* words = nullptr;
    std::unique_ptr<ProcessWatch> watch;  // its pidfd maps cuMemCreate memory
  };

  Peer& peerFor(const PostOptions& options);
  // Writes this side's half; false where its buffer's export does not fit a record.
  bool writeHalf(CollectiveHalf& half, const Op& op, const PieceWords& words,
                 const std::string& peerKey);
  void* map(CollectivePiece& piece, const CollectiveHalf& theirs, int ownerPidfd);
  void queueCopy(const Op& op, CollectivePiece& piece, const CollectiveHalf& theirs, void* mapped,
                 const PieceWords& words);
  // One per direction, so a rank's push and pull with one peer overlap.
  CUstream stream(int localDevice, int peerDevice, bool push);

  cuda::FlagSegment& flags_;
  const std::string localKey_;
  CollectiveLines lines_;  // into this process
  PeerWords peerWords_;
  mutable std::mutex mutex_;  // the members below
  cuda::IpcExporter exporter_;
  cuda::IpcCache ipc_;
  std::map<std::string, Peer> peers_;
  std::set<std::string> gone_;
  std::map<std::tuple<int, int, bool>, std::unique_ptr<cuda::Stream>> streams_;
  std::atomic<uint64_t> firsts_{0};
  std::atomic<uint64_t> seconds_{0};
  std::atomic<uint64_t> byRendezvous_{0};
};

}  // namespace smfree::engine
