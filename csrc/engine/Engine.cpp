#include "engine/Engine.h"

#include <poll.h>
#include <sys/prctl.h>

#include <algorithm>
#include <sstream>

#include "engine/Channel.h"
#include "engine/Error.h"
#include "engine/Group.h"
#include "engine/Log.h"
#include "engine/channels/cuda_ipc/CopyEngineChannel.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/channels/ucx/UcxReceiveLane.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"
#include "engine/transports/ucx/UcxContext.h"
#include "engine/transports/ucx/UcxControl.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {
namespace {

constexpr auto kExpiryScanInterval = std::chrono::milliseconds(20);
// Longest a process exit waits for sends whose wait() has returned to deliver their bytes.
constexpr auto kExitDrainLimit = std::chrono::seconds(60);
// How often exported CUDA memory is checked for having been freed: what a peer's mapping
// keeps of the memory after the allocator released it is held for about this long.
constexpr auto kExportSweepInterval = std::chrono::milliseconds(50);
// Longest sleep, so expiry is noticed promptly while idle.
constexpr timespec kIdleSleep{0, 50'000'000};
// While copies are pending the thread also watches memory, which wakes no fd: it waits for
// its fds at most this long.
constexpr timespec kMemoryWatchNap{0, 20'000};

std::mutex processEngineMutex;
std::weak_ptr<Engine> processEngine;

int64_t millisSince(Clock::time_point then, Clock::time_point now) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - then).count();
}

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

std::string crossHostCuda(const Op& op, const Peer& peer) {
  return concat(op.describe(), " failed: rank ", op.partner(), " (", peer.describe(),
                ") is on another host, out of reach of the copy engines "
                "(SMFREE_TRANSPORT=copy_engine); use auto or ucx");
}

ChannelKind channelKindOf(const Op& op) {
  return op.cuda ? ChannelKind::kCopyEngine : ChannelKind::kUcx;
}

const char* channelName(ChannelKind kind) {
  return kind == ChannelKind::kCopyEngine ? "the copy engines" : "UCX";
}

std::string mismatchMessage(const GroupConfig& group, const ReadyToSend& send, const Op& recv) {
  const char* what = send.desc.device != recv.request.desc.device ? "device" : "size or dtype";
  return concat(what, " mismatch in group '", group.name, "', tag ", send.tag, ": rank ",
                send.source, " sends ", send.desc.describe(), " to rank ", group.rank,
                ", which receives into ", recv.request.desc.describe());
}

}  // namespace

// ---------------------------------------------------------------- lifetime

std::shared_ptr<Engine> Engine::acquire() {
  std::lock_guard<std::mutex> lock(processEngineMutex);
  if (auto engine = processEngine.lock()) {
    return engine;
  }
  auto engine = std::make_shared<Engine>(Private{});
  processEngine = engine;
  return engine;
}

void Engine::stopProcessEngine() {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(processEngineMutex);
    engine = processEngine.lock();
  }
  if (engine) {
    // A rank may exit right after wait() on a staged op: a send's receiver is owed the bytes,
    // and a recv's copies in still read the host memory.
    try {
      engine->awaitReleasedOps(std::nullopt, Clock::now() + kExitDrainLimit);
    } catch (const Error& error) {
      log(LogLevel::kWarn, "at exit: ", error.what());
    }
    engine->stop();
  }
}

Engine::Engine(Private)
    : config_(Config::fromEnv()),
      ucx_(std::make_unique<UcxContext>(config_)),
      worker_(std::make_unique<UcxWorker>(*ucx_, UcxWorker::Threads::kSingle)),
      receiveLane_(std::make_unique<UcxReceiveLane>(*ucx_, config_.spin)),
      flags_(std::make_unique<cuda::FlagSegment>()),
      local_(PeerAddress::local(worker_->address(), receiveLane_->worker().address(),
                                flags_->path())) {
  control_ = std::make_unique<UcxControl>(
      *worker_, [this](const void* data, size_t length) { onControlMessage(data, length); });
  ucxChannel_ = std::make_unique<UcxChannel>(
      *worker_, *receiveLane_, *flags_, config_.hostStagingPieceBytes,
      [this](const std::shared_ptr<Op>& op, const Status& status) { onTransferDone(op, status); });
  copyEngine_ = std::make_unique<CopyEngineChannel>(
      *flags_, config_.ipcCacheSize, config_.stagingBytes,
      [this](const std::shared_ptr<Op>& op, const Status& status) { onTransferDone(op, status); },
      [this](Peer& peer, std::string data) {
        sendControl(peer, ChannelNotice{local_.processKey, std::move(data)});
      });
  progress_ = std::thread([this] { run(); });
  log(LogLevel::kInfo, "engine started on host ", local_.hostname);
  if (!config_.spinNote.empty()) log(LogLevel::kInfo, config_.spinNote);
}

Engine::~Engine() {
  stopProgressThread();
  flushPeers();
  // The progress thread is gone: finish what is left from here, held ops too.
  std::vector<std::shared_ptr<Op>> left;
  for (const auto& [id, op] : live_) left.push_back(op);
  left.insert(left.end(), heldOps_.begin(), heldOps_.end());
  for (const std::shared_ptr<Op>& op : left) {
    complete(op, Status::failure(StatusCode::kAborted,
                                 concat(op->describe(), " failed: the smfree engine shut down")));
  }
  heldOps_.clear();
  live_.clear();
  groups_.clear();
  peers_.clear();
  receiveLane_->stop();  // after the endpoints' flushes, which peers' sends may wait on
  ucxChannel_.reset();
  copyEngine_.reset();
  control_.reset();
}

