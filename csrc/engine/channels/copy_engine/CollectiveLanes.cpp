#include "engine/channels/copy_engine/CollectiveLanes.h"

#include <cstring>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/PeerAddress.h"
#include "engine/channels/copy_engine/DoneWord.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

CollectiveLanes::CollectiveLanes(cuda::FlagSegment& flags, std::string localKey,
                                 size_t ipcCacheSize, PeerWords peerWords)
    : flags_(flags),
      localKey_(std::move(localKey)),
      lines_(flags.tail()),
      peerWords_(std::move(peerWords)),
      ipc_(ipcCacheSize) {}

CollectiveLanes::Peer& CollectiveLanes::peerFor(const PostOptions& options) {
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& peer = peers_[options.peerKey];
  if (!peer.words) {
    peer.watch = std::make_unique<ProcessWatch>(options.peer->pid);
    peer.words = &peerWords_(options.peerKey, *options.peer, peer.watch->fd());
  }
  return peer;
}

std::unique_ptr<CollectivePiece> CollectiveLanes::post(const Op& op, const PostOptions& options,
                                                       const PieceWords& words) {
  Peer& peer = peerFor(options);
  auto piece = std::make_unique<CollectivePiece>();
  piece->sender = op.isSend();
  piece->peerKey = options.peerKey;
  piece->peerWords = peer.words;
  piece->device = op.request.buffer.device;
  // The line lives in the receiver's file: both sides find it there.
  const CollectiveLines theirs(peer.words->tail());
  CollectiveRecord* line = piece->sender ? theirs.line(op.groupId, localKey_)
                                         : lines_.line(op.groupId, options.peerKey);
  if (!line) {
    logOnce("collective-lines",
            "every collective lane into a process is taken: collective pieces of "
            "further (group, sending process) pairs go by rendezvous, their wait() waiting "
            "for the peer");
    byRendezvous_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  piece->record = line + op.seq % kCollectiveRecords;
  piece->use = static_cast<uint32_t>(op.seq / kCollectiveRecords);
  CollectiveRecord& record = *piece->record;
  const bool publishable =
      writeHalf(piece->sender ? record.sender : record.receiver, op, words, options.peerKey);
  std::optional<CollectiveHalf> first;
  void* mapped = nullptr;
  const CollectiveSecond second{
      [&](const CollectiveHalf& theirs) {
        // Sizes or dtypes that differ go by rendezvous, whose match fails both sides.
        if (theirs.bytes != op.request.buffer.bytes ||
            std::strncmp(theirs.dtype, op.request.desc.dtype.c_str(), kCollectiveDtypeBytes) != 0) {
          return false;
        }
        try {
          mapped = map(*piece, theirs, peer.watch->fd());
        } catch (const Error& error) {  // the record stays theirs
          fail(op.describe(), ": cannot map its partner's buffer: ", reasonOf(error));
        }
        first = theirs;
        return true;
      },
      [&] { finished(*piece); }};
  piece->role = decideCollective(record, piece->use, piece->sender, publishable, second);
  switch (piece->role) {
    case CollectiveRole::kRendezvous:
      byRendezvous_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    case CollectiveRole::kFirst:
      firsts_.fetch_add(1, std::memory_order_relaxed);
      return piece;
    case CollectiveRole::kSecond:
      piece->theirSignal = first->signal;
      queueCopy(op, *piece, *first, mapped, words);
      seconds_.fetch_add(1, std::memory_order_relaxed);
      return piece;
  }
  return nullptr;
}

bool CollectiveLanes::writeHalf(CollectiveHalf& half, const Op& op, const PieceWords& words,
                                const std::string& peerKey) {
  const Buffer& buffer = op.request.buffer;
  std::string exported;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    exporter_.exportBuffer(buffer.data, buffer.bytes, buffer.device, peerKey).appendTo(exported);
  }
  const std::string& dtype = op.request.desc.dtype;
  if (exported.size() > kCollectiveExportBytes) {
    logOnce("collective-export", concat("a collective piece's buffer spans more memory chunks than "
                                        "a collective lane's record holds (",
                                        exported.size(), " B of ", kCollectiveExportBytes,
                                        "): such pieces go by rendezvous"));
    return false;
  }
  if (dtype.size() >= kCollectiveDtypeBytes) {
    logOnce("collective-dtype", concat("dtype ", dtype, " has a longer name than a collective "
                                       "lane's record holds: its pieces go by rendezvous"));
    return false;
  }
  half.bytes = buffer.bytes;
  half.device = buffer.device;
  half.exportBytes = static_cast<uint32_t>(exported.size());
  half.signal = words.signal;
  half.done = words.done;
  std::memset(half.dtype, 0, kCollectiveDtypeBytes);
  std::memcpy(half.dtype, dtype.data(), dtype.size());
  std::memcpy(half.exported, exported.data(), exported.size());
  return true;
}

