// UCX's per-peer part: the channel's life (its receive worker, the flush at shutdown), the
// endpoints to peers' receive workers and whether CUDA buffers toward a peer go through host
// memory, and its figures.
#include "engine/channels/ucx/UcxChannel.h"

#include <thread>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/channels/ucx/UcxCudaOp.h"
#include "engine/channels/ucx/UcxMovement.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {

UcxChannel::UcxChannel(const UcxContext& context, UcxWorker& sendWorker, CudaOps& cudaOps,
                       const ProgressThread& thread, const Config& config, const Spin& spin,
                       Done onDone, Start start)
    : Channel({Capability::kEndpoints, Capability::kNotices, Capability::kProgress,
               Capability::kAdmission}),
      ownedReceiveWorker_(std::make_unique<UcxReceiveWorker>(context, spin)),
      receiveWorker_(*ownedReceiveWorker_),
      sendWorker_(sendWorker),
      cudaOps_(cudaOps),
      thread_(thread),
      flags_(cudaOps.flags()),
      pieceBytes_(config.relayPieceBytes),
      cudaChannel_(config.cudaChannel),
      peerCheck_(config.peerCheck),
      onDone_(std::move(onDone)),
      start_(std::move(start)),
      hostOp_(makeHostOp()) {}

UcxChannel::~UcxChannel() {
  endpoints_.clear();  // their flushes first: peers' sends to the receive worker may wait on them
  receiveWorker_.stop();
  applyCompletions();  // what the receive worker completed since the last flush
  if (recvsInUcx()) {
    // Such as a recv whose bytes were moving when its peer's link went silent: UCX tracks it
    // on an endpoint of its own making, which neither a cancel nor a close reaches, and
    // destroying the worker under it fails UCX's assertion (1.13). Where no TCP user timeout
    // ends it, nothing does: the worker, and with it the context, is left to the process's end.
    log(LogLevel::kWarn, "exit: recvs were still inside UCX, which can neither end nor cancel "
        "them (their peer's link went silent, or the peer died, while their bytes moved); the "
        "UCX worker that receives is left to the process's end");
    static_cast<void>(ownedReceiveWorker_.release());
  }
  std::lock_guard<std::mutex> lock(completionsMutex_);
  for (const Completion& completion : completions_) {
    std::unique_ptr<UcxTransfer> owned(completion.transfer);
    ucp_request_free(completion.request);
  }
}

std::vector<uint8_t> UcxChannel::receiveAddress() { return receiveWorker_.worker().address(); }

void UcxChannel::flush(Clock::time_point deadline) {
  for (auto& [peer, endpoint] : endpoints_) endpoint->startFlush();
  for (auto& [peer, endpoint] : endpoints_) endpoint->finishFlush(deadline);
  settleRecvs(deadline);
  // Their commitments will not end now.
  std::deque<std::shared_ptr<Op>> held;
  held.swap(heldOps_);
  for (const std::shared_ptr<Op>& op : held) {
    onDone_(op, Status::failure(StatusCode::kAborted,
                                concat(op->describe(), " failed: the smfree engine shut down")));
  }
}

void UcxChannel::settleRecvs(Clock::time_point deadline) {
  applyCompletions();
  for (const auto& [id, movement] : movements_) {
    if (!movement->isSend()) receiveWorker_.cancel(movement->requests);
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

PeerRoute UcxChannel::connect(Peer& peer, const PeerError& onError) {
  // Same host: shared memory and CMA need UCX's peer-failure handling off; the peer's process
  // watch notices a dead peer instead.
  endpoints_[&peer] = std::make_unique<UcxEndpoint>(
      sendWorker_.handle(), peer.address.receiveWorkerAddress, !peer.sameHost, peer.describe(),
      [onError](ucs_status_t status) { onError(ucxPeerErrorText(status)); });
  return PeerRoute{relaysCudaToward(peer)};
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

void UcxChannel::report(ChannelReport& report) const {
  std::map<std::string, int64_t>& stats = report.stats;
  stats["ucx_relayed_sends"] = static_cast<int64_t>(relayedSends_);
  stats["ucx_relayed_recvs"] = static_cast<int64_t>(relayedRecvs_);
  stats["ucx_relay_cached_bytes"] = static_cast<int64_t>(relay_.cachedBytes());
}

bool UcxChannel::streamReached(const Op& op) const {
  const UcxCudaOp* state = ucxCudaOp(op);
  return !state || flags_.isSet(state->streamReady);
}

bool UcxChannel::relaysThroughHost(const Op& op, const Peer& peer) {
  const Buffer& buffer = op.request.buffer;
  if (buffer.memory != MemoryKind::kCuda || buffer.bytes == 0) return false;
  return relaysCudaToward(peer);
}

bool UcxChannel::relaysCudaToward(const Peer& peer) {
  const UcxEndpoint* endpoint = endpointOf(peer);
  if (!endpoint) return false;
  auto [decision, first] = relayDecisions_.try_emplace(&peer, false);
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

}  // namespace smfree::engine