void Engine::stop() {
  stopProgressThread();
  flushPeers();
  receiveLane_->stop();
}

void Engine::flushPeers() {
  // Sends whose wait() returned may still be on their way: the peers take them before the
  // connections go. Callbacks that run meanwhile find every peer in place.
  for (auto& [key, peer] : peers_) {
    if (peer->endpoint) peer->endpoint->flush();
    if (peer->dataEndpoint) peer->dataEndpoint->flush();
  }
}

void Engine::stopProgressThread() {
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
  }
  worker_->signal();
  if (progress_.joinable()) {
    progress_.join();
  }
}

// ---------------------------------------------------------------- any thread

void Engine::awaitReleasedOps(std::optional<uint64_t> groupId, Clock::time_point deadline) {
  size_t left = 0;
  while (true) {
    left = call<size_t>([this, groupId] { return releasedOpsInFlight(groupId); },
                        std::chrono::seconds(10), "counting ops in flight");
    if (left == 0 || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (left != 0) {
    log(LogLevel::kWarn, left, " ops whose wait() had returned were still moving bytes when ",
        groupId ? "their group closed" : "the process exited", "; they fail");
  }
}

void Engine::submit(std::function<void()> command) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      fail("the engine has shut down");
    }
    commands_.push_back(std::move(command));
    wake = sleeping_;
  }
  if (wake) {
    worker_->signal();
  }
}

std::optional<std::string> Engine::failureOf(const std::string& processKey) {
  return recordedFailure(failures_, processKey);
}

std::optional<std::string> Engine::failureAfterWait(uint64_t groupId) {
  return recordedFailure(failedAfterWait_, groupId);
}

void Engine::recordFailureAfterWait(uint64_t groupId, std::string why) {
  std::lock_guard<std::mutex> lock(failuresMutex_);
  failedAfterWait_.try_emplace(groupId, std::move(why));
  anyFailure_.store(true, std::memory_order_release);
}

template <typename Key>
std::optional<std::string> Engine::recordedFailure(
    const std::unordered_map<Key, std::string>& failures, const Key& key) {
  if (!anyFailure_.load(std::memory_order_acquire)) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(failuresMutex_);
  auto it = failures.find(key);
  if (it == failures.end()) {
    return std::nullopt;
  }
  return it->second;
}

std::shared_ptr<Group> Engine::joinGroup(GroupConfig config, std::shared_ptr<KeyValueStore> store,
                                         std::chrono::milliseconds timeout) {
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
    fail("invalid group '", config.name, "': rank ", config.rank, " of size ", config.size);
  }
  auto shared = std::make_shared<const GroupConfig>(std::move(config));
  // Registered before it is published: a peer that reads the address may send at once, and
  // until then this engine drops messages for the name's previous group, closed but still known.
  call<void>(
      [this, shared, timeout] {
        longestGroupTimeout_ = std::max(longestGroupTimeout_, timeout);
        registerGroup(shared);
      },
      timeout, "registering the group");
  auto group = std::make_shared<Group>(shared_from_this(), shared, store, timeout);
  store->set(addressKey(shared->rank), local_.encode());  // on failure, ~Group closes it
  return group;
}

// ---------------------------------------------------------------- progress thread

void Engine::run() {
  // Every hop of a rendezvous passes through this thread: a sleep that overshoots by the
  // default 50 µs timer slack showed up as +10 % pipeline step time.
  prctl(PR_SET_TIMERSLACK, 1000UL);
  prctl(PR_SET_NAME, "smfree-progress");  // what top -H and py-spy show for this thread
  auto lastActivity = Clock::now();
  auto lastScan = lastActivity;
  auto lastSweep = lastActivity;
  // UCX pins host memory for CUDA copies only while a context is current (cuda_copy's
  // registration is a no-op otherwise), and it allocates its host staging fragments from
  // inside worker progress. Unpinned fragments halved host-staged bandwidth, so once a CUDA
  // buffer has gone to UCX its device's context stays current on this thread.
  cuda::CurrentContext ucxContext;
  while (runCommands()) {
    if (!heldOps_.empty() && commitments_ == 0) startHeldOps();
    bool active = copyEngine_->progress();
    active = ucxChannel_->progress() || active;
    if (const int device = ucxChannel_->cudaDevice(); device >= 0) ucxContext.use(device);
    while (worker_->progress() != 0) {
      active = true;
    }
    const auto now = Clock::now();
    if (active) {
      lastActivity = now;
    }
    if (now - lastScan >= kExpiryScanInterval) {
      checkPeers();
      recycleFlags();
      expireOps(now);
      lastScan = now;
    }
    if (now - lastSweep >= kExportSweepInterval) {
      announceReleasedMemory();
      lastSweep = now;
    }
    if (now - lastActivity < config_.spin || !worker_->arm()) {
      continue;
    }
    {
      // The worker is armed: from here on a submitter must fire its event fd.
      std::lock_guard<std::mutex> lock(commandsMutex_);
      if (!commands_.empty() || stopping_) {
        continue;
      }
      sleeping_ = true;
    }
    sleep();
  }
}

void Engine::sleep() {
  // Submitters signal the worker, which fires its armed event fd; a same-host peer's exit
  // fires its pidfd. Flags in memory fire nothing, so while copies are in flight the wait
  // is short.
  std::vector<pollfd>& events = sleepEvents_;  // reused: this runs every 20 µs while busy
  events.assign(1, pollfd{worker_->eventFd(), POLLIN, 0});
  for (const auto& [key, peer] : peers_) {
    if (peer->watch && peer->watch->fd() >= 0 && !peer->failed) {
      events.push_back({peer->watch->fd(), POLLIN, 0});
    }
  }
  const bool watching = copyEngine_->busy() || ucxChannel_->busy();
  const timespec& timeout = watching ? kMemoryWatchNap : kIdleSleep;
  if (ppoll(events.data(), events.size(), &timeout, nullptr) > 0 && events.size() > 1) {
    checkPeers();
  }
}