void* CollectiveLanes::map(CollectivePiece& piece, const CollectiveHalf& theirs, int ownerPidfd) {
  cuda::IpcExport exported = cuda::IpcExport::read(theirs.exported, theirs.exportBytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* address = ipc_.acquire(piece.peerKey, ownerPidfd, exported, piece.device, theirs.bytes);
  piece.mapped = std::move(exported);
  return address;
}

void CollectiveLanes::finished(CollectivePiece& piece) {
  if (!piece.mapped) return;
  std::lock_guard<std::mutex> lock(mutex_);
  ipc_.done(piece.peerKey, *piece.mapped, piece.device);
  piece.mapped.reset();
}

void CollectiveLanes::queueCopy(const Op& op, CollectivePiece& piece, const CollectiveHalf& theirs,
                                void* mapped, const PieceWords& words) {
  const Buffer& buffer = op.request.buffer;
  cuda::RemoteFlagSegment& peerWords = *piece.peerWords;
  try {
    cuda::ContextGuard context(buffer.device);
    const CUstream copyStream = stream(buffer.device, theirs.device, piece.sender);
    words.posted->waitOn(copyStream);
    if (!peerWords.isSet(theirs.signal)) {
      cuda::waitAtLeast(copyStream, peerWords.cudaAddress(theirs.signal.index), theirs.signal.value,
                        "cuStreamWaitValue32 (collective lane, peer's post)");
    }
    const cuda::Place local = cuda::Place::of(buffer.data, buffer.device);
    const cuda::Place remote = cuda::Place::of(mapped, theirs.device);
    cuda::queueCopy(copyStream, buffer.device, piece.sender ? remote : local,
                    piece.sender ? local : remote, buffer.bytes,
                    piece.sender ? "cuMemcpyAsync (collective lane, push)"
                                 : "cuMemcpyAsync (collective lane, pull)");
    cuda::writeWord(copyStream, flags_.cudaAddress(words.done.index), words.done.value + kCopied,
                    "cuStreamWriteValue32 (done)");
    cuda::writeWord(copyStream, peerWords.cudaAddress(theirs.done.index),
                    theirs.done.value + kCopied, "cuStreamWriteValue32 (peer's done)");
  } catch (const Error& error) {
    // The first side's stream waits for this copy: it fails instead.
    peerWords.set(theirs.done.plus(kSenderGaveUp));
    finished(piece);
    fail(op.describe(), " could not queue its copy in a collective lane: ", reasonOf(error));
  }
}

CUstream CollectiveLanes::stream(int localDevice, int peerDevice, bool push) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& stream = streams_[{localDevice, peerDevice, push}];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(localDevice, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "collective-lane stream for cuda:", localDevice,
        push ? " pushing to peer cuda:" : " pulling from peer cuda:", peerDevice);
  }
  return stream->handle();
}

std::map<std::string, std::vector<uint64_t>> CollectiveLanes::sweep() {
  std::lock_guard<std::mutex> lock(mutex_);
  return exporter_.sweep();
}

void CollectiveLanes::forget(const std::string& owner, const std::vector<uint64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  ipc_.forget(owner, ids);
}

void CollectiveLanes::dropPeer(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  ipc_.dropPeer(key);
  gone_.insert(key);
}

bool CollectiveLanes::gone(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return gone_.count(key) != 0;
}

void CollectiveLanes::addStats(std::map<std::string, int64_t>& stats) const {
  stats["collective_first"] = static_cast<int64_t>(firsts_.load(std::memory_order_relaxed));
  stats["collective_second"] = static_cast<int64_t>(seconds_.load(std::memory_order_relaxed));
  stats["collective_by_rendezvous"] =
      static_cast<int64_t>(byRendezvous_.load(std::memory_order_relaxed));
  std::lock_guard<std::mutex> lock(mutex_);
  stats["collective_ipc_mappings"] = static_cast<int64_t>(ipc_.size());
}

}  // namespace smfree::engine
