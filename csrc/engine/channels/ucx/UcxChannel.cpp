#include "engine/channels/ucx/UcxChannel.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/PeerValue.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// A recv's pieces travel under consecutive tags: its op id shifted left by this, plus the
// piece's index.
constexpr unsigned kPieceBits = 20;
constexpr uint64_t kMostPieces = uint64_t{1} << kPieceBits;
static_assert(kMostPieces == kMostStagingPieces);

enum class PieceState : uint8_t {
  kWaiting,  // not yet touched
  kCopying,  // staged recv: its copy in is queued
  kInUcx,    // a UCX request moves it
  kLanded,   // staged recv: in host memory, not yet copied in
  kDone,
};

ucs_memory_type_t memoryType(const Buffer& buffer) {
  return buffer.memory == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

Status abandoned(const Op& op) {
  return Status::failure(StatusCode::kAborted, concat(op.describe(), " was cancelled"));
}

// A request that ended in error: its peer's connection failed, which UCX may say here before
// the endpoint's error callback.
Status transportFailure(const Op& op, const Peer& peer, ucs_status_t status) {
  if (peer.failed) {
    return Status::failure(StatusCode::kPeerFailure,
                           concat(op.describe(), " failed: ", peer.failure));
  }
  return Status::failure(StatusCode::kTransport,
                         concat(op.describe(), " failed: UCX could not move its bytes ",
                                op.isSend() ? "to" : "from", " its peer process (",
                                peer.describe(), "): ", ucxPeerErrorText(status)));
}

Status copyFailure(const Op& op, const Error& error) {
  return Status::failure(StatusCode::kTransport, concat(op.describe(), ": ", error.what()));
}

}  // namespace

// One op's bytes in this channel, from the clear-to-send (a staged send: from its post; a recv:
// from its arming) until no UCX request or copy touches its buffer.
struct UcxChannel::Movement {
  std::shared_ptr<Op> op;
  Peer* peer = nullptr;         // a send's destination, a recv's source
  bool cleared = false;         // a send: its clear-to-send gave the tag and the pieces
  ucp_tag_t tag = 0;            // piece i travels under tag + i
  uint64_t pieceBytes = 0;      // 0: one piece
  bool staged = false;
  bool started = false;  // pieces posted, or (staged send) their copies out queued
  std::shared_ptr<cuda::PinnedMemory> host;  // staged: what UCX moves instead of the buffer
  std::vector<PieceState> pieces;
  std::vector<std::shared_ptr<cuda::Event>> copies;  // staged recv: each piece's copy in
  uint64_t copiedOut = 0;         // staged send: bytes in host memory
  std::vector<void*> requests;    // UCX requests not yet completed
  uint32_t nextToTransmit = 0;    // staged send: pieces go out in order
  uint32_t copiesInQueued = 0;    // staged recv
  // Staged by its caller (CallerStaging): the caller's thread queues its copies.
  std::shared_ptr<CallerStaging> callerStaging;
  // Caller-staged recv, receive lane's thread only: which pieces have landed, and how many
  // from the first have.
  std::vector<uint8_t> landedOnLane;
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
    const uint64_t count = stagingPieceCount(op->request.buffer.bytes, bytes);
    pieces.assign(count, PieceState::kWaiting);
    copies.resize(count);
  }
  bool copyPending(const cuda::FlagSegment& flags) const {
    if (callerStaging) {
      if (isSend()) return !flags.isSet(callerStaging->lastPiece());
      return callerStaging->copiesIn.load() == CallerStaging::kCopiesInByCaller &&
             !flags.isSet(callerStaging->copiedIn);
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i] == PieceState::kCopying && !copies[i]->reached()) return true;
    }
    return false;
  }
};

struct UcxChannel::Transfer {
  UcxChannel* channel;
  Movement* movement;  // lives until the completion of its last request is applied
  uint32_t piece;
};

UcxChannel::UcxChannel(const UcxContext& context, UcxWorker& sendWorker, CudaOps& cudaOps,
                       const ProgressThread& thread, const Config& config, const Spin& spin,
                       Done onDone)
    : lane_(std::make_unique<UcxReceiveLane>(context, spin)),
      receiveLane_(*lane_),
      sendWorker_(sendWorker),
      cudaOps_(cudaOps),
      thread_(thread),
      flags_(cudaOps.flags()),
      pieceBytes_(config.hostStagingPieceBytes),
      transport_(config.transport),
      peerCheck_(config.peerCheck),
      onDone_(std::move(onDone)) {}