void Engine::announceReleasedMemory() {
  for (auto& [key, ids] : copyEngine_->sweepExports()) {
    auto it = peers_.find(key);
    if (it != peers_.end() && !it->second->failed) {
      sendControl(*it->second, MemoryReleased{local_.processKey, std::move(ids)});
    }
  }
}

void Engine::onMemoryReleased(const MemoryReleased& message) {
  copyEngine_->memoryReleased(message.owner, message.ids);
}

void Engine::onChannelNotice(const ChannelNotice& message) {
  auto it = peers_.find(message.sender);
  // A failed peer's notices are void: its channel state is gone.
  if (it != peers_.end() && !it->second->failed) {
    copyEngine_->onNotice(*it->second, message.data);
  }
}

void Engine::checkPeers() {
  for (auto& [key, peer] : peers_) {
    if (peer->watch && !peer->failed && !peer->watch->alive()) {
      onPeerFailure(key, "the process exited");
    }
    // Dropped here, outside any UCX callback; UCX keeps them until the worker goes.
    if (peer->failed && peer->sameHost && peer->endpoint) {
      peer->endpoint->peerGone();
      peer->endpoint.reset();
      peer->dataEndpoint->peerGone();
      peer->dataEndpoint.reset();
    }
  }
}

bool Engine::referencedByOpenGroup(const Peer& peer) const {
  for (const auto& [id, group] : groups_) {
    if (group.closed) continue;
    for (const Peer* member : group.peers) {
      if (member == &peer) return true;
    }
  }
  return false;
}

bool Engine::runCommands() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      return false;
    }
    sleeping_ = false;
    batch.swap(commands_);
  }
  for (auto& command : batch) {
    try {
      command();
    } catch (const std::exception& error) {
      log(LogLevel::kError, "internal command failed: ", error.what());
    }
  }
  return true;
}

void Engine::registerGroup(std::shared_ptr<const GroupConfig> config) {
  const uint64_t id = groupIdOf(config->name);
  auto existing = groups_.find(id);
  if (existing != groups_.end() && !existing->second.closed) {
    fail("group '", config->name, "' is already open in this process (or its name hashes like "
         "group '", existing->second.config->name, "')");
  }
  {
    std::lock_guard<std::mutex> lock(failuresMutex_);
    failedAfterWait_.erase(id);  // of a closed group of the same name
  }
  GroupState& state = groups_[id];
  state = GroupState{};
  state.config = config;
  state.id = id;
  state.peers.assign(config->size, nullptr);
  auto orphans = orphans_.find(id);
  if (orphans != orphans_.end()) {
    for (ReadyToSend& rts : orphans->second) {
      state.matcher.announce(std::move(rts));  // no recv is posted yet: nothing can match
    }
    orphans_.erase(orphans);
  }
}

bool Engine::attachPeer(uint64_t groupId, int rank, const PeerAddress& address) {
  GroupState* group = findGroup(groupId);
  if (!group || group->closed) {
    fail("group is closed");
  }
  auto existing = peers_.find(address.processKey);
  if (existing != peers_.end()) {
    group->peers[rank] = existing->second.get();
    return ucxChannel_->stagesCudaToward(*existing->second);
  }
  NewPeer added = makePeer(address);
  Peer& peer = *added.peer;
  group->peers[rank] = added.peer.get();
  peers_.emplace(address.processKey, std::move(added.peer));
  if (added.unreachable) {
    // Its ops are refused, and recvs from any source pass it over, as with a peer that failed
    // later. Its engine is gone for good: a new one would publish a new process key.
    onPeerFailure(address.processKey, *added.unreachable);
    return false;
  }
  return ucxChannel_->stagesCudaToward(peer);
}

Engine::NewPeer Engine::makePeer(const PeerAddress& address) {
  auto peer = std::make_unique<Peer>();
  peer->address = address;
  peer->sameHost = address.hostKey == local_.hostKey;
  if (peer->sameHost) {
    peer->watch = std::make_unique<ProcessWatch>(address.pid);
    if (!peer->watch->alive()) return {std::move(peer), "the process exited"};
  }
  const std::string key = address.processKey;
  // Same host: shared memory and CMA need UCX's peer-failure handling off; the watch
  // notices a dead peer instead.
  const auto onError = [this, key](ucs_status_t status) {
    onPeerFailure(key, ucxPeerErrorText(status));
  };
  try {
    peer->endpoint = std::make_unique<UcxEndpoint>(worker_->handle(), address.workerAddress,
                                                   !peer->sameHost, longestGroupTimeout_,
                                                   onError);
    peer->dataEndpoint =
        std::make_unique<UcxEndpoint>(worker_->handle(), address.receiveWorkerAddress,
                                      !peer->sameHost, longestGroupTimeout_, onError);
  } catch (const Error& error) {
    // UCX cannot attach to the shared memory or socket of an engine that has closed.
    if (peer->endpoint) peer->endpoint->peerGone();  // unreachable: no flush to wait for
    peer->endpoint.reset();
    if (peer->watch && !peer->watch->alive()) return {std::move(peer), "the process exited"};
    return {std::move(peer),
            concat("cannot reach it (did it close its groups?): ", reasonOf(error))};
  }
  return {std::move(peer), std::nullopt};
}

