#pragma once

// What UcxChannel keeps of one op's bytes in motion (its files share it; nothing else does).
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/ucx/HostRelay.h"
#include "engine/channels/ucx/UcxCudaOp.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/PinnedMemory.h"

namespace smfree::engine {

class UcxChannel;
struct Peer;

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// A recv's pieces travel under consecutive tags: its op id shifted left by this, plus the
// piece's index.
constexpr unsigned kPieceBits = 20;
constexpr uint64_t kMostPieces = uint64_t{1} << kPieceBits;
static_assert(kMostPieces == kMostRelayPieces);

// Where one piece of a movement is.
enum class PieceState : uint8_t {
  kWaiting,  // not yet touched
  kCopying,  // relayed recv: its copy in is queued
  kInUcx,    // a UCX request moves it
  kLanded,   // relayed recv: in host memory, not yet copied in
  kDone,
};

// One op's bytes in this channel, from the clear-to-send (a relayed send: from its post; a recv:
// from its arming) until no UCX request or copy touches its buffer.
struct UcxMovement {
  std::shared_ptr<Op> op;
  Peer* peer = nullptr;         // a send's destination, a recv's source
  bool cleared = false;         // a send: its clear-to-send gave the tag and the pieces
  ucp_tag_t tag = 0;            // piece i travels under tag + i
  uint64_t pieceBytes = 0;      // 0: one piece
  bool relayed = false;
  bool started = false;  // pieces posted, or (relayed send) their copies out queued
  std::shared_ptr<cuda::PinnedMemory> host;  // relayed: what UCX moves instead of the buffer
  std::vector<PieceState> pieces;
  std::vector<std::shared_ptr<cuda::Event>> copies;  // relayed recv: each piece's copy in
  uint64_t copiedOut = 0;         // relayed send: bytes in host memory
  std::vector<void*> requests;    // UCX requests not yet completed
  uint32_t nextToTransmit = 0;    // relayed send: pieces go out in order
  uint32_t copiesInQueued = 0;    // relayed recv
  // Relayed by its caller (CallerRelay): the caller's thread queues its copies.
  std::shared_ptr<CallerRelay> callerRelay;
  // Caller-relayed recv, receive worker's thread only: which pieces have landed, and how many
  // from the first have.
  std::vector<uint8_t> landedOnWorker;
  uint32_t landedInOrder = 0;
  uint32_t done = 0;
  std::optional<Status> failure;
  bool cancelled = false;  // its requests were cancelled after the failure

  bool isSend() const { return op->isSend(); }
  uint64_t offsetOf(uint32_t piece) const { return piece * pieceBytes; }
  uint64_t bytesOf(uint32_t piece) const {
    const uint64_t total = op->request.buffer.bytes;
    return pieceBytes == 0 ? total : std::min(pieceBytes, total - offsetOf(piece));
  }
  void setPieces(uint64_t bytes) {
    pieceBytes = bytes;
    const uint64_t count = relayPieceCount(op->request.buffer.bytes, bytes);
    pieces.assign(count, PieceState::kWaiting);
    copies.resize(count);
  }
  bool copyPending(const cuda::FlagSegment& flags) const {
    if (callerRelay) {
      if (isSend()) return !flags.isSet(callerRelay->lastPiece());
      return callerRelay->copiesIn.load() == CallerRelay::kCopiesInByCaller &&
             !flags.isSet(callerRelay->copiedIn);
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i] == PieceState::kCopying && !copies[i]->reached()) return true;
    }
    return false;
  }
};

struct UcxTransfer {
  UcxChannel* channel;
  UcxMovement* movement;  // lives until the completion of its last request is applied
  uint32_t piece;
};

}  // namespace smfree::engine
