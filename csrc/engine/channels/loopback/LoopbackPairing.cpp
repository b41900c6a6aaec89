#include "engine/channels/loopback/LoopbackPairing.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "engine/Error.h"
#include "engine/GroupConfig.h"
#include "engine/cuda/Capture.h"
#include "engine/cuda/Copies.h"

namespace smfree::engine {
namespace {

// An event recorded in a capturing stream may not be queried, as the pool does with the events
// given back to it (cuEventQuery refuses it): a captured op's events are its own.
std::shared_ptr<cuda::Event> eventFor(const LoopbackOp& half, int device) {
  return half.capture ? std::make_shared<cuda::Event>(device) : cuda::takeEvent(device);
}

}  // namespace

std::shared_ptr<LoopbackOp> LoopbackPairing::post(Op& op, std::chrono::milliseconds timeout) {
  auto half = std::make_shared<LoopbackOp>();
  // Not later than the op's own deadline, which Group sets once this returns.
  half->deadline = Clock::now() + timeout;
  half->op = op.shared_from_this();
  half->keepalive = op.request.keepalive;
  if (op.request.capture) half->capture = op.request.capture->id;
  if (op.request.buffer.memory == MemoryKind::kCuda) {
    // The stream as it is now: if the op is paired later, its copy waits for this much of it.
    // Recorded before the lock, which the progress thread takes: no CUDA call under it.
    half->posted = eventFor(*half, op.request.buffer.device);
    half->posted->record(static_cast<CUstream>(op.request.stream));
  }
  std::shared_ptr<LoopbackOp> earlier;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    earlier = pairOrQueue(half);
    ops_.emplace(op.id, half);
  }
  if (earlier) {
    exchange(op.isSend() ? *half : *earlier, op.isSend() ? *earlier : *half, *earlier, *half);
  }
  return half;
}

std::shared_ptr<LoopbackOp> LoopbackPairing::pairOrQueue(
    const std::shared_ptr<LoopbackOp>& half) {
  const Op& op = *half->op;
  Lines& opposite = op.isSend() ? recvs_ : sends_;
  dropExpired(opposite, lineOf(op));
  if (auto it = opposite.find(lineOf(op)); it != opposite.end()) {
    std::shared_ptr<LoopbackOp> earlier = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) opposite.erase(it);
    const std::shared_ptr<LoopbackOp>& send = op.isSend() ? half : earlier;
    const std::shared_ptr<LoopbackOp>& recv = op.isSend() ? earlier : half;
    auto pair = std::make_shared<LoopbackPair>();
    pair->send = send;
    pair->recv = recv;
    pair->sendMemory = send->keepalive;
    pair->recvMemory = recv->keepalive;
    earlier->pair = pair;
    half->pair = pair;
    return earlier;
  }
  (op.isSend() ? sends_ : recvs_)[lineOf(op)].push_back(half);
  return nullptr;
}

void LoopbackPairing::dropExpired(Lines& lines, const Line& line) {
  auto it = lines.find(line);
  if (it == lines.end()) return;
  const Clock::time_point now = Clock::now();
  std::deque<std::shared_ptr<LoopbackOp>>& queue = it->second;
  while (!queue.empty() && queue.front()->deadline <= now) queue.pop_front();
  if (queue.empty()) lines.erase(it);
}