void Engine::closeGroup(uint64_t groupId, StatusCode code, const std::string& reason) {
  GroupState* group = findGroup(groupId);
  if (!group || group->closed) {
    return;
  }
  group->closed = true;
  group->closeReason = reason;
  std::vector<std::shared_ptr<Op>> affected;
  for (auto& [id, op] : live_) {
    if (op->groupId == groupId && !op->finished()) affected.push_back(op);
  }
  for (auto& op : affected) {
    const bool moving = op->phase == Op::Phase::kMoving;
    complete(op, Status::failure(code, concat(op->describe(), " failed: ", reason)));
    if (moving) channelFor(*op).cancel(*op);
  }
  group->matcher.clear();
  std::deque<std::shared_ptr<Op>> held;
  for (auto& op : heldOps_) {
    if (op->groupId != groupId) {
      held.push_back(op);
    } else {
      complete(op, Status::failure(code, concat(op->describe(), " failed: ", reason)));
    }
  }
  heldOps_.swap(held);
}

size_t Engine::releasedOpsInFlight(std::optional<uint64_t> groupId) {
  size_t count = 0;
  for (const auto& [id, op] : live_) {
    if (groupId && op->groupId != *groupId) continue;
    if (!op->finished() && op->ucxCuda && flags_->isSet(op->ucxCuda->queued)) ++count;
  }
  return count;
}

std::string Engine::dumpPending(uint64_t groupId) {
  const auto now = Clock::now();
  std::ostringstream out;
  size_t count = 0;
  for (const auto& [id, op] : live_) {
    if (op->groupId != groupId || op->finished()) continue;
    ++count;
    out << "  " << op->describe() << ", posted " << millisSince(op->posted, now) << " ms ago, "
        << (op->phase == Op::Phase::kMoving
                ? "moving data"
                : (op->isSend() ? "waiting for the receiver" : "waiting for a matching send"));
    if (op->cuda) {
      out << " [flags " << copyEngine_->describeWait(*op) << "]";
    }
    out << "\n";
  }
  if (GroupState* group = findGroup(groupId)) {
    group->matcher.forEachWaiting([&](const Announcement& announcement) {
      ++count;
      out << "  announced send from rank " << announcement.rts.source << " (tag "
          << announcement.rts.tag << ", " << announcement.rts.desc.describe()
          << "), waiting for a recv" << (announcement.cancelled ? " (cancelled by sender)" : "")
          << "\n";
    });
  }
  return concat(count, " pending:\n", out.str());
}

std::map<std::string, int64_t> Engine::stats() {
  return {{"live_ops", static_cast<int64_t>(live_.size())},
          {"ipc_mappings", static_cast<int64_t>(copyEngine_->ipcMappings())},
          {"ipc_exports", static_cast<int64_t>(copyEngine_->ipcExports())},
          {"flag_words_in_use", static_cast<int64_t>(flags_->inUse())},
          {"staging_rings", static_cast<int64_t>(copyEngine_->stagingRings())},
          {"staged_sends", static_cast<int64_t>(copyEngine_->stagedSends())},
          {"staged_recvs", static_cast<int64_t>(copyEngine_->stagedRecvs())},
          {"ucx_host_staged_sends", static_cast<int64_t>(ucxChannel_->hostStagedSends())},
          {"ucx_host_staged_recvs", static_cast<int64_t>(ucxChannel_->hostStagedRecvs())},
          {"ucx_host_staging_cached_bytes",
           static_cast<int64_t>(ucxChannel_->hostStagingCachedBytes())}};
}

bool Engine::needsCudaOnProgressThread(const Op& op) {
  return op.cuda || (op.ucxCuda && !op.ucxCuda->staging);
}

void Engine::startHeldOps() {
  std::deque<std::shared_ptr<Op>> held;
  held.swap(heldOps_);
  for (const std::shared_ptr<Op>& op : held) startOp(op);
}

void Engine::startOp(const std::shared_ptr<Op>& op) {
  if (!heldOps_.empty()) {
    heldOps_.push_back(op);  // ops start in posting order: they match in it
    return;
  }
  if (needsCudaOnProgressThread(*op)) {
    if (promising_) {
      promising_ = false;
      stoppedPromising_ = op->describe();
    }
    // Its CUDA calls could stall this thread while a peer's stream waits for bytes it moves.
    if (commitments_ > 0) {
      heldOps_.push_back(op);
      return;
    }
  }
  GroupState* group = findGroup(op->groupId);
  if (!group || group->closed) {
    complete(op, Status::failure(StatusCode::kAborted,
                                 concat(op->describe(), " failed: the group is closed")));
    return;
  }
  live_.emplace(op->id, op);
  if (op->request.peer != kAnySource) {
    Peer* peer = group->peers[op->request.peer];
    if (!peer || peer->failed) {
      complete(op, Status::failure(StatusCode::kPeerFailure,
                                   concat(op->describe(), " failed: ",
                                          peer ? peer->failure : "the peer is not connected")));
      return;
    }
    if (op->cuda && !peer->sameHost) {
      complete(op, Status::failure(StatusCode::kTransport, crossHostCuda(*op, *peer)));
      return;
    }
    if (op->isSend()) {
      op->seq = group->sendSeq[{op->request.peer, op->request.tag}]++;
      // A caller-staged send's copies out are queued already (prepareUcxCuda).
      op->promised = promising_ && op->ucxCuda && op->ucxCuda->staging;
      if (op->promised) ++commitments_;
      if (op->ucxCuda && op->ucxCuda->staging && !op->promised) {
        logOnce("unpromised-send",
                concat("staged CUDA sends are not promised since this process moved ",
                       stoppedPromising_, " with CUDA calls on its progress thread: their "
                       "receivers' wait() holds the CPU until the bytes land"));
      }
      // Announced first: preparing may take a while (pinned memory allocated), and the
      // receiver can match meanwhile.
      sendControl(*peer, ReadyToSend{op->groupId, group->config->rank, op->request.tag, op->seq,
                                     op->id, op->request.desc, channelKindOf(*op),
                                     op->promised});
      try {
        channelFor(*op).prepareSend(op, *peer);
      } catch (const Error& error) {
        // Its clear-to-send then finds it failed and tells the receiver.
        complete(op, Status::failure(StatusCode::kTransport, error.what()));
      }
      return;
    }
  }
  if (auto match = group->matcher.postRecv(op)) {
    onMatched(*group, *match);
  }
}

