#include "engine/Group.h"

#include <algorithm>
#include <thread>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/Capture.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

constexpr auto kQueuedMargin = std::chrono::seconds(10);

// A caller's thread waiting for what another thread or process will do soon: it yields for
// `spin`, then naps up to 20 µs, so a wait of microseconds costs no sleep's latency and a
// long one no core. False if `deadline` comes first.
template <typename Done>
bool pollUntil(Done done, std::chrono::microseconds spin, Clock::time_point deadline) {
  const auto spinUntil = Clock::now() + spin;
  auto nap = std::chrono::microseconds(5);
  while (!done()) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now < spinUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(20));
    }
  }
  return true;
}

}  // namespace

Group::Group(std::shared_ptr<GroupEngine> engine, std::shared_ptr<const GroupConfig> config,
             std::shared_ptr<KeyValueStore> store, std::chrono::milliseconds timeout)
    : engine_(std::move(engine)),
      config_(std::move(config)),
      store_(std::move(store)),
      id_(groupIdOf(config_->name)),
      timeoutMs_(timeout.count()),
      connected_(std::make_unique<std::atomic<bool>[]>(config_->size)),
      addresses_(config_->size),
      sameHost_(std::make_unique<std::atomic<bool>[]>(config_->size)),
      relaysCuda_(std::make_unique<std::atomic<bool>[]>(config_->size)) {
  for (int rank = 0; rank < config_->size; ++rank) {
    connected_[rank] = false;
    relaysCuda_[rank] = false;
    sameHost_[rank] = rank == config_->rank;
  }
}

Group::~Group() {
  try {
    close(StatusCode::kAborted, "the group was destroyed", false);
  } catch (const std::exception& error) {
    log(LogLevel::kWarn, "closing group '", config_->name, "': ", error.what());
  }
}

void Group::connect(int rank) {
  // This rank itself needs no endpoint: its ops never leave the process (kLoopback).
  if (rank == config_->rank || connected_[rank].load(std::memory_order_acquire)) {
    return;
  }
  std::vector<uint8_t> published;
  try {
    published = store_->get(addressKey(rank));
  } catch (const std::exception& error) {
    // A peer is first reached through the store: with the store's host gone, only peers
    // reached before stay reachable.
    fail("cannot reach rank ", rank, " of group '", config_->name,
         "' for the first time: reading its address from the group's store failed (is the "
         "store's host down?): ", error.what());
  }
  PeerAddress address;
  try {
    address = PeerAddress::decode(published);
  } catch (const Error& error) {
    // A stale value from another build, one damaged or overwritten in the store: refused here,
    // before UCX reads the worker address in it, and read again at the next connect.
    fail("cannot reach rank ", rank, " of group '", config_->name, "': the address it published "
         "in the group's store under '", addressKey(rank), "' is unusable: ", reasonOf(error));
  }
  const PeerRoute route = engine_->connect(id_, rank, address, timeout());
  relaysCuda_[rank] = route.relaysThroughHost;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    if (addresses_[rank].processKey.empty()) addresses_[rank] = address;
  }
  sameHost_[rank] = address.hostKey == engine_->localAddress().hostKey;
  connected_[rank].store(true, std::memory_order_release);
}

void Group::connectAll() {
  for (int rank = 0; rank < config_->size; ++rank) {
    if (rank != config_->rank) connect(rank);
  }
}

void Group::checkCapture(OpRequest& request) const {
  request.capture = cuda::captureOf(static_cast<CUstream>(request.stream));
  if (!request.capture) return;
  const int peer = request.peer;
  if (peer == config_->rank) return;  // its bytes never leave the process: any transport
  if (peer == kAnySource) {
    fail("a CUDA recv from any source cannot be captured in a CUDA graph: a graph's copies are "
         "fixed at capture, and its sender is known only once it matches; name the source rank");
  }
  if (engine_->config().cudaChannel == CudaChannel::kUcx) {
    fail("CUDA ops over UCX (SMFREE_CHANNEL=ucx) cannot be captured in a CUDA graph: UCX "
         "moves the bytes outside CUDA's stream order; captured ops use the copy engines "
         "(SMFREE_CHANNEL=auto or copy_engine)");
  }
  if (!sameHost_[peer]) {
    fail("CUDA ops with rank ", peer, ", on another host, cannot be captured in a CUDA graph: "
         "UCX moves their bytes outside CUDA's stream order; capture only ops between ranks of "
         "one host");
  }
}