UcxChannel::~UcxChannel() {
  endpoints_.clear();  // their flushes first: peers' sends to the receive lane may wait on them
  receiveLane_.stop();
  applyCompletions();  // what the lane completed since the last flush
  if (recvsInUcx()) {
    // Such as a recv whose bytes were moving when its peer's link went silent: UCX tracks it
    // on an endpoint of its own making, which neither a cancel nor a close reaches, and
    // destroying the worker under it fails UCX's assertion (1.13). Where no TCP user timeout
    // ends it, nothing does: the worker, and with it the context, is left to the process's end.
    log(LogLevel::kWarn, "exit: recvs were still inside UCX, which can neither end nor cancel "
        "them (their peer's link went silent, or the peer died, while their bytes moved); the "
        "UCX worker that receives is left to the process's end");
    static_cast<void>(lane_.release());
  }
  std::lock_guard<std::mutex> lock(completionsMutex_);
  for (const Completion& completion : completions_) {
    std::unique_ptr<Transfer> owned(completion.transfer);
    ucp_request_free(completion.request);
  }
}

std::vector<uint8_t> UcxChannel::receiveAddress() { return receiveLane_.worker().address(); }

void UcxChannel::flush(Clock::time_point deadline) {
  for (auto& [peer, endpoint] : endpoints_) endpoint->startFlush();
  for (auto& [peer, endpoint] : endpoints_) endpoint->finishFlush(deadline);
  settleRecvs(deadline);
}

void UcxChannel::settleRecvs(Clock::time_point deadline) {
  applyCompletions();
  for (const auto& [id, movement] : movements_) {
    if (!movement->isSend()) receiveLane_.cancel(movement->requests);
  }
  // UCX's keepalive finds a dead peer within two rounds and ends the recvs it tracks; the
  // fragments of an eager message it never ends, but its worker's destruction does not mind
  // them.
  const Clock::time_point settled = std::min(deadline, Clock::now() + 3 * peerCheck_);
  while (recvsInUcx() && Clock::now() < settled) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    applyCompletions();
  }
}

bool UcxChannel::recvsInUcx() const {
  for (const auto& [id, movement] : movements_) {
    if (!movement->isSend() && !movement->requests.empty()) return true;
  }
  return false;
}

void UcxChannel::connect(Peer& peer, const PeerError& onError) {
  // Same host: shared memory and CMA need UCX's peer-failure handling off; the peer's process
  // watch notices a dead peer instead.
  endpoints_[&peer] = std::make_unique<UcxEndpoint>(
      sendWorker_.handle(), peer.address.receiveWorkerAddress, !peer.sameHost, peer.describe(),
      [onError](ucs_status_t status) { onError(ucxPeerErrorText(status)); });
}

void UcxChannel::disconnect(Peer& peer) {
  auto it = endpoints_.find(&peer);
  if (it == endpoints_.end()) return;
  it->second->peerGone();
  endpoints_.erase(it);
}

UcxEndpoint* UcxChannel::endpointOf(const Peer& peer) const {
  auto it = endpoints_.find(&peer);
  return it == endpoints_.end() ? nullptr : it->second.get();
}

PeerRoute UcxChannel::route(Peer& peer) { return PeerRoute{stagesCudaToward(peer)}; }

void UcxChannel::addStats(std::map<std::string, int64_t>& stats) const {
  stats["ucx_host_staged_sends"] = static_cast<int64_t>(hostStagedSends_);
  stats["ucx_host_staged_recvs"] = static_cast<int64_t>(hostStagedRecvs_);
  stats["ucx_host_staging_cached_bytes"] = static_cast<int64_t>(staging_.cachedBytes());
}

bool UcxChannel::streamReached(const Op& op) const {
  const UcxCudaOp* state = ucxCudaOp(op);
  return !state || flags_.isSet(state->streamReady);
}

bool UcxChannel::stagesThroughHost(const Op& op, const Peer& peer) {
  const Buffer& buffer = op.request.buffer;
  if (buffer.memory != MemoryKind::kCuda || buffer.bytes == 0) return false;
  return stagesCudaToward(peer);
}

bool UcxChannel::stagesCudaToward(const Peer& peer) {
  const UcxEndpoint* endpoint = endpointOf(peer);
  if (!endpoint) return false;
  auto [decision, first] = stagingDecisions_.try_emplace(&peer, false);
  if (first) decision->second = onlyTcpToward(*endpoint, peer);
  return decision->second;
}