void Engine::onControlMessage(const void* data, size_t length) {
  std::visit(
      [this](const auto& message) {
        using T = std::decay_t<decltype(message)>;
        if constexpr (std::is_same_v<T, ReadyToSend>) onReadyToSend(message);
        if constexpr (std::is_same_v<T, ClearToSend>) onClearToSend(message);
        if constexpr (std::is_same_v<T, Refusal>) onRefusal(message);
        if constexpr (std::is_same_v<T, Cancellation>) onCancellation(message);
        if constexpr (std::is_same_v<T, MemoryReleased>) onMemoryReleased(message);
        if constexpr (std::is_same_v<T, ChannelNotice>) onChannelNotice(message);
      },
      decode(data, length));
}

void Engine::onReadyToSend(const ReadyToSend& message) {
  GroupState* group = findGroup(message.group);
  if (!group) {
    orphans_[message.group].push_back(message);
    return;
  }
  if (group->closed) {
    log(LogLevel::kDebug, "dropped a send announced to closed group '", group->config->name, "'");
    return;
  }
  for (Matcher::Match& match : group->matcher.announce(message)) {
    onMatched(*group, match);
  }
}

void Engine::onMatched(GroupState& group, Matcher::Match& match) {
  const std::shared_ptr<Op>& recv = match.recv;
  const ReadyToSend& rts = match.announcement.rts;
  Peer* sender = group.peers[rts.source];
  if (!sender) {
    // Cannot happen for a specific recv (it connects first); any-source recvs connect to all.
    complete(recv, Status::failure(StatusCode::kTransport,
                                   concat(recv->describe(), " matched rank ", rts.source,
                                          ", which it is not connected to")));
    return;
  }
  if (recv->finished()) {
    // The recv timed out earlier but kept its place in line: refuse the send it was meant for.
    sendControl(*sender, Refusal{group.id, group.config->rank, rts.sendId, StatusCode::kTimeout,
                                 concat("the matching ", recv->describe(),
                                        " had already timed out")});
    return;
  }
  recv->source = rts.source;
  if (recv->request.onMatched) recv->request.onMatched(rts.source);
  if (recv->cuda && !sender->sameHost && rts.desc.compatibleWith(recv->request.desc)) {
    const std::string why = crossHostCuda(*recv, *sender);
    complete(recv, Status::failure(StatusCode::kTransport, why));
    sendControl(*sender, Refusal{group.id, group.config->rank, rts.sendId,
                                 StatusCode::kTransport, why});
    return;
  }
  if (match.announcement.cancelled) {
    complete(recv, Status::failure(StatusCode::kTimeout,
                                   concat(recv->describe(), " failed: the matching send gave up: ",
                                          match.announcement.cancelReason)));
    return;
  }
  if (!rts.desc.compatibleWith(recv->request.desc)) {
    const std::string why = mismatchMessage(*group.config, rts, *recv);
    complete(recv, Status::failure(StatusCode::kMismatch, why));
    sendControl(*sender, Refusal{group.id, group.config->rank, rts.sendId, StatusCode::kMismatch,
                                 why});
    return;
  }
  if (rts.desc.bytes != 0 && rts.channel != channelKindOf(*recv)) {
    const std::string why =
        concat("channel mismatch in group '", group.config->name, "', tag ", rts.tag, ": rank ",
               rts.source, " sends ", rts.desc.describe(), " over ", channelName(rts.channel),
               ", rank ", group.config->rank, " receives into ", recv->request.desc.describe(),
               " over ", channelName(channelKindOf(*recv)),
               " (SMFREE_TRANSPORT must be alike on every rank)");
    complete(recv, Status::failure(StatusCode::kMismatch, why));
    sendControl(*sender, Refusal{group.id, group.config->rank, rts.sendId, StatusCode::kMismatch,
                                 why});
    return;
  }
  ClearToSend clear{group.id, group.config->rank, rts.sendId, recv->id, {}};
  if (rts.desc.bytes == 0) {
    complete(recv, Status::success());
    sendControl(*sender, clear);
    return;
  }
  recv->phase = Op::Phase::kMoving;
  try {
    clear.channelData = channelFor(*recv).armRecv(recv, *sender);
  } catch (const Error& error) {
    complete(recv, Status::failure(StatusCode::kTransport, error.what()));
    sendControl(*sender, Refusal{group.id, group.config->rank, rts.sendId,
                                 StatusCode::kTransport, error.what()});
    return;
  }
  sendControl(*sender, clear);
  if (recv->ucxCuda && recv->ucxCuda->staging && !recv->finished()) {
    // Its copies in may wait on the GPU only for bytes that nothing here has to move: the
    // sender's are copied out and moved by threads that make no CUDA call (promised), the
    // clear-to-send has left (an eager control message on a connection of its own), and the
    // receive lane, which makes no CUDA call while this process promises, marks the pieces.
    const bool promised = rts.promised && promising_;
    if (!promised) {
      logOnce("unpromised-recv",
              concat(recv->describe(), " and later staged CUDA recvs like it hold the CPU in "
                     "wait() until their bytes land: ",
                     rts.promised ? concat("this process moved ", stoppedPromising_,
                                           " with CUDA calls on its progress thread")
                                  : std::string("the sender did not promise its send (it "
                                                "makes CUDA calls on its progress thread)")));
    }
    recv->promised = promised;
    if (promised) ++commitments_;
    recv->ucxCuda->staging->matched.store(
        promised ? CallerStaging::kMatchedPromised : CallerStaging::kMatchedUnpromised,
        std::memory_order_release);
  }
}

