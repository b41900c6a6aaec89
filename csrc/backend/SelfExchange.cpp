#include "backend/SelfExchange.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "backend/CallerRelease.h"
#include "backend/TensorChecks.h"
#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/Capture.h"
#include "engine/cuda/Copies.h"

namespace smfree {
namespace {

using engine::Status;
using engine::StatusCode;

// How often the watcher asks whether the GPU has run a copy while one is in flight: the Work
// finishes (is_completed, its future) that much after the copy, while wait() returns as soon
// as the copy is submitted.
constexpr std::chrono::microseconds kCopyPoll{50};

int64_t millisBetween(SelfExchange::Clock::time_point from, SelfExchange::Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

void finishBoth(const SelfExchange::Op& send, const SelfExchange::Op& recv, const Status& status) {
  send.work->finish(status);
  recv.work->finish(status);
}

// As the engine names its ops: "recv on rank 0 from rank 0 (group 'pp', tag 0, float32[4] (16 B))".
std::string describe(const SelfExchange::Op& op) {
  const WorkLabel& label = op.work->label();
  const bool isSend = label.kind == engine::OpKind::kSend;
  return c10::str(isSend ? "send on rank " : "recv on rank ", label.rank,
                  isSend ? " to rank " : " from rank ", label.peer, " (group '", *label.group,
                  "', tag ", label.tag, ", ", op.desc.describe(), ")");
}

Status copyFailure(const SelfExchange::Op& send, const std::string& why) {
  return Status::failure(StatusCode::kTransport, c10::str(describe(send), ": the copy failed: ", why));
}

}  // namespace

SelfExchange::SelfExchange(std::string groupName) : groupName_(std::move(groupName)) {}

SelfExchange::~SelfExchange() {
  close(c10::str("group '", groupName_, "' was destroyed"));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  // Copies already submitted run to their end: their Works finish as copied.
  for (const InFlight& copy : inFlight_) {
    try {
      copy.copied->synchronize();
      finishBoth(*copy.send, *copy.recv, Status::success());
    } catch (const std::exception& error) {
      finishBoth(*copy.send, *copy.recv, copyFailure(*copy.send, error.what()));
    }
  }
}

std::shared_ptr<SelfExchange::Op> SelfExchange::prepare(
    const WorkLabel& label, const at::Tensor& tensor,
    const c10::intrusive_ptr<SmFreeWork>& batch) const {
  auto op = std::make_shared<Op>();
  const int device = tensor.device().is_cuda() ? tensor.device().index() : -1;
  op->work = c10::make_intrusive<SelfWork>(label, tensor, device, batch);
  op->storage = tensor.storage();
  op->data = tensor.data_ptr();
  op->desc = describeTensor(tensor);
  if (device >= 0) {
    const c10::Stream stream =
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(tensor.device());
    try {
      if (auto capture = engine::cuda::captureOf(static_cast<CUstream>(stream.native_handle()))) {
        op->capture = capture->id;
      }
    } catch (const engine::Error& error) {
      TORCH_CHECK(false, "smfree: ", label.describe(), ": ", engine::reasonOf(error));
    }
  }
  return op;
}

void SelfExchange::post(const std::shared_ptr<Op>& op, std::chrono::milliseconds timeout) {
  std::shared_ptr<Op> earlier;
  try {
    earlier = matchOrQueue(op, timeout);
  } catch (const std::exception& error) {
    // The group is closed, or CUDA refused the event: nothing was queued.
    op->work->finish(Status::failure(
        StatusCode::kAborted, c10::str(describe(*op), " failed: ", error.what())));
    return;
  }
  if (!earlier) return;
  const bool isSend = op->work->label().kind == engine::OpKind::kSend;
  exchange(isSend ? op : earlier, isSend ? earlier : op, earlier);
}

std::shared_ptr<SelfExchange::Op> SelfExchange::matchOrQueue(const std::shared_ptr<Op>& op,
                                                              std::chrono::milliseconds timeout) {
  const WorkLabel& label = op->work->label();
  const bool isSend = label.kind == engine::OpKind::kSend;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw std::runtime_error(*closed_);
  Queue& opposite = isSend ? recvs_ : sends_;
  if (auto it = opposite.find(label.tag); it != opposite.end()) {
    std::shared_ptr<Op> earlier = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) opposite.erase(it);
    return earlier;
  }
  if (op->work->onCuda()) {
    // The stream as it is now: the copy, queued by the later op, waits for this much of it.
    const c10::Device device(c10::DeviceType::CUDA,
                             static_cast<c10::DeviceIndex>(op->storage.device().index()));
    op->posted.emplace(c10::DeviceType::CUDA);
    op->posted->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device));
  }
  op->queuedAt = Clock::now();
  op->deadline = op->queuedAt + timeout;
  (isSend ? sends_ : recvs_)[label.tag].push_back(op);
  startWatcher();
  wake_.notify_all();
  return nullptr;
}