bool UcxChannel::onlyTcpToward(const UcxEndpoint& endpoint, const Peer& peer) const {
  const auto transports = endpoint.transports();
  if (!transports) {
    logOnce("ucx-transports-unknown",
            "this UCX cannot list an endpoint's transports (UCX < 1.14): CUDA tensors go to "
            "UCX as they are, also where it copies them in small pieces (TCP)");
    return false;
  }
  bool tcpOnly = !transports->empty();
  std::string names;
  for (const std::string& transport : *transports) {
    tcpOnly = tcpOnly && transport.rfind("tcp/", 0) == 0;
    names += (names.empty() ? "" : ", ") + transport;
  }
  if (tcpOnly) {
    log(LogLevel::kInfo, "UCX reaches ", peer.describe(), " over TCP only (", names,
        "), where it copies CUDA memory in small pieces: CUDA tensors to and from it go through "
        "pinned host memory, copied by copy engines");
  } else {
    log(LogLevel::kInfo, "UCX reaches ", peer.describe(), " over ", names,
        ": CUDA tensors to and from it go to UCX as they are");
  }
  return tcpOnly;
}

UcxChannel::Movement& UcxChannel::track(const std::shared_ptr<Op>& op, Peer& peer) {
  auto movement = std::make_unique<Movement>();
  movement->op = op;
  movement->peer = &peer;
  ++op->outstanding;  // the buffer is the channel's until the movement ends
  Movement& tracked = *movement;
  movements_[op->id] = std::move(movement);
  return tracked;
}

void UcxChannel::prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {
  const UcxCudaOp* state = ucxCudaOp(*send);
  if (!state || !state->staging) return;
  // Staged by its caller (prepare()), whose copies out are queued already.
  Movement& movement = track(send, destination);
  movement.staged = true;
  movement.started = true;
  movement.callerStaging = state->staging;
  movement.host = movement.callerStaging->host;
  ++hostStagedSends_;
}

std::string UcxChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                                const std::string& /*announced*/) {
  thread_.check("UcxChannel::armRecv");
  const UcxCudaOp* state = ucxCudaOp(*recv);
  std::shared_ptr<CallerStaging> callerStaging = state ? state->staging : nullptr;
  const bool staged = callerStaging || stagesThroughHost(*recv, source);
  const uint64_t bytes = recv->request.buffer.bytes;
  const uint64_t pieceBytes = callerStaging ? callerStaging->pieceBytes
                              : staged      ? stagingPieceBytes(bytes, pieceBytes_)
                                            : 0;
  const ucp_tag_t tag = recv->id << kPieceBits;
  Movement& movement = track(recv, source);
  movement.tag = tag;
  movement.setPieces(pieceBytes);
  movement.staged = staged;
  if (callerStaging) {
    movement.callerStaging = callerStaging;
    movement.host = callerStaging->host;
    movement.landedOnLane.assign(movement.pieces.size(), 0);
    ++hostStagedRecvs_;
  } else if (staged) {
    movement.host = staging_.take(recv->request.buffer.device, bytes);
    ++hostStagedRecvs_;
  }
  // A staged recv lands in host memory, free to take the bytes before the stream reaches it.
  if (staged || streamReached(*recv)) {
    movement.started = true;
    for (uint32_t piece = 0; piece < movement.pieces.size() && !movement.failure; ++piece) {
      postPiece(movement, piece);
    }
    if (movement.failure) fail(movement.failure->message);  // it ends in progress()
  }
  std::string channelData(sizeof(tag) + sizeof(pieceBytes), '\0');
  std::memcpy(channelData.data(), &tag, sizeof(tag));
  std::memcpy(channelData.data() + sizeof(tag), &pieceBytes, sizeof(pieceBytes));
  return channelData;
}

void UcxChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                           const std::string& channelData) {
  thread_.check("UcxChannel::startSend");
  // The clear-to-send's data, read and bounded here (PeerValue.h): the receiver's tag and
  // piece size, which may not cut the send into more than kMostPieces.
  constexpr const char* kMessage = "UCX clear-to-send's channel data";
  ucp_tag_t tag = 0;
  uint64_t pieceBytes = 0;
  const uint64_t bytes = send->request.buffer.bytes;
  if (channelData.size() != sizeof(tag) + sizeof(pieceBytes)) {
    badPeerValue(kMessage, "length", channelData.size(), " B, expected ",
                 sizeof(tag) + sizeof(pieceBytes), " B");
  }
  std::memcpy(&tag, channelData.data(), sizeof(tag));
  std::memcpy(&pieceBytes, channelData.data() + sizeof(tag), sizeof(pieceBytes));
  if (pieceBytes != 0 && bytes / pieceBytes + (bytes % pieceBytes != 0) > kMostPieces) {
    badPeerValue(kMessage, "piece bytes", pieceBytes, " B cut ", send->describe(),
                 " into more than ", kMostPieces, " pieces");
  }
  auto prepared = movements_.find(send->id);  // staged: its copies out queued at its post
  Movement& movement =
      prepared != movements_.end() ? *prepared->second : track(send, destination);
  movement.cleared = true;
  movement.tag = tag;
  movement.setPieces(pieceBytes);
  if (movement.staged) {
    // Matched: from here its wait() leaves the buffer to the caller's stream, which waits for
    // the copies out. Not before, so a mismatch still reaches that wait().
    if (!movement.failure) flags_.set(ucxCudaOp(*send)->queued);
    countCopiedOut(movement);
    transmitCopiedPieces(movement);
  } else {
    startOnceStreamReached(movement);
  }
}

bool UcxChannel::startOnceStreamReached(Movement& movement) {
  if (!streamReached(*movement.op)) return false;
  movement.started = true;
  for (uint32_t piece = 0; piece < movement.pieces.size() && !movement.failure; ++piece) {
    postPiece(movement, piece);
  }
  return true;
}

void UcxChannel::postPiece(Movement& movement, uint32_t piece) {
  const Op& op = *movement.op;
  const Buffer& buffer = op.request.buffer;
  char* base = static_cast<char*>(movement.host ? movement.host->data() : buffer.data);
  void* data = base + movement.offsetOf(piece);
  const uint64_t bytes = movement.bytesOf(piece);
  const ucp_tag_t tag = movement.tag + piece;
  UcxEndpoint* endpoint = movement.isSend() ? endpointOf(*movement.peer) : nullptr;
  if (movement.isSend() && !endpoint) {
    movement.failure = Status::failure(
        StatusCode::kPeerFailure, concat(op.describe(), ": its peer's data endpoint is closed"));
    return;
  }

  auto transfer = std::make_unique<Transfer>(Transfer{this, &movement, piece});
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.user_data = transfer.get();
  params.memory_type = movement.host ? UCS_MEMORY_TYPE_HOST : memoryType(buffer);
  // UCX's CUDA transports work in the current context: the buffer's device's primary one.
  std::optional<cuda::ContextGuard> context;
  if (!movement.host && buffer.memory == MemoryKind::kCuda) {
    context.emplace(buffer.device);
    cudaDevice_ = buffer.device;
    receiveLane_.useCudaDevice(buffer.device);
  }
  movement.pieces[piece] = PieceState::kInUcx;
  Transfer* owned = transfer.release();  // owned by the request until its callback
  void* request = nullptr;
  if (movement.isSend()) {
    params.cb.send = &UcxChannel::onSent;
    request = ucp_tag_send_nbx(endpoint->handle(), data, bytes, tag, &params);
  } else {
    params.cb.recv = &UcxChannel::onReceived;
    request = ucp_tag_recv_nbx(receiveLane_.worker().handle(), data, bytes, tag, kFullMask,
                               &params);
  }
  if (UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<Transfer> back(owned);  // no callback will come
    movement.pieces[piece] = PieceState::kWaiting;
    movement.failure = Status::failure(
        StatusCode::kTransport, concat("UCX could not post ", op.describe(), ": ",
                                       ucxStatusText(UCS_PTR_STATUS(request))));
    return;
  }
  movement.requests.push_back(request);  // its completion is applied only after this
}

bool UcxChannel::progress() {
  thread_.check("UcxChannel::progress");
  bool changed = applyCompletions();
  std::vector<uint64_t> ended;
  for (auto& [id, movement] : movements_) {
    changed = advance(*movement) || changed;
    if (movementEnded(*movement)) ended.push_back(id);
  }
  for (const uint64_t id : ended) {
    auto it = movements_.find(id);
    std::unique_ptr<Movement> movement = std::move(it->second);
    movements_.erase(it);
    --movement->op->outstanding;
    onDone_(movement->op, movement->failure ? *movement->failure : Status::success());
    changed = true;
  }
  return changed;
}