std::optional<OpFence> Group::post(OpRequest request) {
  if (closed_) {
    fail("group '", config_->name, "' is closed");
  }
  auto op = std::make_shared<Op>();
  op->id = engine_->nextOpId();
  op->request = std::move(request);
  op->groupId = id_;
  op->config = config_;
  const bool onCuda = op->request.buffer.memory == MemoryKind::kCuda;
  const int peer = op->request.peer;
  if (peer == config_->rank) {
    op->channel = ChannelKind::kLoopback;  // CPU ops too: paired at the post, below
  } else if (onCuda) {
    op->channel = op->request.capture ? ChannelKind::kCaptured : cudaChannel(peer);
  }
  std::lock_guard<std::mutex> numbering(postMutex_);
  const bool placeKnown = number(*op);
  std::optional<OpFence> fence;
  Channel& channel = engine_->channel(op->channel);
  PostOptions options{timeout(), {}, {}, placeKnown};
  if (onCuda && peer != kAnySource) {
    options.route.relaysThroughHost = relaysCuda_[peer];
    std::lock_guard<std::mutex> lock(keysMutex_);
    options.peerKey = addresses_[peer].processKey;
    options.peer = &addresses_[peer];
  }
  try {
    if (onCuda) {
      // A user's CUDA graph capture, in progress on this thread or another, neither refuses
      // nor is broken by what the channel calls here.
      cuda::RelaxedCapture relaxed;
      op->channelOp = channel.prepare(*op, options);
    } else {
      // A CPU op to the rank itself is paired here, its bytes moved if its partner came first.
      op->channelOp = channel.prepare(*op, options);
    }
  } catch (...) {
    unnumber(*op);  // not posted: the next op takes its place in the line
    throw;
  }
  if (onCuda) {
    fence = OpFence{op->channel, op->channelOp->traits().queuedByWait,
                    op->request.capture.has_value(), op->channelOp};
  }
  op->posted = Clock::now();
  op->deadline = op->posted + timeout();
  engine_->post(std::move(op));
  return fence;
}

bool Group::number(Op& op) {
  const std::pair<int, int> line{op.request.peer, op.request.tag};
  Lines& lines = linesOf(op);
  if (op.isSend()) {
    op.seq = lines.sends[line]++;
    return true;
  }
  if (op.request.peer == kAnySource) {
    if (!anySourcePosted_) {
      log(LogLevel::kInfo, "group '", config_->name, "': a recv from any source; later CUDA "
          "recvs wait for their send's announcement before their copies are queued");
    }
    anySourcePosted_ = true;
    return false;
  }
  op.seq = lines.recvs[line]++;
  return !anySourcePosted_;
}

void Group::unnumber(const Op& op) {
  if (op.request.peer == kAnySource) return;
  Lines& lines = linesOf(op);
  --(op.isSend() ? lines.sends : lines.recvs)[{op.request.peer, op.request.tag}];
}

ChannelKind Group::cudaChannel(int peer) const {
  switch (engine_->config().cudaChannel) {
    case CudaChannel::kCopyEngine:
      return ChannelKind::kCopyEngine;
    case CudaChannel::kUcx:
      return ChannelKind::kUcx;
    case CudaChannel::kAuto:
      break;
  }
  if (peer != kAnySource) {
    return sameHost_[peer] ? ChannelKind::kCopyEngine : ChannelKind::kUcx;
  }
  // An any-source recv picks its channel before it knows its sender: all ranks must agree.
  bool local = false;
  bool remote = false;
  for (int rank = 0; rank < config_->size; ++rank) {
    if (rank != config_->rank) (sameHost_[rank] ? local : remote) = true;
  }
  if (local && remote) {
    fail("a CUDA recv from any source in group '", config_->name,
         "', whose ranks span hosts, cannot choose between copy engines and UCX before it "
         "matches: name the source rank, or set SMFREE_CHANNEL=ucx");
  }
  return local ? ChannelKind::kCopyEngine : ChannelKind::kUcx;
}

