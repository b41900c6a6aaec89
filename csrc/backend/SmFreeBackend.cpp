#include "backend/SmFreeBackend.h"

#include <algorithm>

#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "backend/CallerRelease.h"
#include "backend/StoreAdapter.h"
#include "backend/TensorChecks.h"
#include "backend/WithoutGil.h"
#include "engine/Engine.h"
#include "engine/Error.h"

namespace smfree {
namespace {

const char* opName(engine::OpKind kind, bool fromAnySource) {
  if (kind == engine::OpKind::kSend) return "send";
  return fromAnySource ? "recv from any source" : "recv";
}

}  // namespace

SmFreeBackend::SmFreeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout, const std::string& groupName,
                             InnerFactory innerFactory)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      groupName_(std::make_shared<const std::string>(groupName)),
      innerFactory_(std::move(innerFactory)) {
  // Bad collective settings fail here, not at a first collective.
  collectivesOnCopyEngines();
  collectiveMinBytes();
  try {
    group_ = engine::Engine::acquire()->joinGroup(engine::GroupConfig{groupName, rank, size},
                                                  std::make_shared<StoreAdapter>(store), timeout);
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, error.what());
  }
}

SmFreeBackend::~SmFreeBackend() {
  WithoutGil released;
  batch_.reset();
  {
    std::lock_guard<std::mutex> lock(innerMutex_);
    inners_.clear();
  }
  group_.reset();  // ends the group's ops: what they held comes back here
  CallerRelease::drain();
}

c10::intrusive_ptr<c10d::Backend::Options> SmFreeBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("smfree", timeout_);
}

void SmFreeBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  group_->setTimeout(timeout);
}