void Engine::onClearToSend(const ClearToSend& message) {
  std::shared_ptr<Op> send = findLive(message.sendId);
  GroupState* group = findGroup(message.group);
  Peer* receiver = group ? group->peers[message.receiver] : nullptr;
  if (!send || send->finished()) {
    // The send already failed (timeout, abort): its receiver must not wait for the bytes.
    if (receiver && message.recvId != 0) {
      sendControl(*receiver,
                  Cancellation{message.group, group->config->rank, 0, 0, message.recvId,
                               send ? concat("the matching send gave up: ", send->describe(),
                                             " had already failed")
                                    : concat("the matching send gave up: rank ",
                                             group->config->rank, " had already failed it")});
    }
    return;
  }
  if (send->request.desc.bytes == 0) {
    complete(send, Status::success());
    return;
  }
  if (!receiver) {
    complete(send, Status::failure(StatusCode::kTransport,
                                   concat(send->describe(), " was cleared by an unknown rank")));
    return;
  }
  if (receiver->failed) {
    complete(send, Status::failure(StatusCode::kPeerFailure,
                                   concat(send->describe(), " failed: ", receiver->failure)));
    return;
  }
  send->phase = Op::Phase::kMoving;
  try {
    channelFor(*send).startSend(send, *receiver, message.channelData);
  } catch (const Error& error) {
    complete(send, Status::failure(StatusCode::kTransport, error.what()));
  }
}

void Engine::onRefusal(const Refusal& message) {
  if (std::shared_ptr<Op> send = findLive(message.sendId)) {
    complete(send, Status::failure(message.code, message.reason));
  }
}

void Engine::onCancellation(const Cancellation& message) {
  if (message.recvId != 0) {
    std::shared_ptr<Op> recv = findLive(message.recvId);
    if (!recv) {
      return;
    }
    // Also for a recv that already failed (timed out, group closed): its channel may still
    // hold the buffer for bytes that will now never come.
    const bool armed = recv->outstanding > 0;
    complete(recv, Status::failure(StatusCode::kTimeout,
                                   concat(recv->describe(), " failed: ", message.reason)));
    if (armed) channelFor(*recv).partnerGaveUp(*recv);
    return;
  }
  if (GroupState* group = findGroup(message.group)) {
    group->matcher.cancel(message.source, message.tag, message.seq, message.reason);
  }
}

void Engine::onTransferDone(const std::shared_ptr<Op>& op, const Status& status) {
  complete(op, status);
  release(op);
}

void Engine::onPeerFailure(const std::string& processKey, const std::string& why) {
  auto it = peers_.find(processKey);
  if (it == peers_.end() || it->second->failed) {
    return;
  }
  Peer& peer = *it->second;
  peer.failed = true;
  peer.failure = concat("its peer process (", peer.describe(), ") failed: ", why);
  {
    std::lock_guard<std::mutex> lock(failuresMutex_);
    failures_[processKey] = peer.failure;
    anyFailure_.store(true, std::memory_order_release);
  }
  std::vector<std::shared_ptr<Op>> affected;
  for (auto& [id, op] : live_) {
    if (!op->finished() && partnerOf(*op) == &peer) affected.push_back(op);
  }
  // A peer leaving after every group with it closed is a normal exit.
  const bool matters = !affected.empty() || referencedByOpenGroup(peer);
  log(matters ? LogLevel::kWarn : LogLevel::kDebug, "peer ", peer.describe(), " failed: ", why);
  for (auto& op : affected) {
    const bool moving = op->phase == Op::Phase::kMoving;
    complete(op, Status::failure(StatusCode::kPeerFailure,
                                 concat(op->describe(), " failed: ", peer.failure)));
    if (moving) channelFor(*op).cancel(*op);
  }
  copyEngine_->peerFailed(peer);
}

void Engine::expireOps(Clock::time_point now) {
  std::vector<std::shared_ptr<Op>> expired;
  for (auto& [id, op] : live_) {
    if (!op->finished() && now >= op->deadline) expired.push_back(op);
  }
  std::vector<uint64_t> reported;
  for (auto& op : expired) {
    if (std::find(reported.begin(), reported.end(), op->groupId) == reported.end()) {
      reported.push_back(op->groupId);
      log(LogLevel::kWarn, "timeout in group '", op->config->name, "'; ",
          dumpPending(op->groupId));
    }
    expire(op, now);
  }
}

void Engine::expire(const std::shared_ptr<Op>& op, Clock::time_point now) {
  const int64_t age = millisSince(op->posted, now);
  const int64_t limit = millisSince(op->posted, op->deadline);
  const bool moving = op->phase == Op::Phase::kMoving;
  const std::string why = concat(
      op->describe(),
      moving ? " did not finish"
             : (op->isSend() ? " was not matched by a recv" : " was not matched by a send"),
      " within the group timeout of ", limit, " ms (posted ", age, " ms ago)");
  complete(op, Status::failure(StatusCode::kTimeout, why));
  if (moving) {
    channelFor(*op).cancel(*op);
  }
  // An announced send still holds a place in the receiver's line: tell it the send gave up.
  if (op->isSend() && !moving) {
    if (Peer* peer = partnerOf(*op); peer && !peer->failed) {
      sendControl(*peer, Cancellation{op->groupId, op->config->rank, op->request.tag, op->seq, 0,
                                      why});
    }
  }
}

