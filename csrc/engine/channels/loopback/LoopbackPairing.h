#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/CudaOps.h"
#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/loopback/LoopbackOp.h"

namespace smfree::engine {

// Sends and recvs whose peer is this rank itself, as V-shaped pipeline schedules post them (a
// rank holds two stages, one feeding the other). Their bytes never leave the process: no
// control message, no endpoint. An op is paired at its post, on the caller's thread, with the
// oldest unpaired opposite op of its group and tag, as every peer's ops are matched, in posting
// order per tag; a recv from any source never takes them. The later op moves the bytes there:
// a memmove for CPU tensors; for CUDA tensors the engine's copy (cuda/Copies.h, as
// SMFREE_LOCAL_COPIES says) on the later op's stream, after the earlier op's stream as it was
// at that op's post. Inside a CUDA graph capture the copy is a node of the graph. The ops end
// through the engine like any other: the progress thread starts them, ends them with the
// pair's outcome once it is known and they have started (an uncaptured CUDA copy sets a flag
// word after it, read without a CUDA call), and fails the unpaired ones at the group timeout
// or at the group's close; an op that ends unpaired leaves its line.
// LoopbackChannel drives this class; apart from it, it is tested in-process.
class LoopbackPairing {
 public:
  // An op's end, for the engine to tell (Channel::Done).
  struct Report {
    std::shared_ptr<Op> op;
    Status status;
  };

  explicit LoopbackPairing(CudaOps& cudaOps) : cudaOps_(cudaOps) {}
  LoopbackPairing(const LoopbackPairing&) = delete;
  LoopbackPairing& operator=(const LoopbackPairing&) = delete;

  // Caller's thread, at the post of any op to the rank itself: pairs it and moves the bytes,
  // or queues it in its line. Throws Error, having queued nothing, if its stream cannot be
  // recorded.
  std::shared_ptr<LoopbackOp> post(Op& op, std::chrono::milliseconds timeout);

  // Progress thread. The engine ended the op (told, or failed): an unpaired op leaves its line.
  void ended(const Op& op);
  // The ends to tell: of the started ops (past OpState::kPosted) whose pair's outcome is known,
  // the copies the GPU has run since included.
  std::vector<Report> progress();
  // For the pending-op table: whether the op has met its partner in this process.
  std::string describe(const Op& op, const LoopbackOp& half);
  // While a copy runs on the GPU, or an outcome waits for its op to start.
  bool busy() const { return pendingCount_.load(std::memory_order_relaxed) > 0; }
  // Waits, up to `deadline`, for the copies the GPU has still to run.
  void flush(Clock::time_point deadline);

 private:
  using Line = std::pair<uint64_t, int>;  // (group, tag)
  using Lines = std::map<Line, std::deque<std::shared_ptr<LoopbackOp>>>;

  static Line lineOf(const Op& op) { return {op.groupId, op.request.tag}; }
  // The oldest unpaired op opposite to `half` in its line, now paired with it; or null after
  // queueing `half`. Under mutex_.
  std::shared_ptr<LoopbackOp> pairOrQueue(const std::shared_ptr<LoopbackOp>& half);
  // Takes out of the line's front the ops past their deadline: failing, or about to be.
  static void dropExpired(Lines& lines, const Line& line);
  // Moves the pair's bytes, `later` being the op posted last; records the outcome if known.
  void exchange(LoopbackOp& send, LoopbackOp& recv, const LoopbackOp& earlier,
                const LoopbackOp& later);
  // The outcome, or none while the GPU has the copy to run.
  std::optional<Status> copy(LoopbackOp& send, LoopbackOp& recv, const LoopbackOp& earlier,
                             const LoopbackOp& later);
  static std::string mismatch(const Op& send, const Op& recv);
  static std::string captureMismatch(const LoopbackOp& send, const LoopbackOp& recv);
  // The ends that are known and not yet told, of started ops; true once none is left to tell.
  // Under mutex_.
  bool collectPair(LoopbackPair& pair, std::vector<Report>& reports);
  bool collect(LoopbackOp& half, std::vector<Report>& reports);
  // Under mutex_: the op's shared_ptr, let go once nothing reads it (LoopbackOp::op).
  static void forgetOnceDone(LoopbackOp& half);
  void withdraw(const std::shared_ptr<LoopbackOp>& half);  // under mutex_

  CudaOps& cudaOps_;
  std::mutex mutex_;
  Lines sends_;
  Lines recvs_;
  std::unordered_map<uint64_t, std::shared_ptr<LoopbackOp>> ops_;  // by op id, until they end
  std::vector<std::shared_ptr<LoopbackPair>> inFlight_;  // uncaptured CUDA copies not yet run
  std::vector<std::shared_ptr<LoopbackPair>> settled_;   // outcome known, not all told
  std::atomic<size_t> pendingCount_{0};                  // of inFlight_ and settled_
};

}  // namespace smfree::engine
