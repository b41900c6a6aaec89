#include "engine/Engine.h"

#include <poll.h>
#include <sys/prctl.h>

#include <algorithm>
#include <sstream>

#include "engine/Channel.h"
#include "engine/Error.h"
#include "engine/Group.h"
#include "engine/Log.h"
#include "engine/channels/copy_engine/CopyEngineChannel.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/cuda/CudaDriver.h"
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

std::string crossHostCuda(const Op& op, const Peer& peer) {
  return concat(op.describe(), " failed: rank ", op.partner(), " (", peer.describe(),
                ") is on another host, out of reach of the copy engines "
                "(SMFREE_TRANSPORT=copy_engine); use auto or ucx");
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
      cudaOps_(std::make_unique<CudaOps>(config_.maxCudaOps)) {
  const auto onDone = [this](const std::shared_ptr<Op>& op, const Status& status) {
    onTransferDone(op, status);
  };
  auto ucxChannel = std::make_unique<UcxChannel>(*ucx_, *worker_, *cudaOps_, config_, onDone);
  local_ = PeerAddress::local(worker_->address(), ucxChannel->receiveAddress(),
                              cudaOps_->flags().path());
  control_ = std::make_unique<UcxControl>(
      *worker_, [this](const void* data, size_t length) { onControlMessage(data, length); });
  channels_[1] = std::move(ucxChannel);
  channels_[0] = std::make_unique<CopyEngineChannel>(
      *cudaOps_, config_.ipcCacheSize, config_.stagingBytes, onDone,
      [this](Peer& peer, std::string data) {
        sendControl(peer, ChannelNotice{local_.processKey, std::move(data)});
      },
      [this](const std::string& key, std::vector<uint64_t> ids) {
        auto it = peers_.find(key);
        if (it != peers_.end() && !it->second->failed) {
          sendControl(*it->second, MemoryReleased{local_.processKey, std::move(ids)});
        }
      });
  progress_ = std::thread([this] { run(); });
  log(LogLevel::kInfo, "engine started on host ", local_.hostname);
  if (!config_.spinNote.empty()) log(LogLevel::kInfo, config_.spinNote);
}

Engine::~Engine() {
  stopProgressThread();
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
  // UCX first, as before the copy engines; its receive lane stops after its endpoints'
  // flushes, which peers' sends may wait on.
  channels_[1].reset();
  channels_[0].reset();
  control_.reset();
}

void Engine::stop() {
  stopProgressThread();
  for (auto& channel : channels_) channel->stop();
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
  call<void>([this, shared] { registerGroup(shared); }, timeout, "registering the group");
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
    if (!heldOps_.empty() && !committed()) startHeldOps();
    bool active = false;
    for (auto& channel : channels_) {
      active = channel->progress() || active;
      if (const int device = channel->contextDevice(); device >= 0) ucxContext.use(device);
    }
    while (worker_->progress() != 0) {
      active = true;
    }
    const auto now = Clock::now();
    if (active) {
      lastActivity = now;
    }
    if (now - lastScan >= kExpiryScanInterval) {
      checkPeers();
      cudaOps_->recycle();
      expireOps(now);
      lastScan = now;
    }
    if (now - lastSweep >= kExportSweepInterval) {
      for (auto& channel : channels_) channel->sweep();
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
  const bool watching = std::any_of(channels_.begin(), channels_.end(),
                                   [](const auto& channel) { return channel->busy(); });
  const timespec& timeout = watching ? kMemoryWatchNap : kIdleSleep;
  if (ppoll(events.data(), events.size(), &timeout, nullptr) > 0 && events.size() > 1) {
    checkPeers();
  }
}

void Engine::onMemoryReleased(const MemoryReleased& message) {
  channel(ChannelKind::kCopyEngine).onMemoryReleased(message.owner, message.ids);
}

void Engine::onChannelNotice(const ChannelNotice& message) {
  auto it = peers_.find(message.sender);
  // A failed peer's notices are void: its channel state is gone.
  if (it != peers_.end() && !it->second->failed) {
    channel(ChannelKind::kCopyEngine).onNotice(*it->second, message.data);
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
      for (auto& channel : channels_) channel->disconnect(*peer);
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
    return channel(ChannelKind::kUcx).route(*existing->second).stagedThroughHost;
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
  return channel(ChannelKind::kUcx).route(peer).stagedThroughHost;
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
  const auto onError = [this, key](const std::string& why) { onPeerFailure(key, why); };
  try {
    // Same host: shared memory and CMA need UCX's peer-failure handling off; the watch
    // notices a dead peer instead.
    peer->endpoint = std::make_unique<UcxEndpoint>(
        worker_->handle(), address.workerAddress, !peer->sameHost,
        [onError](ucs_status_t status) { onError(concat("UCX reported ", ucxStatusText(status))); });
    for (auto& channel : channels_) channel->connect(*peer, onError);
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
    if (!op->finished() && channelFor(*op).outlivesWait(*op)) ++count;
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
    if (const std::string wait = channelFor(*op).describeWait(*op); !wait.empty()) {
      out << " [flags " << wait << "]";
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
  std::map<std::string, int64_t> stats{
      {"live_ops", static_cast<int64_t>(live_.size())},
      {"flag_words_in_use", static_cast<int64_t>(cudaOps_->flags().inUse())}};
  for (const auto& channel : channels_) channel->addStats(stats);
  return stats;
}

bool Engine::committed() const {
  return std::any_of(channels_.begin(), channels_.end(),
                     [](const auto& channel) { return channel->committed(); });
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
  if (channelFor(*op).callsCudaOnProgressThread(*op)) {
    for (auto& channel : channels_) channel->progressThreadCallsCuda(*op);
    // Its CUDA calls could stall this thread while a peer's stream waits for bytes it moves.
    if (committed()) {
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
    if (!channelFor(*op).reaches(*peer)) {
      complete(op, Status::failure(StatusCode::kTransport, crossHostCuda(*op, *peer)));
      return;
    }
    if (op->isSend()) {
      op->seq = group->sendSeq[{op->request.peer, op->request.tag}]++;
      const bool promised = channelFor(*op).promiseSend(*op);
      // Announced first: preparing may take a while (pinned memory allocated), and the
      // receiver can match meanwhile.
      sendControl(*peer, ReadyToSend{op->groupId, group->config->rank, op->request.tag, op->seq,
                                     op->id, op->request.desc, op->channel, promised});
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
  if (!channelFor(*recv).reaches(*sender) && rts.desc.compatibleWith(recv->request.desc)) {
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
  if (rts.desc.bytes != 0 && rts.channel != recv->channel) {
    const std::string why =
        concat("channel mismatch in group '", group.config->name, "', tag ", rts.tag, ": rank ",
               rts.source, " sends ", rts.desc.describe(), " over ", channelName(rts.channel),
               ", rank ", group.config->rank, " receives into ", recv->request.desc.describe(),
               " over ", channelName(recv->channel),
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
  channelFor(*recv).cleared(recv, rts.promised);
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
  for (auto& channel : channels_) channel->peerFailed(peer);
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
  // After the callback, so a caller whose stream wait the channel releases sees the error.
  channelFor(*op).ended(*op, status);
  release(op);
}

void Engine::release(const std::shared_ptr<Op>& op) {
  if (!op->finished() || op->outstanding != 0 || op->released) {
    return;
  }
  op->released = true;
  op->request.keepalive.reset();
  channelFor(*op).release(*op);
  live_.erase(op->id);
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

}  // namespace smfree::engine
