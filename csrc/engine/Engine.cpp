#include "engine/Engine.h"

#include "engine/Error.h"
#include "engine/Group.h"
#include "engine/Log.h"
#include "engine/channels/captured/CapturedChannel.h"
#include "engine/channels/copy_engine/CopyEngineChannel.h"
#include "engine/channels/loopback/LoopbackChannel.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/transports/ucx/UcxContext.h"
#include "engine/transports/ucx/UcxControl.h"
#include "engine/transports/ucx/UcxReport.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {
namespace {

std::mutex processEngineMutex;
std::weak_ptr<Engine> processEngine;

}  // namespace

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
    // and a recv's copies in still read the host memory. One bound for the whole exit.
    const Clock::time_point deadline = engine->exitDeadline();
    try {
      engine->awaitReleasedOps(std::nullopt, deadline);
    } catch (const Error& error) {
      log(LogLevel::kWarn, "at exit: ", error.what());
    }
    engine->stop(deadline);
  }
}

Engine::Engine(Private)
    : config_(Config::fromEnv()),
      spin_(config_, Spin::cpusOfProcess()),
      ucx_(std::make_unique<UcxContext>(config_)),
      worker_(std::make_unique<UcxWorker>(*ucx_, UcxWorker::Threads::kSingle)),
      cudaOps_(std::make_unique<CudaOps>(config_.maxCudaOps)) {
  cuda::setLocalCopies(config_.localCopies);
  log(LogLevel::kInfo, "copies within one GPU: ", cuda::describe(config_.localCopies));
  const Channel::Done onDone = [this](const std::shared_ptr<Op>& op, const Status& status) {
    opControl_->onTransferDone(op, status);
  };
  // UCX's admission hook holds ops back and starts them again here (Channel::admit).
  auto ucx = std::make_unique<UcxChannel>(
      *ucx_, *worker_, *cudaOps_, thread_, config_, spin_, onDone,
      [this](const std::shared_ptr<Op>& op) { opControl_->startOp(op); });
  local_ = PeerAddress::local(worker_->address(), ucx->receiveAddress(),
                              cudaOps_->flags().ref());
  auto copyEngine = std::make_unique<CopyEngineChannel>(
      *cudaOps_, thread_, local_.processKey, config_.ipcCacheSize, config_.stagingBytes,
      config_.eagerBytes,
      config_.ringMemoryBytes, config_.collectiveLanes, onDone,
      [this](Peer& peer, std::string data) {
        peers_->send(peer, ChannelNotice{local_.processKey, ChannelKind::kCopyEngine,
                                          std::move(data)});
      },
      [this](const std::string& key, std::vector<uint64_t> ids) {
        sendToLive(key, MemoryReleased{local_.processKey, std::move(ids)});
      });
  auto captured = std::make_unique<CapturedChannel>(
      *cudaOps_, thread_, failures_, onDone, [this](const std::string& key, std::string data) {
        sendToLive(key, ChannelNotice{local_.processKey, ChannelKind::kCaptured, std::move(data)});
      });
  channels_ = std::make_unique<Channels>(std::move(copyEngine), std::move(captured),
                                         std::move(ucx),
                                         std::make_unique<LoopbackChannel>(*cudaOps_, onDone));
  control_ = std::make_unique<UcxControl>(
      *worker_, [this](const void* data, size_t length) { onControlMessage(data, length); });
  peers_ = std::make_unique<PeerTable>(
      local_, *worker_, *control_, *channels_, failures_, thread_,
      PeerTable::Silence{config_.peerCheck, ucxCutLinkUnnoticed(config_.linkTimeout)},
      [this](Peer& peer, const std::string& why) { onPeerFailure(peer, why); });
  opControl_ = std::make_unique<OpControl>(*channels_, *peers_, failures_, thread_);
  loop_ = std::make_unique<ProgressLoop>(spin_, *control_, *channels_, *peers_,
                                         *opControl_, *cudaOps_, thread_);
  log(LogLevel::kInfo, "engine started on host ", local_.hostname);
}

Engine::~Engine() {
  loop_->stop();
  flushPeers(exitDeadline());
  // The progress thread is gone: finish what is left from here, held ops too.
  opControl_->shutDown();
  peers_->clear();
  channels_->reset();
  control_.reset();
}

void Engine::stop(Clock::time_point deadline) {
  loop_->stop();
  flushPeers(deadline);
  channels_->forEach([](Channel& channel) { channel.stop(); });
}

Clock::time_point Engine::exitDeadline() const { return Clock::now() + config_.exitTimeout; }

void Engine::flushPeers(Clock::time_point deadline) {
  peers_->flush(deadline);
  channels_->forEach([deadline](Channel& channel) { channel.flush(deadline); });
}

std::shared_ptr<Group> Engine::joinGroup(GroupConfig config, std::shared_ptr<KeyValueStore> store,
                                         std::chrono::milliseconds timeout) {
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
    fail("invalid group '", config.name, "': rank ", config.rank, " of size ", config.size);
  }
  auto shared = std::make_shared<const GroupConfig>(std::move(config));
  // Registered before it is published: a peer that reads the address may send at once, and
  // until then this engine drops messages for the name's previous group, closed but still known.
  loop_->call<void>(
      [this, shared] { opControl_->registerGroup(shared); },
      timeout, "registering the group");
  auto group = std::make_shared<Group>(shared_from_this(), shared, store, timeout);
  store->set(addressKey(shared->rank), local_.encode());  // on failure, ~Group closes it
  return group;
}

PeerRoute Engine::connect(uint64_t groupId, int rank, const PeerAddress& address,
                          std::chrono::milliseconds timeout) {
  return loop_->call<PeerRoute>([this, groupId, rank, address] {
    return attachPeer(groupId, rank, address);
  }, timeout, "connecting to a peer");
}