bool UcxChannel::advance(Movement& movement) {
  if (movement.op->finished() && !movement.failure) {
    movement.failure = abandoned(*movement.op);  // timed out, or its peer failed
  }
  if (movement.failure) {
    if (movement.cancelled) return false;
    movement.cancelled = true;
    releaseWaitingCopiesIn(movement);
    cancelRequests(movement);
    return true;
  }
  // A send tracked before its clear-to-send is a staged one, copied out at its post.
  if (movement.isSend() && !movement.cleared) return countCopiedOut(movement);
  if (!movement.started) return startOnceStreamReached(movement);
  if (!movement.staged) return false;
  if (movement.callerStaging && !movement.isSend()) return false;  // its caller copies in
  if (movement.isSend()) {
    const bool counted = countCopiedOut(movement);
    return transmitCopiedPieces(movement) || counted;
  }
  const bool copying = copyInLandedPieces(movement);
  return countCopiedInPieces(movement) || copying;
}

void UcxChannel::releaseWaitingCopiesIn(Movement& movement) {
  if (!movement.callerStaging || movement.isSend()) return;
  CallerStaging& staging = *movement.callerStaging;
  int state = CallerStaging::kCopiesInOpen;
  if (staging.copiesIn.compare_exchange_strong(state, CallerStaging::kCopiesInNever)) return;
  // Its caller's stream waits for pieces that will not land now: let the copies run over
  // what is there, so the stream goes on; the op reports the failure.
  flags_.set(staging.lastPiece());
}

bool UcxChannel::countCopiedOut(Movement& movement) {
  const CallerStaging& staging = *movement.callerStaging;
  const uint32_t word = flags_.wordOf(staging.progress);
  if (!cuda::reached(word, staging.progress.value)) return false;
  const uint64_t out = std::min<uint64_t>(word - staging.progress.value + 1, staging.pieces);
  const uint64_t copiedOut =
      staging.pieceBytes == 0 ? staging.bytes : std::min(out * staging.pieceBytes, staging.bytes);
  if (copiedOut == movement.copiedOut) return false;
  movement.copiedOut = copiedOut;
  return true;
}

bool UcxChannel::transmitCopiedPieces(Movement& movement) {
  bool posted = false;
  while (movement.nextToTransmit < movement.pieces.size() && !movement.failure) {
    const uint32_t piece = movement.nextToTransmit;
    if (movement.offsetOf(piece) + movement.bytesOf(piece) > movement.copiedOut) break;
    postPiece(movement, piece);
    ++movement.nextToTransmit;
    posted = true;
  }
  return posted;
}

bool UcxChannel::copyInLandedPieces(Movement& movement) {
  auto& pieces = movement.pieces;
  if (std::find(pieces.begin(), pieces.end(), PieceState::kLanded) == pieces.end()) return false;
  const Op& op = *movement.op;
  const Buffer& buffer = op.request.buffer;
  const UcxCudaOp& state = *ucxCudaOp(op);
  try {
    // The copies wait on the GPU for the caller's stream to free the buffer, not the CPU.
    if (movement.copiesInQueued == 0) {
      staging_.copyToDeviceAfter(buffer.device, *state.reached);
    }
    for (uint32_t piece = 0; piece < pieces.size(); ++piece) {
      if (pieces[piece] != PieceState::kLanded) continue;
      movement.copies[piece] = staging_.copyToDevice(*movement.host, buffer,
                                                     movement.offsetOf(piece),
                                                     movement.bytesOf(piece));
      pieces[piece] = PieceState::kCopying;
      ++movement.copiesInQueued;
    }
    if (movement.copiesInQueued == pieces.size()) {
      // From here the caller's stream, not its CPU, waits for the bytes.
      staging_.recordAfterCopiesToDevice(buffer.device, *state.copied);
      flags_.set(state.queued);
    }
  } catch (const Error& error) {
    movement.failure = copyFailure(op, error);
  }
  return true;
}

bool UcxChannel::countCopiedInPieces(Movement& movement) {
  bool counted = false;
  for (uint32_t piece = 0; piece < movement.pieces.size(); ++piece) {
    if (movement.pieces[piece] != PieceState::kCopying || !movement.copies[piece]->reached()) {
      continue;
    }
    movement.copies[piece].reset();
    movement.pieces[piece] = PieceState::kDone;
    ++movement.done;
    counted = true;
  }
  return counted;
}

bool UcxChannel::movementEnded(const Movement& movement) const {
  if (!movement.requests.empty()) return false;
  if (movement.failure) return !movement.copyPending(flags_);
  if (movement.callerStaging && !movement.isSend() &&
      !flags_.isSet(movement.callerStaging->copiedIn)) {
    return false;
  }
  return (!movement.isSend() || movement.cleared) && movement.done == movement.pieces.size();
}