void Engine::complete(const std::shared_ptr<Op>& op, const Status& status) {
  if (op->finished()) {
    return;
  }
  op->phase = Op::Phase::kDone;
  OpCallback callback = std::move(op->request.onComplete);
  op->request.onComplete = nullptr;
  if (callback) {
    try {
      callback(status, op->source);
    } catch (const std::exception& error) {
      log(LogLevel::kError, "completion callback of ", op->describe(), " threw: ", error.what());
    }
  }
  // No copy will signal a failed op or an empty one: no user stream stays parked (a send's
  // `copied`, never recorded then, holds no wait). After the callback, so a caller that sees
  // `queued` also sees the error.
  if (op->cuda && (!status.ok() || op->request.desc.bytes == 0)) {
    flags_->set(op->cuda->queued);
    if (!op->isSend()) flags_->set(op->cuda->done);
  }
  // A UCX op's waiter, if its copies never set `queued`, waits for the end on the CPU.
  if (op->ucxCuda) flags_->set(op->ucxCuda->queued);
  release(op);
}

void Engine::release(const std::shared_ptr<Op>& op) {
  if (!op->finished() || op->outstanding != 0 || op->released) {
    return;
  }
  op->released = true;
  op->request.keepalive.reset();
  if (op->promised) --commitments_;
  if (op->cuda) {
    // No copy can touch `done` any more; `ready` waits for its own stream. Events go with
    // the last holder (a work may still make a stream wait on `copied`).
    flags_->release(op->cuda->queued);
    if (!op->isSend()) {
      flags_->release(op->cuda->done);
      releaseOnceWritten(op->cuda->ready);
    }
    op->cuda->produced.reset();
    op->cuda->copied.reset();
    retireCuda();
  }
  if (op->ucxCuda) {
    flags_->release(op->ucxCuda->queued);
    if (const auto& staging = op->ucxCuda->staging) {
      if (op->isSend()) {
        releaseOnceWritten(staging->lastPiece());  // a failed send's copies may still run
      } else {
        flags_->release(staging->progress);
        flags_->release(staging->copiedIn);
      }
      staging->host.reset();
    }
    op->ucxCuda->reached.reset();
    op->ucxCuda->copied.reset();
  }
  if (op->streamReady) {
    releaseOnceWritten(*op->streamReady);
    retireCuda();
  }
  live_.erase(op->id);
}

void Engine::releaseOnceWritten(const cuda::Flag& ready) {
  // Its stream may still write it: reuse the word only after that write has landed.
  if (flags_->isSet(ready)) {
    flags_->release(ready);
  } else {
    unreachedReadyFlags_.push_back(ready);
  }
}

void Engine::recycleFlags() {
  auto unreached = std::partition(unreachedReadyFlags_.begin(), unreachedReadyFlags_.end(),
                                  [this](const cuda::Flag& flag) { return !flags_->isSet(flag); });
  for (auto it = unreached; it != unreachedReadyFlags_.end(); ++it) flags_->release(*it);
  unreachedReadyFlags_.erase(unreached, unreachedReadyFlags_.end());
}

void Engine::admitCuda(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(cudaInflightMutex_);
  if (!cudaInflightFreed_.wait_for(lock, timeout,
                                   [this] { return cudaInflight_ < config_.maxCudaOps; })) {
    fail(config_.maxCudaOps, " CUDA ops stayed in flight for ", timeout.count(),
         " ms (SMFREE_MAX_CUDA_OPS): are their partners posted?");
  }
  ++cudaInflight_;
}

void Engine::retireCuda() {
  {
    std::lock_guard<std::mutex> lock(cudaInflightMutex_);
    --cudaInflight_;
  }
  cudaInflightFreed_.notify_one();
}

void Engine::writeFromStream(const Op& op, const cuda::Flag& flag) {
  cuda::ContextGuard context(op.request.buffer.device);
  cuda::writeWord(static_cast<CUstream>(op.request.stream), flags_->cudaAddress(flag.index),
                  flag.value, "cuStreamWriteValue32 (ready)");
}

CudaFence Engine::prepareCuda(Op& op, std::chrono::milliseconds timeout) {
  admitCuda(timeout);
  CudaOpState state;
  state.queued = flags_->acquire();
  try {
    if (op.isSend()) {
      const int device = op.request.buffer.device;
      state.produced = cuda::takeEvent(device);
      state.copied = cuda::takeEvent(device);
      state.produced->record(static_cast<CUstream>(op.request.stream));
    } else {
      state.done = flags_->acquire(kDoneSpan);
      state.ready = flags_->acquire();
      writeFromStream(op, state.ready);
    }
  } catch (...) {
    flags_->release(state.queued);
    // A value of 0 is never handed out: those words were not acquired.
    if (state.done.value != 0) flags_->release(state.done);
    if (state.ready.value != 0) flags_->release(state.ready);
    retireCuda();
    throw;
  }
  op.cuda = state;
  return CudaFence{state.queued, state.done, state.copied, nullptr};
}