void Engine::post(std::shared_ptr<Op> op) {
  loop_->submit([this, op = std::move(op)] { opControl_->startOp(op); });
}

void Engine::awaitReleasedOps(std::optional<uint64_t> groupId, Clock::time_point deadline) {
  size_t left = 0;
  while (true) {
    left = loop_->call<size_t>(
        [this, groupId] { return opControl_->releasedOpsInFlight(groupId); },
        std::chrono::seconds(10), "counting ops in flight");
    if (left == 0 || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (left != 0) {
    log(LogLevel::kWarn, left, " ops whose wait() had returned were still moving bytes when ",
        groupId ? "their group closed" : "the process exited",
        " and SMFREE_EXIT_TIMEOUT_MS had passed; they fail");
  }
}

void Engine::closeGroup(uint64_t groupId, StatusCode code, const std::string& reason) {
  loop_->call<void>([this, groupId, code, reason] {
    opControl_->closeGroup(groupId, code, reason);
  }, std::chrono::seconds(60), "closing the group");
}

std::string Engine::dumpPending(uint64_t groupId) {
  return loop_->call<std::string>([this, groupId] { return opControl_->dumpPending(groupId); },
                                  std::chrono::seconds(10), "dumping pending ops");
}

std::map<std::string, int64_t> Engine::stats() {
  return loop_->call<std::map<std::string, int64_t>>([this] {
    std::map<std::string, int64_t> stats{
        {"live_ops", static_cast<int64_t>(opControl_->liveOps())},
        {"flag_words_in_use", static_cast<int64_t>(cudaOps_->flags().inUse())}};
    ChannelReport report;
    channels_->forEach([&](Channel& channel) { channel.report(report); });
    stats.insert(report.stats.begin(), report.stats.end());
    return stats;
  }, std::chrono::seconds(10), "reading stats");
}

PeerRoute Engine::attachPeer(uint64_t groupId, int rank, const PeerAddress& address) {
  thread_.check("Engine::attachPeer");
  GroupState* group = opControl_->findGroup(groupId);
  if (!group || group->closed) {
    fail("group is closed");
  }
  const PeerTable::Attached attached = peers_->attach(address);
  group->peers[rank] = attached.peer;
  if (attached.peer->sameHost) spin_.onRanksOnHost(peers_->liveSameHostPeers() + 1);
  if (!attached.peer->sameHost && config_.linkTimeout.count() > 0 && !ucxHasTcpUserTimeout()) {
    logOnce("ucx-no-tcp-user-timeout",
            concat("UCX ", ucp_get_version_string(), " has no TCP user timeout: a link to ",
                   attached.peer->describe(), " cut during a transfer fails its ops at the "
                   "group timeout, not after SMFREE_LINK_TIMEOUT_MS (the libucx-cu13 wheel's "
                   "UCX has it)"),
            LogLevel::kWarn);
  }
  if (attached.unreachable) {
    // Its ops are refused, and recvs from any source pass it over, as with a peer that failed
    // later. Its engine is gone for good: a new one would publish a new process key.
    peers_->fail(address.processKey, *attached.unreachable);
    return {};
  }
  return attached.peer->route;
}

void Engine::onControlMessage(const void* data, size_t length) {
  const ControlMessage decoded = decode(data, length);
  Peer* sender = senderOf(decoded);
  if (sender) peers_->heard(*sender);
  std::visit(
      [this, sender](const auto& message) {
        using T = std::decay_t<decltype(message)>;
        if constexpr (std::is_same_v<T, ReadyToSend>) opControl_->onReadyToSend(message);
        if constexpr (std::is_same_v<T, ClearToSend>) opControl_->onClearToSend(message);
        if constexpr (std::is_same_v<T, Refusal>) opControl_->onRefusal(message);
        if constexpr (std::is_same_v<T, Cancellation>) opControl_->onCancellation(message);
        if constexpr (std::is_same_v<T, MemoryReleased>) {
          channels_->notify(ChannelKind::kCopyEngine, MemoryFreed{message.owner, message.ids});
        }
        if constexpr (std::is_same_v<T, ChannelNotice>) {
          // A failed peer's notices are void: its channel state is gone.
          if (sender && !sender->failed) {
            try {
              channels_->notify(message.channel, PeerNotice{*sender, message.data});
            } catch (const BadPeerValue& error) {
              opControl_->badValueFrom(*sender, error);
            }
          }
        }
        if constexpr (std::is_same_v<T, Probe>) {
          if (sender && !message.answer) {
            peers_->send(*sender, Probe{local_.processKey, true});
          }
        }
      },
      decoded);
}

Peer* Engine::senderOf(const ControlMessage& message) {
  return std::visit(
      [this](const auto& m) -> Peer* {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, MemoryReleased>) {
          return peers_->find(m.owner);
        } else if constexpr (std::is_same_v<T, ChannelNotice> || std::is_same_v<T, Probe>) {
          return peers_->find(m.sender);
        } else if constexpr (std::is_same_v<T, ClearToSend> || std::is_same_v<T, Refusal>) {
          return opControl_->peerOf(m.group, m.receiver);
        } else {
          return opControl_->peerOf(m.group, m.source);
        }
      },
      message);
}

void Engine::sendToLive(const std::string& key, const ControlMessage& message) {
  Peer* peer = peers_->find(key);
  if (peer && !peer->failed) peers_->send(*peer, message);
}

void Engine::onPeerFailure(Peer& peer, const std::string& why) {
  opControl_->peerFailed(peer, why);
  channels_->forEach([&](Channel& channel) { channel.peerFailed(peer); });
}

}  // namespace smfree::engine
