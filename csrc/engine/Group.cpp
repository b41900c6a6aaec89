#include "engine/Group.h"

#include <algorithm>
#include <thread>

#include "engine/Error.h"
#include "engine/Log.h"

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

Group::Group(std::shared_ptr<Engine> engine, std::shared_ptr<const GroupConfig> config,
             std::shared_ptr<KeyValueStore> store, std::chrono::milliseconds timeout)
    : engine_(std::move(engine)),
      config_(std::move(config)),
      store_(std::move(store)),
      id_(groupIdOf(config_->name)),
      timeoutMs_(timeout.count()),
      connected_(std::make_unique<std::atomic<bool>[]>(config_->size)),
      processKeys_(config_->size),
      sameHost_(std::make_unique<std::atomic<bool>[]>(config_->size)),
      stagesCuda_(std::make_unique<std::atomic<bool>[]>(config_->size)) {
  for (int rank = 0; rank < config_->size; ++rank) {
    connected_[rank] = false;
    stagesCuda_[rank] = false;
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
  if (connected_[rank].load(std::memory_order_acquire)) {
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
  const PeerAddress address = PeerAddress::decode(published);
  const PeerRoute route = engine_->connect(id_, rank, address, timeout());
  stagesCuda_[rank] = route.stagedThroughHost;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    processKeys_[rank] = address.processKey;
  }
  sameHost_[rank] = address.hostKey == engine_->localAddress().hostKey;
  connected_[rank].store(true, std::memory_order_release);
}

void Group::connectAll() {
  for (int rank = 0; rank < config_->size; ++rank) {
    if (rank != config_->rank) connect(rank);
  }
}

std::optional<CudaFence> Group::post(OpRequest request) {
  if (closed_) {
    fail("group '", config_->name, "' is closed");
  }
  auto op = std::make_shared<Op>();
  op->id = engine_->nextOpId();
  op->request = std::move(request);
  op->groupId = id_;
  op->config = config_;
  std::lock_guard<std::mutex> numbering(postMutex_);
  const bool placeKnown = number(*op);
  std::optional<CudaFence> fence;
  if (op->request.buffer.memory == MemoryKind::kCuda) {
    const int peer = op->request.peer;
    PostOptions options{timeout(), {}, {}, placeKnown};
    if (peer != kAnySource) {
      options.route.stagedThroughHost = stagesCuda_[peer];
      std::lock_guard<std::mutex> lock(keysMutex_);
      options.peerKey = processKeys_[peer];
    }
    try {
      op->channel = cudaChannel(peer);
      fence = engine_->channel(op->channel).prepare(*op, options);
    } catch (...) {
      unnumber(*op);  // not posted: the next op takes its place in the line
      throw;
    }
  }
  op->posted = Clock::now();
  op->deadline = op->posted + timeout();
  engine_->post(std::move(op));
  return fence;
}

bool Group::number(Op& op) {
  const std::pair<int, int> line{op.request.peer, op.request.tag};
  if (op.isSend()) {
    op.seq = sendSeq_[line]++;
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
  op.seq = recvSeq_[line]++;
  return !anySourcePosted_;
}

void Group::unnumber(const Op& op) {
  if (op.request.peer == kAnySource) return;
  --(op.isSend() ? sendSeq_ : recvSeq_)[{op.request.peer, op.request.tag}];
}

ChannelKind Group::cudaChannel(int peer) const {
  switch (engine_->config().transport) {
    case Transport::kCopyEngine:
      return ChannelKind::kCopyEngine;
    case Transport::kUcx:
      return ChannelKind::kUcx;
    case Transport::kAuto:
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
         "matches: name the source rank, or set SMFREE_TRANSPORT=ucx");
  }
  return local ? ChannelKind::kCopyEngine : ChannelKind::kUcx;
}

Clock::time_point Group::queuedDeadline() const {
  // The op's own timeout sets `queued` first; the margin only guards against a stuck engine.
  return Clock::now() + timeout() + kQueuedMargin;
}

bool Group::pollQueued(const CudaFence& fence, Clock::time_point deadline) {
  Channel& channel = engine_->channel(fence.channel);
  return pollUntil([&] { return channel.fenceQueued(fence); }, engine_->spin().get(), deadline);
}

void Group::awaitQueued(const CudaFence& fence) {
  if (fence.stagedRecv) {
    queueCopiesInBy(fence, Clock::time_point::max());  // throws at the deadline
    return;
  }
  // Short: the partner has usually posted already. The op's own timeout sets `queued`
  // before the deadline comes.
  if (!pollQueued(fence, queuedDeadline())) {
    fail("the partner's copy was not submitted before the deadline");
  }
}

bool Group::queueCopiesInBy(const CudaFence& fence, Clock::time_point until) {
  const auto deadline = queuedDeadline();
  if (pollQueued(fence, std::min(until, deadline))) return true;
  if (until < deadline) return false;
  fail("the recv did not match, or its bytes did not land, in time");
}

bool Group::queueCopiesInOnceMatched(const CudaFence& fence) {
  return engine_->channel(fence.channel).fenceQueued(fence);
}

std::optional<std::string> Group::failureAfterWait() {
  return engine_->failures().afterWait(id_);
}

void Group::recordFailureAfterWait(std::string why) {
  engine_->failures().recordAfterWait(id_, std::move(why));
}

void Group::waitOnStream(void* stream, int device, const CudaFence& fence) {
  engine_->channel(fence.channel).waitOnStream(stream, device, fence);
}

void Group::close(StatusCode code, const std::string& reason, bool abort) {
  if (closed_.exchange(true)) {
    return;
  }
  // Ops whose wait() has returned still owe their peers the bytes, or their streams the copies
  // in; their own timeouts bound this.
  if (!abort) engine_->awaitReleasedOps(id_, Clock::now() + timeout());
  engine_->closeGroup(id_, code, reason);
}

std::optional<std::string> Group::peerFailure(int rank) {
  if (!engine_->failures().any()) {
    return std::nullopt;
  }
  std::string key;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    key = processKeys_[rank];
  }
  return key.empty() ? std::nullopt : engine_->failures().ofPeer(key);
}

std::string Group::dumpPending() { return engine_->dumpPending(id_); }

std::map<std::string, int64_t> Group::stats() { return engine_->stats(); }

}  // namespace smfree::engine
