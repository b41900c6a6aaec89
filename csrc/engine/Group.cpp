#include "engine/Group.h"

#include "engine/Error.h"
#include "engine/Log.h"

namespace smfree::engine {
namespace {

constexpr auto kQueuedMargin = std::chrono::seconds(10);

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
  const uint64_t id = id_;
  Engine* engine = engine_.get();
  const bool stagesCuda = engine_->call<bool>(
      [engine, id, rank, address] { return engine->attachPeer(id, rank, address); }, timeout(),
      "connecting to a peer");
  stagesCuda_[rank] = stagesCuda;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    processKeys_[rank] = address.processKey;
  }
  sameHost_[rank] = address.hostKey == engine_->local_.hostKey;
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
  std::optional<CudaFence> fence;
  if (op->request.buffer.memory == MemoryKind::kCuda) {
    if (onCopyEngine(op->request.peer)) {
      fence = engine_->prepareCuda(*op, timeout());
    } else {
      const int peer = op->request.peer;
      const bool staged =
          peer != kAnySource && stagesCuda_[peer] && op->request.buffer.bytes > 0;
      fence = engine_->prepareUcxCuda(*op, timeout(), staged);
    }
  }
  op->posted = Clock::now();
  op->deadline = op->posted + timeout();
  Engine* engine = engine_.get();
  engine_->submit([engine, op] { engine->startOp(op); });
  return fence;
}

bool Group::onCopyEngine(int peer) const {
  switch (engine_->config().transport) {
    case Transport::kCopyEngine:
      return true;
    case Transport::kUcx:
      return false;
    case Transport::kAuto:
      break;
  }
  if (peer != kAnySource) {
    return sameHost_[peer];
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
  return local;
}

Clock::time_point Group::queuedDeadline() const {
  // The op's own timeout sets `queued` first; the margin only guards against a stuck engine.
  return Clock::now() + timeout() + kQueuedMargin;
}

void Group::awaitQueued(const CudaFence& fence) {
  if (fence.stagedRecv) {
    queueCopiesInBy(fence, Clock::time_point::max());  // throws at the deadline
  } else {
    engine_->awaitQueued(fence.queued, queuedDeadline());
  }
}

bool Group::queueCopiesInBy(const CudaFence& fence, Clock::time_point until) {
  const auto deadline = queuedDeadline();
  if (engine_->queueCopiesInBy(*fence.stagedRecv, std::min(until, deadline))) return true;
  if (until < deadline) return false;
  fail("the recv did not match, or its bytes did not land, in time");
}

bool Group::queueCopiesInOnceMatched(const CudaFence& fence) {
  return engine_->queueCopiesInOnceMatched(*fence.stagedRecv);
}

std::optional<std::string> Group::failureAfterWait() { return engine_->failureAfterWait(id_); }

void Group::recordFailureAfterWait(std::string why) {
  engine_->recordFailureAfterWait(id_, std::move(why));
}

void Group::waitOnStream(void* stream, int device, const CudaFence& fence) {
  engine_->waitOnStream(stream, device, fence);
}

void Group::close(StatusCode code, const std::string& reason, bool abort) {
  if (closed_.exchange(true)) {
    return;
  }
  const uint64_t id = id_;
  // Ops whose wait() has returned still owe their peers the bytes, or their streams the copies
  // in; their own timeouts bound this.
  if (!abort) engine_->awaitReleasedOps(id, Clock::now() + timeout());
  Engine* engine = engine_.get();
  engine_->call<void>([engine, id, code, reason] { engine->closeGroup(id, code, reason); },
                      std::chrono::seconds(60), "closing the group");
}

std::optional<std::string> Group::peerFailure(int rank) {
  if (!engine_->anyFailure_.load(std::memory_order_acquire)) {
    return std::nullopt;
  }
  std::string key;
  {
    std::lock_guard<std::mutex> lock(keysMutex_);
    key = processKeys_[rank];
  }
  return key.empty() ? std::nullopt : engine_->failureOf(key);
}

std::string Group::dumpPending() {
  const uint64_t id = id_;
  Engine* engine = engine_.get();
  return engine_->call<std::string>([engine, id] { return engine->dumpPending(id); },
                                    std::chrono::seconds(10), "dumping pending ops");
}

std::map<std::string, int64_t> Group::stats() {
  Engine* engine = engine_.get();
  return engine_->call<std::map<std::string, int64_t>>([engine] { return engine->stats(); },
                                                       std::chrono::seconds(10), "reading stats");
}

}  // namespace smfree::engine