void SelfExchange::exchange(const std::shared_ptr<Op>& send, const std::shared_ptr<Op>& recv,
                            const std::shared_ptr<Op>& earlier) {
  if (!send->desc.compatibleWith(recv->desc)) {
    finishBoth(*send, *recv, Status::failure(StatusCode::kMismatch, mismatch(*send, *recv)));
    return;
  }
  if (send->capture != recv->capture) {
    finishBoth(*send, *recv, Status::failure(StatusCode::kMismatch, captureMismatch(*send, *recv)));
    return;
  }
  try {
    if (send->desc.bytes != 0 && send->work->onCuda()) {
      copyOnGpu(send, recv, earlier);
      return;  // the watcher finishes both once the GPU has run the copy
    }
    if (send->desc.bytes != 0) std::memmove(recv->data, send->data, send->desc.bytes);
  } catch (const std::exception& error) {
    finishBoth(*send, *recv, copyFailure(*send, error.what()));
    return;
  }
  finishBoth(*send, *recv, Status::success());
}

void SelfExchange::copyOnGpu(const std::shared_ptr<Op>& send, const std::shared_ptr<Op>& recv,
                             const std::shared_ptr<Op>& earlier) {
  const c10::Device device = send->storage.device();
  // The later op's current stream, after the earlier op's stream as it was at its post.
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  earlier->posted->block(stream);
  queueCopy(*send, *recv, static_cast<CUstream>(stream.native_handle()), device.index());
  auto copied = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  copied->record(stream);
  send->work->onQueued(copied);
  recv->work->onQueued(copied);
  if (send->capture) {
    // The copy is a node of the graph being captured: nothing runs until the graph does, and
    // the Works' wait() make the stream wait for `copied`, an event of the same capture.
    finishBoth(*send, *recv, Status::success());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inFlight_.push_back(InFlight{std::move(copied), send, recv, std::nullopt});
    startWatcher();
  }
  wake_.notify_all();
}

void SelfExchange::queueCopy(const Op& send, const Op& recv, CUstream stream, int device) {
  // Raw bytes, like any other peer's transfer, by the engine's copies (SMFREE_LOCAL_COPIES).
  const engine::cuda::Place to{reinterpret_cast<CUdeviceptr>(recv.data), device};
  const engine::cuda::Place from{reinterpret_cast<CUdeviceptr>(send.data), device};
  constexpr const char* kWhat = "cuMemcpyAsync (to the rank itself)";
  if (!send.capture) {
    engine::cuda::queueCopy(stream, device, to, from, send.desc.bytes, kWhat);
    return;
  }
  // The graph's replays pass through its bounce, if any: the graph keeps it.
  std::unique_ptr<engine::cuda::BounceLease> bounce;
  engine::cuda::queueCopyThrough(stream, device, to, from, send.desc.bytes, bounce, kWhat);
  if (bounce) {
    engine::cuda::keepWithGraph(engine::cuda::captureOf(stream)->graph, std::move(bounce));
  }
}

std::string SelfExchange::captureMismatch(const Op& send, const Op& recv) const {
  auto where = [](const Op& op) {
    return op.capture ? "inside a CUDA graph capture" : "outside any CUDA graph capture";
  };
  return c10::str(describe(send), " was posted ", where(send), " and ", describe(recv), " ",
                  send.capture && recv.capture ? "inside another one" : where(recv),
                  ": ops to this rank itself meet only within one capture, or outside any");
}

std::string SelfExchange::mismatch(const Op& send, const Op& recv) const {
  // The engine's wording for other peers.
  const char* what = send.desc.device != recv.desc.device ? "device" : "size or dtype";
  const int rank = send.work->label().rank;
  return c10::str(what, " mismatch in group '", groupName_, "', tag ", send.work->label().tag,
                  ": rank ", rank, " sends ", send.desc.describe(), " to rank ", rank,
                  ", which receives into ", recv.desc.describe());
}