CudaFence Engine::prepareUcxCuda(Op& op, std::chrono::milliseconds timeout, bool staged) {
  static std::once_flag announced;
  std::call_once(announced, [this] {
    log(LogLevel::kInfo, "CUDA tensors to some ranks move over UCX (SMFREE_TRANSPORT=",
        config_.transport == Transport::kUcx ? "ucx" : "auto, ranks on other hosts", ")");
  });
  admitCuda(timeout);
  const cuda::Flag ready = flags_->acquire();
  std::optional<cuda::Flag> queued;
  try {
    writeFromStream(op, ready);
    const int device = op.request.buffer.device;
    auto reached = cuda::takeEvent(device);
    auto copied = cuda::takeEvent(device);
    reached->record(static_cast<CUstream>(op.request.stream));
    queued = flags_->acquire();
    op.ucxCuda = UcxCudaState{*queued, std::move(reached), std::move(copied), nullptr};
    if (staged) op.ucxCuda->staging = stageFromCaller(op);
  } catch (...) {
    flags_->release(ready);
    if (queued) flags_->release(*queued);
    op.ucxCuda.reset();
    retireCuda();
    throw;
  }
  op.streamReady = ready;
  CudaFence fence{op.ucxCuda->queued, {}, op.ucxCuda->copied, nullptr};
  if (!op.isSend()) fence.stagedRecv = op.ucxCuda->staging;
  return fence;
}

std::shared_ptr<CallerStaging> Engine::stageFromCaller(const Op& op) {
  const Buffer& buffer = op.request.buffer;
  auto staging = std::make_shared<CallerStaging>();
  staging->data = buffer.data;
  staging->bytes = buffer.bytes;
  staging->device = buffer.device;
  staging->pieceBytes = stagingPieceBytes(buffer.bytes, config_.hostStagingPieceBytes);
  staging->pieces =
      static_cast<uint32_t>(stagingPieceCount(buffer.bytes, staging->pieceBytes));
  staging->reached = op.ucxCuda->reached;
  staging->copied = op.ucxCuda->copied;
  staging->queued = op.ucxCuda->queued;
  HostStaging& host = ucxChannel_->staging();
  staging->host = host.take(buffer.device, buffer.bytes);
  staging->progress = flags_->acquire(staging->pieces);
  try {
    if (op.isSend()) {
      host.copyOutInPieces(*staging, *flags_);
    } else {
      staging->copiedIn = flags_->acquire();
    }
  } catch (...) {
    flags_->release(staging->progress);
    throw;
  }
  return staging;
}

bool Engine::queueCopiesInOnceMatched(CallerStaging& staging) {
  if (flags_->isSet(staging.queued)) return true;  // queued, or the recv failed
  // Matched with a promised send, the copies wait on the GPU for bytes whose copies out are
  // already queued on the sender's GPU, and which no thread that could stall has to move.
  // Otherwise they are queued only once the bytes are here: a stream must wait for nothing
  // else.
  const int matched = staging.matched.load(std::memory_order_acquire);
  const bool mayQueue =
      matched == CallerStaging::kMatchedPromised ||
      (matched == CallerStaging::kMatchedUnpromised && flags_->isSet(staging.lastPiece()));
  if (!mayQueue) return false;
  int state = CallerStaging::kCopiesInOpen;
  if (!staging.copiesIn.compare_exchange_strong(state, CallerStaging::kCopiesInByCaller)) {
    return false;  // another thread queues them, or the recv failed: `queued` follows
  }
  try {
    ucxChannel_->staging().copyInAsPiecesLand(staging, *flags_);
  } catch (...) {
    flags_->set(staging.copiedIn);  // the progress thread must not wait for it
    flags_->set(staging.queued);
    throw;
  }
  flags_->set(staging.queued);
  worker_->signal();  // the progress thread watches `copiedIn` from now on
  return true;
}

bool Engine::queueCopiesInBy(CallerStaging& staging, Clock::time_point deadline) {
  return pollUntil([&] { return queueCopiesInOnceMatched(staging); }, config_.spin, deadline);
}

void Engine::awaitQueued(const cuda::Flag& queued, Clock::time_point deadline) {
  // Short: the partner has usually posted already. The op's own timeout sets `queued`
  // before `deadline` comes.
  if (!pollUntil([&] { return flags_->isSet(queued); }, config_.spin, deadline)) {
    fail("the partner's copy was not submitted before the deadline");
  }
}

void Engine::waitOnStream(void* stream, int device, const CudaFence& fence) {
  if (fence.copied) {
    fence.copied->waitOn(static_cast<CUstream>(stream));
    return;
  }
  cuda::ContextGuard context(device);
  // The flag says a peer's copy engine finished writing our memory over NVLink.
  cuda::waitForRemoteWrites(static_cast<CUstream>(stream), device,
                            flags_->cudaAddress(fence.done.index), fence.done.value,
                            "cuStreamWaitValue32 (done)");
}

void Engine::sendControl(Peer& peer, const ControlMessage& message) {
  if (peer.failed) {
    return;
  }
  const std::string key = peer.address.processKey;
  control_->send(*peer.endpoint, encode(message), [this, key](ucs_status_t status) {
    onPeerFailure(key, concat("a control message failed: ", ucxStatusText(status)));
  });
}

GroupState* Engine::findGroup(uint64_t groupId) {
  auto it = groups_.find(groupId);
  return it == groups_.end() ? nullptr : &it->second;
}

std::shared_ptr<Op> Engine::findLive(uint64_t opId) {
  auto it = live_.find(opId);
  return it == live_.end() ? nullptr : it->second;
}

Peer* Engine::partnerOf(const Op& op) {
  GroupState* group = findGroup(op.groupId);
  const int rank = op.partner();
  if (!group || rank < 0 || rank >= static_cast<int>(group->peers.size())) {
    return nullptr;
  }
  return group->peers[rank];
}

Channel& Engine::channelFor(const Op& op) {
  if (channelKindOf(op) == ChannelKind::kCopyEngine) return *copyEngine_;
  return *ucxChannel_;
}

}  // namespace smfree::engine