void LoopbackPairing::exchange(LoopbackOp& send, LoopbackOp& recv, const LoopbackOp& earlier,
                               const LoopbackOp& later) {
  const std::shared_ptr<LoopbackPair> pair = send.pair;
  std::optional<Status> outcome;
  if (!send.op->request.desc.compatibleWith(recv.op->request.desc)) {
    outcome = Status::failure(StatusCode::kMismatch, mismatch(*send.op, *recv.op));
  } else if (send.capture != recv.capture) {
    outcome = Status::failure(StatusCode::kMismatch, captureMismatch(send, recv));
  } else {
    try {
      outcome = copy(send, recv, earlier, later);
    } catch (const Error& error) {
      if (pair->done) cudaOps_.flags().release(*pair->done);  // no stream will write it
      outcome = Status::failure(
          StatusCode::kChannel,
          concat(send.op->describe(), ": the copy failed: ", reasonOf(error)));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (outcome) {
      pair->outcome = std::move(outcome);
      settled_.push_back(pair);
    } else {
      inFlight_.push_back(pair);
    }
    pendingCount_.store(inFlight_.size() + settled_.size(), std::memory_order_relaxed);
    pair->exchanged = true;
    // The earlier op may have ended meanwhile (timed out, its group closed).
    forgetOnceDone(send);
    forgetOnceDone(recv);
  }
  send.queued.store(true, std::memory_order_release);
  recv.queued.store(true, std::memory_order_release);
}

std::optional<Status> LoopbackPairing::copy(LoopbackOp& sendOp, LoopbackOp& recvOp,
                                            const LoopbackOp& earlier, const LoopbackOp& later) {
  LoopbackPair& pair = *sendOp.pair;
  const OpRequest& send = sendOp.op->request;
  const OpRequest& recv = recvOp.op->request;
  const uint64_t bytes = send.desc.bytes;
  if (bytes == 0) return Status::success();
  if (send.buffer.memory == MemoryKind::kHost) {
    std::memmove(recv.buffer.data, send.buffer.data, bytes);
    return Status::success();
  }
  // Raw bytes, like any other peer's transfer, on the later op's stream after the earlier op's.
  const Op& on = *later.op;
  const auto stream = static_cast<CUstream>(on.request.stream);
  const int device = on.request.buffer.device;
  // Taken before anything is queued: where no word is left, no copy is queued either.
  if (!later.capture) pair.done = cudaOps_.flags().acquire();
  earlier.posted->waitOn(stream);
  const cuda::Place to{reinterpret_cast<CUdeviceptr>(recv.buffer.data), device};
  const cuda::Place from{reinterpret_cast<CUdeviceptr>(send.buffer.data), device};
  constexpr const char* kWhat = "cuMemcpyAsync (to the rank itself)";
  if (later.capture) {
    // The graph's replays pass through its bounce, if any: the graph keeps it.
    std::unique_ptr<cuda::BounceLease> bounce;
    cuda::queueCopyThrough(stream, device, to, from, bytes, bounce, kWhat);
    if (bounce) cuda::keepWithGraph(cuda::captureOf(stream)->graph, std::move(bounce));
  } else {
    cuda::queueCopy(stream, device, to, from, bytes, kWhat);
  }
  std::shared_ptr<cuda::Event> copied = eventFor(later, device);
  copied->record(stream);
  sendOp.copied = copied;
  recvOp.copied = copied;
  // A captured copy is a node of the graph: nothing runs until the graph does, and the ops'
  // wait() makes the stream wait for `copied`, an event of the same capture.
  if (later.capture) return Status::success();
  cudaOps_.writeFromStream(on, *pair.done);
  return std::nullopt;
}

std::string LoopbackPairing::mismatch(const Op& send, const Op& recv) {
  // The wording for other peers' ops (OpControl).
  const TensorDesc& sent = send.request.desc;
  const char* what = sent.device != recv.request.desc.device ? "device" : "size or dtype";
  const GroupConfig& group = *send.config;
  return concat(what, " mismatch in group '", group.name, "', tag ", send.request.tag, ": rank ",
                group.rank, " sends ", sent.describe(), " to rank ", group.rank,
                ", which receives into ", recv.request.desc.describe());
}

std::string LoopbackPairing::captureMismatch(const LoopbackOp& send, const LoopbackOp& recv) {
  auto where = [](const LoopbackOp& op) {
    return op.capture ? "inside a CUDA graph capture" : "outside any CUDA graph capture";
  };
  return concat(send.op->describe(), " was posted ", where(send), " and ", recv.op->describe(),
                " ", send.capture && recv.capture ? "inside another one" : where(recv),
                ": ops to this rank itself meet only within one capture, or outside any");
}

void LoopbackPairing::ended(const Op& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = ops_.find(op.id);
  if (it == ops_.end()) return;
  const std::shared_ptr<LoopbackOp> half = std::move(it->second);
  ops_.erase(it);
  half->reported = true;
  // Unpaired (timed out, group closed): it leaves its line, so later ops pair among themselves.
  if (!half->pair) withdraw(half);
  half->queued.store(true, std::memory_order_release);
  forgetOnceDone(*half);
}

void LoopbackPairing::forgetOnceDone(LoopbackOp& half) {
  if (half.reported && (!half.pair || half.pair->exchanged)) half.op.reset();
}

void LoopbackPairing::withdraw(const std::shared_ptr<LoopbackOp>& half) {
  Lines& lines = half->op->isSend() ? sends_ : recvs_;
  auto line = lines.find(lineOf(*half->op));
  if (line == lines.end()) return;
  std::deque<std::shared_ptr<LoopbackOp>>& queue = line->second;
  for (auto it = queue.begin(); it != queue.end(); ++it) {
    if (*it == half) {
      queue.erase(it);
      break;
    }
  }
  if (queue.empty()) lines.erase(line);
}

std::string LoopbackPairing::describe(const Op& op, const LoopbackOp& half) {
  const char* partner = op.isSend() ? "recv" : "send";
  std::lock_guard<std::mutex> lock(mutex_);
  if (!half.pair) return concat("its ", partner, " in this process is not posted yet");
  return concat("paired with its ", partner, " in this process; ",
                half.pair->outcome ? "ends on the progress thread" : "its copy runs on the GPU");
}

std::vector<LoopbackPairing::Report> LoopbackPairing::progress() {
  std::vector<Report> reports;
  if (pendingCount_.load(std::memory_order_relaxed) == 0) return reports;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = inFlight_.begin(); it != inFlight_.end();) {
    LoopbackPair& pair = **it;
    if (!cudaOps_.flags().isSet(*pair.done)) {
      ++it;
      continue;
    }
    cudaOps_.releaseOnceWritten(*pair.done);
    pair.outcome = Status::success();
    settled_.push_back(*it);
    it = inFlight_.erase(it);
  }
  // An op posted but not started yet is told on a later pass (the loop naps meanwhile).
  settled_.erase(std::remove_if(settled_.begin(), settled_.end(),
                                [&](const std::shared_ptr<LoopbackPair>& pair) {
                                  return collectPair(*pair, reports);
                                }),
                 settled_.end());
  pendingCount_.store(inFlight_.size() + settled_.size(), std::memory_order_relaxed);
  return reports;
}

void LoopbackPairing::flush(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const std::shared_ptr<LoopbackPair>& pair : inFlight_) {
    while (!cudaOps_.flags().isSet(*pair->done) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

bool LoopbackPairing::collectPair(LoopbackPair& pair, std::vector<Report>& reports) {
  bool told = true;
  // An op gone has ended: nothing to tell it.
  if (auto send = pair.send.lock()) told = collect(*send, reports) && told;
  if (auto recv = pair.recv.lock()) told = collect(*recv, reports) && told;
  return told;
}

bool LoopbackPairing::collect(LoopbackOp& half, std::vector<Report>& reports) {
  if (half.reported) return true;
  if (half.op->state == OpState::kPosted) return false;  // told once the engine started it
  half.reported = true;
  reports.push_back(Report{half.op, *half.pair->outcome});
  return true;
}

}  // namespace smfree::engine