void SelfExchange::close(const std::string& reason) {
  std::vector<std::shared_ptr<Op>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = reason;
    for (Queue* queue : {&sends_, &recvs_}) {
      for (auto& [tag, ops] : *queue) dropped.insert(dropped.end(), ops.begin(), ops.end());
      queue->clear();
    }
  }
  for (const auto& op : dropped) {
    op->work->finish(Status::failure(
        StatusCode::kAborted, c10::str(describe(*op), " failed: ", reason)));
  }
}

void SelfExchange::startWatcher() {
  if (!watcher_.joinable()) watcher_ = std::thread([this] { watch(); });
}

void SelfExchange::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    const Clock::time_point now = Clock::now();
    std::vector<std::shared_ptr<Op>> expired = takeExpired(now);
    std::vector<InFlight> copied = takeCopied();
    if (expired.empty() && copied.empty()) {
      if (auto until = nextWake(now)) {
        wake_.wait_until(lock, *until);
      } else {
        wake_.wait(lock);
      }
      continue;
    }
    lock.unlock();
    for (const auto& op : expired) expire(*op, now);
    for (const InFlight& copy : copied) finishCopied(copy);
    // Their Works may hold tensors' last C++ references: not dropped here (CallerRelease).
    CallerRelease::handBackNow(std::make_pair(std::move(expired), std::move(copied)));
    lock.lock();
  }
}

std::optional<SelfExchange::Clock::time_point> SelfExchange::nextWake(Clock::time_point now) const {
  if (!inFlight_.empty()) return now + kCopyPoll;
  std::optional<Clock::time_point> next;
  for (const Queue* queue : {&sends_, &recvs_}) {
    for (const auto& [tag, ops] : *queue) {
      // In posting order: the front expires first (a later setTimeout aside, which the ops
      // behind it then wait for).
      if (!next || ops.front()->deadline < *next) next = ops.front()->deadline;
    }
  }
  return next;
}

std::vector<std::shared_ptr<SelfExchange::Op>> SelfExchange::takeExpired(Clock::time_point now) {
  std::vector<std::shared_ptr<Op>> expired;
  for (Queue* queue : {&sends_, &recvs_}) {
    for (auto it = queue->begin(); it != queue->end();) {
      auto& ops = it->second;
      while (!ops.empty() && ops.front()->deadline <= now) {
        expired.push_back(std::move(ops.front()));
        ops.pop_front();
      }
      it = ops.empty() ? queue->erase(it) : std::next(it);
    }
  }
  return expired;
}

std::vector<SelfExchange::InFlight> SelfExchange::takeCopied() {
  std::vector<InFlight> copied;
  if (inFlight_.empty()) return copied;
  try {
    // A user's graph capture in "global" mode would refuse the event queries below, and be
    // invalidated by them.
    engine::cuda::relaxCaptureOnThisThread();
  } catch (const engine::Error& error) {
    engine::logOnce("self-exchange relax", c10::str("ops to this rank itself: ", error.what()),
                    engine::LogLevel::kWarn);
  }
  for (auto it = inFlight_.begin(); it != inFlight_.end();) {
    bool done = true;
    try {
      done = it->copied->query();
    } catch (const std::exception& error) {
      it->failure = error.what();  // the device failed: the copy will not run
    }
    if (done) {
      copied.push_back(std::move(*it));
      it = inFlight_.erase(it);
    } else {
      ++it;
    }
  }
  return copied;
}

void SelfExchange::finishCopied(const InFlight& copy) {
  if (!copy.failure) {
    finishBoth(*copy.send, *copy.recv, Status::success());
    return;
  }
  finishBoth(*copy.send, *copy.recv, copyFailure(*copy.send, *copy.failure));
}

void SelfExchange::expire(const Op& op, Clock::time_point now) {
  const WorkLabel& label = op.work->label();
  const bool isSend = label.kind == engine::OpKind::kSend;
  op.work->finish(Status::failure(
      StatusCode::kTimeout,
      c10::str(describe(op), isSend ? " was not matched by a recv" : " was not matched by a send",
               " within the group timeout of ", millisBetween(op.queuedAt, op.deadline),
               " ms (posted ", millisBetween(op.queuedAt, now), " ms ago)")));
}

}  // namespace smfree