bool UcxChannel::busy() const {
  // Pieces inside UCX need nothing from the loop: their completions wake it.
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    if (!completions_.empty()) return true;
  }
  for (const auto& [id, movement] : movements_) {
    if (!movement->started || movement->failure || movementEnded(*movement)) return true;
    if (const auto& staging = movement->callerStaging) {
      // Words that streams write, polled: a send's copies out, a recv's copies in once its
      // wait() has queued them.
      if (movement->isSend() ? movement->copiedOut < staging->bytes
                             : staging->copiesIn.load() == CallerStaging::kCopiesInByCaller) {
        return true;
      }
    }
    for (const PieceState state : movement->pieces) {
      if (state == PieceState::kCopying || state == PieceState::kLanded) return true;
    }
  }
  return false;
}

void UcxChannel::cancel(Op& op) {
  auto it = movements_.find(op.id);
  if (it == movements_.end()) return;
  Movement& movement = *it->second;
  // Its requests are cancelled by the next progress(), once the completions queued before it
  // are applied: this may run inside UCX (a peer's failure it reports), where some of them
  // have completed with their completions still queued.
  if (!movement.failure) movement.failure = abandoned(op);
}

void UcxChannel::cancelRequests(Movement& movement) {
  if (!movement.isSend()) {
    receiveLane_.cancel(movement.requests);  // the lane's thread completes them meanwhile
    return;
  }
  // The engine's worker completes sends on this thread alone, so UCX's own check for a
  // completed request holds here.
  for (void* request : movement.requests) ucp_request_cancel(sendWorker_.handle(), request);
}

void UcxChannel::enqueue(const Completion& completion, bool wakeEngine) {
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    completions_.push_back(completion);
  }
  if (wakeEngine) sendWorker_.signal();
}

bool UcxChannel::applyCompletions() {
  std::vector<Completion> completions;
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    completions.swap(completions_);
  }
  for (const Completion& completion : completions) finish(completion);
  return !completions.empty();
}

void UcxChannel::finish(const Completion& completion) {
  std::unique_ptr<Transfer> transfer(completion.transfer);
  Movement& movement = *transfer->movement;
  const uint32_t piece = transfer->piece;
  auto& requests = movement.requests;
  requests.erase(std::find(requests.begin(), requests.end(), completion.request));
  ucp_request_free(completion.request);
  std::optional<Status> failure;
  if (completion.status != UCS_OK) {
    failure = transportFailure(*movement.op, *movement.peer, completion.status);
  } else if (!movement.isSend() && completion.length != movement.bytesOf(piece)) {
    failure = Status::failure(StatusCode::kTransport,
                              concat(movement.op->describe(), " received ", completion.length,
                                     " B in piece ", piece, " of ", movement.bytesOf(piece),
                                     " B"));
  }
  if (failure) {
    if (!movement.failure) movement.failure = std::move(failure);
    return;
  }
  if (movement.staged && !movement.isSend() && !movement.callerStaging) {
    movement.pieces[piece] = PieceState::kLanded;
    return;
  }
  movement.pieces[piece] = PieceState::kDone;
  ++movement.done;
}

void UcxChannel::markLanded(Movement& movement, uint32_t piece) {
  movement.landedOnLane[piece] = 1;
  const uint32_t before = movement.landedInOrder;
  while (movement.landedInOrder < movement.landedOnLane.size() &&
         movement.landedOnLane[movement.landedInOrder]) {
    ++movement.landedInOrder;
  }
  // Straight from the receive lane: the copies in that wait for it do not depend on the
  // progress thread.
  if (movement.landedInOrder > before) {
    flags_.set(movement.callerStaging->progress.plus(movement.landedInOrder - 1));
  }
}

void UcxChannel::onSent(void* request, ucs_status_t status, void* userData) {
  auto* transfer = static_cast<Transfer*>(userData);
  // On the engine's thread, inside its worker's progress or a post or cancel.
  transfer->channel->enqueue(Completion{transfer, request, status, 0}, false);
}

void UcxChannel::onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* userData) {
  auto* transfer = static_cast<Transfer*>(userData);
  const size_t length = status == UCS_OK ? info->length : 0;
  Movement& movement = *transfer->movement;
  if (movement.callerStaging && status == UCS_OK &&
      length == movement.bytesOf(transfer->piece)) {
    transfer->channel->markLanded(movement, transfer->piece);
  }
  transfer->channel->enqueue(Completion{transfer, request, status, length}, true);
}

}  // namespace smfree::engine
