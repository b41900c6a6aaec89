#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/CudaFence.h"
#include "engine/GroupConfig.h"
#include "engine/GroupEngine.h"
#include "engine/Peer.h"
#include "engine/Store.h"

namespace smfree::engine {

// A member's handle on one group: thread-safe, used by the c10d backend.
class Group {
 public:
  Group(std::shared_ptr<GroupEngine> engine, std::shared_ptr<const GroupConfig> config,
        std::shared_ptr<KeyValueStore> store, std::chrono::milliseconds timeout);
  ~Group();  // closes the group: its pending ops fail
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const GroupConfig& config() const { return *config_; }
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeoutMs_.load()); }
  void setTimeout(std::chrono::milliseconds timeout) { timeoutMs_ = timeout.count(); }

  // Makes sure the endpoint to `rank` exists (first use: a store lookup); this rank itself
  // needs none. Throws on failure.
  void connect(int rank);
  void connectAll();
  // Which channel an uncaptured CUDA op with `peer` (a rank or kAnySource, once connected)
  // moves on.
  ChannelKind cudaChannel(int peer) const;
  // At a CUDA op's call: sets request.capture to the CUDA graph capture its stream takes part
  // in, if any. Throws Error if the op cannot be captured (a recv from any source, a peer on
  // another host, SMFREE_CHANNEL=ucx; an op to the rank itself always can) or the stream's
  // capture is unusable.
  void checkCapture(OpRequest& request) const;
  // Never blocks on the transfer; `request.onComplete` reports the outcome. For a CUDA op it
  // returns what streams wait on (waitOnStream) to see the op's buffer done with.
  std::optional<OpFence> post(OpRequest request);
  // At wait(), before anything else: throws Error if `stream` cannot wait for the op, that is
  // if one of the two takes part in a CUDA graph capture and the other does not.
  void checkWaitable(void* stream, const OpFence& fence) const;
  // Returns once the partner has posted and the copy is submitted, or the op failed; throws
  // if neither happens within the group timeout.
  void awaitQueued(const OpFence& fence);
  // A caller-staged recv (OpFence::queuedByWait): queues its copies in if its match allows that
  // now, without blocking; true once they are queued or it failed.
  bool queueCopiesInOnceMatched(const OpFence& fence);
  // The same, waiting for that until `until` (a wait() with a timeout); false if `until` came
  // first, and throws if the group timeout did.
  bool queueCopiesInBy(const OpFence& fence, Clock::time_point until);
  // Makes `stream` wait for the copy on the GPU; call only after awaitQueued.
  void waitOnStream(void* stream, int device, const OpFence& fence);
  // Fails every pending op with `reason` and refuses new ones; returns once that is done.
  // Unless `abort`, it first lets the ops whose wait() has returned finish moving.
  void close(StatusCode code, const std::string& reason, bool abort);
  // Why calls on the group are refused: one of its ops failed after its wait() returned.
  std::optional<std::string> failureAfterWait();
  // Records such a failure (the caller's Work knows whether its wait() returned).
  void recordFailureAfterWait(std::string why);
  // Why `rank`'s process is known dead, if it is.
  std::optional<std::string> peerFailure(int rank);
  std::string dumpPending();
  // Engine-wide counters: live ops, open CUDA IPC mappings, flag words in use.
  std::map<std::string, int64_t> stats();

 private:
  // Each (peer, tag) line's next message number, by direction.
  struct Lines {
    std::map<std::pair<int, int>, uint64_t> sends;  // (destination, tag) -> next
    std::map<std::pair<int, int>, uint64_t> recvs;  // (source, tag) -> next
  };

  // Numbers the op in its (peer, tag) line (Op::seq); false where a recv's place in its line
  // cannot be known at its post (a recv from any source came before, or it is one).
  bool number(Op& op);
  void unnumber(const Op& op);  // the op was refused at its post (under postMutex_)
  // Captured ops have lines of their own: they match only captured ops.
  Lines& linesOf(const Op& op) {
    return op.channel == ChannelKind::kCaptured ? capturedLines_ : lines_;
  }
  // Polls the fence's channel until the op's copies are queued; false if `deadline` comes
  // first.
  bool pollQueued(const OpFence& fence, Clock::time_point deadline);
  // How long a caller waits for an op's copy to be queued before it blames a stuck engine.
  Clock::time_point queuedDeadline() const;

  std::shared_ptr<GroupEngine> engine_;
  std::shared_ptr<const GroupConfig> config_;
  std::shared_ptr<KeyValueStore> store_;
  uint64_t id_;
  std::atomic<int64_t> timeoutMs_;
  std::unique_ptr<std::atomic<bool>[]> connected_;
  std::mutex keysMutex_;
  // By rank, once connected; written once, so a post may point at one (PostOptions::peer).
  std::vector<PeerAddress> addresses_;
  std::unique_ptr<std::atomic<bool>[]> sameHost_;  // by rank, written before connected_
  std::unique_ptr<std::atomic<bool>[]> relaysCuda_;  // by rank, written before connected_
  std::atomic<bool> closed_{false};
  // Posts are numbered here, on the callers' threads, so that a channel knows at the post
  // which message of its (peer, tag) line an op is: the n-th send to a (rank, tag) meets the
  // n-th recv from that (rank, tag). Held from the numbering to the engine's queue.
  std::mutex postMutex_;
  Lines lines_;
  Lines capturedLines_;
  // Since a recv from any source: it takes a message of a line unknown until it matches, so
  // later recvs can no longer know their place.
  bool anySourcePosted_ = false;
};

}  // namespace smfree::engine