Clock::time_point Group::queuedDeadline() const {
  // The op's own timeout sets `queued` first; the margin only guards against a stuck engine.
  return Clock::now() + timeout() + kQueuedMargin;
}

bool Group::pollQueued(const OpFence& fence, Clock::time_point deadline) {
  cuda::RelaxedCapture relaxed;  // a staged recv queues its copies in from here
  CudaFence& queued = *fence.fence;
  return pollUntil([&] { return queued.queued(); }, engine_->spin().get(), deadline);
}

void Group::awaitQueued(const OpFence& fence) {
  if (fence.queuedByWait) {
    queueCopiesInBy(fence, Clock::time_point::max());  // throws at the deadline
    return;
  }
  // Short: the partner has usually posted already. The op's own timeout sets `queued`
  // before the deadline comes.
  if (!pollQueued(fence, queuedDeadline())) {
    fail("the partner's copy was not submitted before the deadline");
  }
}

bool Group::queueCopiesInBy(const OpFence& fence, Clock::time_point until) {
  const auto deadline = queuedDeadline();
  if (pollQueued(fence, std::min(until, deadline))) return true;
  if (until < deadline) return false;
  fail("the recv did not match, or its bytes did not land, in time");
}

bool Group::queueCopiesInOnceMatched(const OpFence& fence) {
  cuda::RelaxedCapture relaxed;
  return fence.fence->queued();
}

std::optional<std::string> Group::failureAfterWait() {
  return engine_->failures().afterWait(id_);
}

void Group::recordFailureAfterWait(std::string why) {
  engine_->failures().recordAfterWait(id_, std::move(why));
}

void Group::checkWaitable(void* stream, const OpFence& fence) const {
  const bool captured = fence.insideCapture;
  const std::optional<cuda::Capture> capture = cuda::captureOf(static_cast<CUstream>(stream));
  if (captured && !capture) {
    fail("the op was captured in a CUDA graph: wait for it inside its capture, on a stream "
         "that takes part in it, as the graph's own step (the current stream captures no graph)");
  }
  if (!captured && capture) {
    fail("the current stream captures a CUDA graph, but the op was posted outside the capture: "
         "a graph cannot wait for it; wait for it before the capture begins");
  }
}

void Group::waitOnStream(void* stream, int device, const OpFence& fence) {
  cuda::RelaxedCapture relaxed;
  fence.fence->waitOnStream(stream, device);
}

void Group::close(StatusCode code, const std::string& reason, bool abort) {
  if (closed_.exchange(true)) {
    return;
  }
  // Ops whose wait() has returned still owe their peers the bytes, or their streams the copies
  // in: a wait bounded by the exit's bound, which does not grow with the group timeout.
  if (!abort) {
    engine_->awaitReleasedOps(
        id_, Clock::now() + std::min<std::chrono::milliseconds>(
                                timeout(), engine_->config().exitTimeout));
  }
  engine_->closeGroup(id_, code, reason);
}

std::optional<std::string> Group::peerFailure(int rank) {
  if (!engine_->failures().any()) {
    return std::nullopt;
  }
  std::string key;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    key = addresses_[rank].processKey;
  }
  return key.empty() ? std::nullopt : engine_->failures().ofPeer(key);
}

std::string Group::dumpPending() { return engine_->dumpPending(id_); }

std::map<std::string, int64_t> Group::stats() { return engine_->stats(); }

}  // namespace smfree::engine