void SmFreeBackend::checkOpen(const char* op) const {
  const char* state = stopped_.load();
  TORCH_CHECK(state == nullptr, "smfree: ", op, " on group '", group_->config().name,
              "' after it was ", state);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                   int tag) {
  return pointToPoint(engine::OpKind::kSend, tensors, dstRank, false, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                   int tag) {
  return pointToPoint(engine::OpKind::kRecv, tensors, srcRank, false, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                            int tag) {
  return pointToPoint(engine::OpKind::kRecv, tensors, engine::kAnySource, true, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::pointToPoint(engine::OpKind kind,
                                                           std::vector<at::Tensor>& tensors,
                                                           int peer, bool fromAnySource,
                                                           int tag) {
  c10::intrusive_ptr<SmFreeWork> batch;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    if (batch_) batch = batch_->work;
  }
  PreparedOp op;
  try {
    op = prepare(kind, tensors, peer, fromAnySource, tag, batch);
  } catch (...) {
    if (batch) {
      // None of the batch's ops has been posted: drop them all, so the group can batch again.
      std::lock_guard<std::mutex> lock(coalescingMutex_);
      dropBatch();
    }
    throw;
  }
  c10::intrusive_ptr<c10d::Work> work = op.work;
  // The metadata ProcessGroupNCCL records for its send and recv (op, peer, elements, dtype,
  // group), which torch.profiler puts on the "record_param_comms" range and trace tools read.
  const at::Tensor& tensor = tensors.front();
  RECORD_PARAM_COMMS_DATA(p2pSeq_++, std::make_tuple(getGroupUid(), getGroupDesc()), tensors,
                          tensors, peer, kind == engine::OpKind::kSend ? "send" : "recv",
                          tensor.numel(), tensor.numel(), tensor.scalar_type(),
                          std::vector<int64_t>(), std::vector<int64_t>(), 0, 0, getSize());
  if (batch) {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    TORCH_CHECK(batch_ && batch_->work == batch,
                "smfree: the coalescing block ended while one of its ops was being added");
    batch_->ops.push_back(std::move(op));
    return work;
  }
  post(op, nullptr);
  return work;
}

SmFreeBackend::PreparedOp SmFreeBackend::prepare(engine::OpKind kind,
                                                 std::vector<at::Tensor>& tensors, int peer,
                                                 bool fromAnySource, int tag,
                                                 const c10::intrusive_ptr<SmFreeWork>& batch,
                                                 const char* collective) {
  const char* op = collective ? collective : opName(kind, fromAnySource);
  CallerRelease::drain();
  checkOpen(op);
  at::Tensor& tensor = checkP2PTensor(tensors, op);
  if (!collective) checkTag(tag, op);
  const bool onCuda = tensor.device().is_cuda();
  if (onCuda) {
    bindDevice(tensor, op);
  }
  WorkLabel label{kind,       getRank(), peer, tag, static_cast<int64_t>(tensor.nbytes()),
                  groupName_, collective};
  if (!fromAnySource) checkPeer(label, getSize());
  const auto call = [&] { return label.describe(); };
  // Arguments are checked first, so a bad call gets the same error whatever its peer's state.
  try {
    if (peer == engine::kAnySource) {
      group_->connectAll();
    } else {
      group_->connect(peer);
    }
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smfree: ", call(), " cannot connect: ", engine::reasonOf(error)));
  }
  if (peer != engine::kAnySource) {
    if (auto failure = group_->peerFailure(peer)) {
      C10_THROW_ERROR(DistBackendError, c10::str("smfree: ", call(), " refused: ", *failure));
    }
  }

  if (auto failure = group_->failureAfterWait()) {
    C10_THROW_ERROR(DistBackendError, c10::str("smfree: ", call(), " refused: ", *failure));
  }
  // Collectives place their pieces themselves; a user's ops may not overlap a recv's bytes. An
  // op to this rank itself may: its pair's bytes move in one copy (a memmove on the CPU).
  std::shared_ptr<InFlightSpan> span;
  if (!collective && peer != getRank()) {
    span = inFlight_->add(onCuda ? tensor.device().index() : -1, tensor.data_ptr(),
                          tensor.nbytes(), label);
  }

  engine::OpRequest request;
  request.kind = kind;
  request.peer = peer;
  request.tag = tag;
  request.buffer = engine::Buffer{tensor.data_ptr(), static_cast<uint64_t>(tensor.nbytes()),
                                  onCuda ? engine::MemoryKind::kCuda : engine::MemoryKind::kHost,
                                  onCuda ? tensor.device().index() : -1};
  if (onCuda) {
    // Stream order, as with NCCL: the op reads or writes after the work queued so far.
    request.stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                         ->getStream(tensor.device())
                         .native_handle();
    // At the call, so that a batch with an op that cannot be captured posts none.
    try {
      group_->checkCapture(request);
    } catch (const engine::Error& error) {
      TORCH_CHECK(false, "smfree: ", call(), ": ", engine::reasonOf(error));
    }
  }

  const bool isSend = kind == engine::OpKind::kSend;
  // CUDA ops fence the caller's stream; the CPU waits for the rest (UCX is not stream-aware).
  const bool cpuWaited = !onCuda;
  auto work = c10::make_intrusive<SmFreeWork>(
      isSend ? c10d::OpType::SEND : (peer == engine::kAnySource ? c10d::OpType::RECVANYSOURCE
                                                                 : c10d::OpType::RECV),
      std::move(label), std::vector<at::Tensor>{tensor});
  work->expectOp(cpuWaited);
  request.desc = describeTensor(tensor);
  // The storage, not the tensor: Megatron frees a sent activation right after isend by
  // swapping its `.data`, which would hand the bytes back to the allocator mid-transfer.
  request.keepalive = std::make_shared<c10::Storage>(tensor.storage());
  if (isSend) {
    // FSDP frees a sent parameter's memory by resizing its storage to 0, which a Storage held
    // does not prevent: the engine asks, as the bytes start moving, whether they are still there.
    // The storage outlives the question: keepalive holds it until no transport touches it.
    const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
    request.bufferCheck = [storage, data = storage->data(),
                           bytes = storage->nbytes()]() -> std::optional<std::string> {
      if (storage->data() == data && storage->nbytes() == bytes) return std::nullopt;
      return c10::str("its tensor's storage was freed or resized after the call (", bytes,
                      " B at ", data, ", now ", storage->nbytes(), " B at ", storage->data(),
                      ") before its bytes moved; keep a sent tensor's storage until the send's "
                      "wait() returns");
    };
  }
  // The engine's thread drops these callbacks, and with them maybe the Works' last references.
  struct Reports {
    c10::intrusive_ptr<SmFreeWork> work;
    c10::intrusive_ptr<SmFreeWork> batch;
  };
  auto reports = CallerRelease::hold(Reports{work, batch});
  request.onComplete = [reports, cpuWaited, span](const engine::Status& status, int source) {
    // First: once wait() returns, the bytes are the caller's to reuse.
    if (span) span->end();
    const WorkLabel& label = reports->work->label();
    reports->work->onOpDone(status, source, cpuWaited, label);
    if (reports->batch) reports->batch->onOpDone(status, source, cpuWaited, label);
  };
  if (peer == engine::kAnySource) {
    // wait() on a CUDA recv may return before the recv ends; its source is known by then.
    request.onMatched = [reports](int source) { reports->work->onMatched(source); };
  }
  if (batch) batch->expectOp(cpuWaited);
  if (span && !cpuWaited) {
    work->addInFlight(span);
    if (batch) batch->addInFlight(span);
  }
  return PreparedOp{std::move(request), work, cpuWaited, std::move(span)};
}

void SmFreeBackend::post(PreparedOp& op, const c10::intrusive_ptr<SmFreeWork>& batch) {
  const int device = op.request.buffer.device;
  const std::chrono::milliseconds timeout = group_->timeout();
  std::optional<engine::OpFence> fence;
  try {
    fence = group_->post(std::move(op.request));
  } catch (const engine::Error& error) {
    if (op.span) op.span->end();
    C10_THROW_ERROR(DistBackendError, error.what());
  }
  op.work->onPosted(timeout);
  if (batch) batch->onPosted(timeout);
  TORCH_INTERNAL_ASSERT(fence.has_value() != op.cpuWaited,
                        "smfree: the engine fenced an op it was not to fence, or the reverse");
  if (fence) {
    op.work->addStreamFence(group_, device, *fence);
    if (batch) batch->addStreamFence(group_, device, *fence);
  }
  op.work->seal();
}

void SmFreeBackend::dropBatch() {
  if (!batch_) return;
  for (PreparedOp& op : batch_->ops) {
    if (op.span) op.span->end();
  }
  batch_.reset();
}

void SmFreeBackend::bindDevice(const at::Tensor& tensor, const char* op) {
  const int device = tensor.device().index();
  int bound = -1;
  if (device_.compare_exchange_strong(bound, device)) {
    return;
  }
  TORCH_CHECK_VALUE(bound == device, "smfree: ", op, " of a tensor on cuda:", device,
                    ", but this rank uses cuda:", bound, " in group '", group_->config().name,
                    "'; one group uses one device per rank");
}

void SmFreeBackend::startCoalescing() {
  checkOpen("startCoalescing");
  std::lock_guard<std::mutex> lock(coalescingMutex_);
  TORCH_CHECK(!batch_, "smfree: startCoalescing called twice without endCoalescing");
  batch_.emplace();
  batch_->work = c10::make_intrusive<SmFreeWork>(
      c10d::OpType::COALESCED, WorkLabel{}, std::vector<at::Tensor>{});
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::endCoalescing() {
  CallerRelease::drain();
  Batch batch;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    TORCH_CHECK(batch_, "smfree: endCoalescing called without startCoalescing");
    batch = std::move(*batch_);
    batch_.reset();
  }
  postBatch(batch);
  return batch.work;
}

void SmFreeBackend::postBatch(Batch& batch) {
  // A batch's ops have no order among themselves. Its recvs go first: a captured send posted
  // after its recv copies straight into the recv's buffer (CapturedChannel.h). Its sends to the
  // rank itself go last: their copy is queued on the current stream at their post
  // (LoopbackChannel.h), and a send posted after it would wait for it there before leaving.
  const auto place = [rank = getRank()](const PreparedOp& op) {
    if (op.request.kind == engine::OpKind::kRecv) return 0;
    return op.request.peer == rank ? 2 : 1;
  };
  std::stable_sort(batch.ops.begin(), batch.ops.end(),
                   [&](const PreparedOp& a, const PreparedOp& b) { return place(a) < place(b); });
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    try {
      post(batch.ops[i], batch.work);
    } catch (const std::exception& error) {
      // This op and the ones after it were never posted: they fail, so no wait() on them hangs.
      const auto failure = engine::Status::failure(
          engine::StatusCode::kAborted, c10::str("smfree: not posted: ", error.what()));
      for (size_t j = i; j < batch.ops.size(); ++j) {
        PreparedOp& op = batch.ops[j];
        if (op.span) op.span->end();
        op.work->onOpDone(failure, -1, op.cpuWaited, op.work->label());
        op.work->seal();
        batch.work->onOpDone(failure, -1, op.cpuWaited, op.work->label());
      }
      batch.work->seal();
      throw;
    }
  }
  batch.work->seal();
}

void SmFreeBackend::stop(const char* state, bool abortInner) {
  const char* expected = nullptr;
  if (!stopped_.compare_exchange_strong(expected, state)) {
    return;
  }
  WithoutGil released;  // the inner backends' shutdown and the group's close wait for threads
  try {
    group_->close(engine::StatusCode::kAborted,
                  c10::str("group '", group_->config().name, "' was ", state), abortInner);
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, error.what());
  }
  std::lock_guard<std::mutex> lock(innerMutex_);
  for (auto& [device, backend] : inners_) {
    if (abortInner) {
      backend->abort();
    } else {
      backend->shutdown();
    }
  }
}

void SmFreeBackend::abort() { stop("aborted", true); }

void SmFreeBackend::shutdown() { stop("shut down", false); }

std::string SmFreeBackend::dumpPending() {
  try {
    return group_->dumpPending();
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, error.what());
  }
}

std::map<std::string, int64_t> SmFreeBackend::stats() {
  try {
    std::map<std::string, int64_t> stats = group_->stats();
    stats["collectives_on_copy_engines"] = copyEngineCollectives_.load();
    return stats;
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, error.what());
  }
}

}  // namespace smfree
