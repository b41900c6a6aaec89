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
#include "engine/Error.h"
#include "engine/Log.h"

namespace smfree {
namespace {

int64_t totalBytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& tensor : tensors) total += static_cast<int64_t>(tensor.nbytes());
  return total;
}

const char* opName(engine::OpKind kind, int peer) {
  if (kind == engine::OpKind::kSend) return "send";
  return peer == engine::kAnySource ? "recv from any source" : "recv";
}

}  // namespace

SmFreeBackend::SmFreeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout, const std::string& groupName,
                             InnerFactory innerFactory)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      groupName_(std::make_shared<const std::string>(groupName)),
      selfExchange_(std::make_unique<SelfExchange>(groupName)),
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
  selfExchange_.reset();
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
  return pointToPoint(engine::OpKind::kSend, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                   int tag) {
  return pointToPoint(engine::OpKind::kRecv, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                            int tag) {
  return pointToPoint(engine::OpKind::kRecv, tensors, engine::kAnySource, tag);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::pointToPoint(engine::OpKind kind,
                                                           std::vector<at::Tensor>& tensors,
                                                           int peer, int tag) {
  c10::intrusive_ptr<SmFreeWork> batch;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    if (batch_) batch = batch_->work;
  }
  PreparedOp op;
  try {
    op = prepare(kind, tensors, peer, tag, batch);
  } catch (...) {
    if (batch) {
      // None of the batch's ops has been posted: drop them all, so the group can batch again.
      std::lock_guard<std::mutex> lock(coalescingMutex_);
      batch_.reset();
    }
    throw;
  }
  c10::intrusive_ptr<c10d::Work> work = op.work;
  if (op.self) work = op.self->work;
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
                                                 int tag,
                                                 const c10::intrusive_ptr<SmFreeWork>& batch,
                                                 const char* collective) {
  const char* op = collective ? collective : opName(kind, peer);
  CallerRelease::drain();
  checkOpen(op);
  at::Tensor& tensor = checkP2PTensor(tensors, op);
  if (!collective) checkTag(tag, op);
  const bool onCuda = tensor.device().is_cuda();
  if (onCuda) {
    bindDevice(tensor, op);
  }
  if (peer != engine::kAnySource) {
    checkPeer(peer, getSize(), op);
  }
  WorkLabel label{kind,       getRank(), peer, tag, static_cast<int64_t>(tensor.nbytes()),
                  groupName_, collective};
  const auto call = [&] { return label.describe(); };
  const bool toSelf = peer == getRank();
  // Arguments are checked first, so a bad call gets the same error whatever its peer's state.
  try {
    if (peer == engine::kAnySource) {
      group_->connectAll();
    } else if (!toSelf) {
      group_->connect(peer);
    }
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smfree: ", call(), " cannot connect: ", engine::reasonOf(error)));
  }
  if (peer != engine::kAnySource && !toSelf) {
    if (auto failure = group_->peerFailure(peer)) {
      C10_THROW_ERROR(DistBackendError, c10::str("smfree: ", call(), " refused: ", *failure));
    }
  }

  if (auto failure = group_->failureAfterWait()) {
    C10_THROW_ERROR(DistBackendError, c10::str("smfree: ", call(), " refused: ", *failure));
  }
  if (toSelf) return prepareSelf(label, tensor, batch);

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
  // The engine's thread drops these callbacks, and with them maybe the Works' last references.
  struct Reports {
    c10::intrusive_ptr<SmFreeWork> work;
    c10::intrusive_ptr<SmFreeWork> batch;
  };
  auto reports = CallerRelease::hold(Reports{work, batch});
  request.onComplete = [reports, cpuWaited](const engine::Status& status, int source) {
    const WorkLabel& label = reports->work->label();
    reports->work->onOpDone(status, source, cpuWaited, label);
    if (reports->batch) reports->batch->onOpDone(status, source, cpuWaited, label);
  };
  if (peer == engine::kAnySource) {
    // wait() on a CUDA recv may return before the recv ends; its source is known by then.
    request.onMatched = [reports](int source) { reports->work->onMatched(source); };
  }
  if (batch) batch->expectOp(cpuWaited);
  return PreparedOp{std::move(request), work, cpuWaited, nullptr};
}

SmFreeBackend::PreparedOp SmFreeBackend::prepareSelf(const WorkLabel& label,
                                                     const at::Tensor& tensor,
                                                     const c10::intrusive_ptr<SmFreeWork>& batch) {
  PreparedOp op;
  op.cpuWaited = !tensor.device().is_cuda();
  op.self = selfExchange_->prepare(label, tensor, batch);
  if (batch) {
    batch->expectOp(op.cpuWaited);
    batch->addWaitedWork(op.self->work);
  }
  return op;
}

void SmFreeBackend::post(PreparedOp& op, const c10::intrusive_ptr<SmFreeWork>& batch) {
  if (op.self) {
    selfExchange_->post(op.self, group_->timeout());
    return;
  }
  const int device = op.request.buffer.device;
  std::optional<engine::CudaFence> fence;
  try {
    fence = group_->post(std::move(op.request));
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, error.what());
  }
  TORCH_INTERNAL_ASSERT(fence.has_value() != op.cpuWaited,
                        "smfree: the engine fenced an op it was not to fence, or the reverse");
  if (fence) {
    op.work->addStreamFence(group_, device, *fence);
    if (batch) batch->addStreamFence(group_, device, *fence);
  }
  op.work->seal();
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
  // Its recvs first: a captured send posted after its recv copies straight into the recv's
  // buffer (CapturedChannel.h), and a batch's ops have no order among themselves.
  std::stable_partition(batch.ops.begin(), batch.ops.end(), [](const PreparedOp& op) {
    return !op.self && op.request.kind == engine::OpKind::kRecv;
  });
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    try {
      post(batch.ops[i], batch.work);
    } catch (const std::exception& error) {
      // This op and the ones after it were never posted: they fail, so no wait() on them hangs.
      const auto failure = engine::Status::failure(
          engine::StatusCode::kAborted, c10::str("smfree: not posted: ", error.what()));
      for (size_t j = i; j < batch.ops.size(); ++j) {
        PreparedOp& op = batch.ops[j];
        if (op.self) {
          op.self->work->finish(failure);  // reports to the batch too
          continue;
        }
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

bool SmFreeBackend::onCopyEngines(Collective collective, const char* op,
                                  const at::Tensor& tensor, std::optional<int64_t> pieceBytes) {
  if (!tensor.defined() || !tensor.is_cuda() || !smfree::onCopyEngines(collective)) return false;
  if (pieceBytes && *pieceBytes < collectiveMinBytes()) return false;
  checkOpen(op);
  try {
    group_->connectAll();
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, c10::str("smfree: ", op, " on group '",
                                               group_->config().name, "' cannot connect: ",
                                               engine::reasonOf(error)));
  }
  for (int peer = 0; peer < getSize(); ++peer) {
    if (peer != getRank() && group_->cudaChannel(peer) != engine::ChannelKind::kCopyEngine) {
      engine::logOnce(c10::str("collectives-off/", group_->config().name),
                      c10::str("group '", group_->config().name, "': its collectives go to NCCL, "
                               "since rank ", peer, " is not reached through copy engines"));
      return false;
    }
  }
  engine::logOnce("collectives-on",
                  c10::str("collectives on the copy engines (SMFREE_COLLECTIVES): ",
                           c10::Join(",", collectivesOnCopyEngines()), ", from pieces of ",
                           collectiveMinBytes(), " B (SMFREE_COLLECTIVE_MIN_BYTES); smaller ones, "
                           "the others and reductions go to NCCL"));
  return true;
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::runOnCopyEngines(CollectivePlan plan) {
  const at::Tensor& sample =
      plan.outputs.empty() ? plan.sends.front().tensor : plan.outputs.front();
  bindDevice(sample, plan.op);
  copyEngineCollectives_.fetch_add(1, std::memory_order_relaxed);
  // Inside a coalescing block its ops join the block's, posted when the block ends, and the
  // block's Work is the call's.
  c10::intrusive_ptr<SmFreeWork> block;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    if (batch_) block = batch_->work;
  }
  Batch batch;
  if (!block) {
    WorkLabel label{engine::OpKind::kSend, getRank(), engine::kAnySource,
                    engine::kCollectiveTag, plan.bytes(), groupName_, plan.op};
    batch.work = c10::make_intrusive<SmFreeWork>(plan.type, label, plan.outputs);
  }
  const c10::intrusive_ptr<SmFreeWork>& reportTo = block ? block : batch.work;
  try {
    for (auto* pieces : {&plan.recvs, &plan.sends}) {
      const bool isSend = pieces == &plan.sends;
      for (Piece& piece : *pieces) {
        std::vector<at::Tensor> tensors{piece.tensor};
        batch.ops.push_back(prepare(isSend ? engine::OpKind::kSend : engine::OpKind::kRecv,
                                    tensors, piece.peer, engine::kCollectiveTag, reportTo,
                                    plan.op));
      }
    }
  } catch (...) {
    if (block) {
      std::lock_guard<std::mutex> lock(coalescingMutex_);
      batch_.reset();  // none of the block's ops was posted: it can start again
    }
    throw;
  }
  if (block) {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    TORCH_CHECK(batch_ && batch_->work == block,
                "smfree: the coalescing block ended while ", plan.op, " was being added");
    for (PreparedOp& op : batch.ops) batch_->ops.push_back(std::move(op));
    return block;
  }
  postBatch(batch);
  return batch.work;
}

c10d::Backend& SmFreeBackend::inner(c10::DeviceType deviceType) {
  std::lock_guard<std::mutex> lock(innerMutex_);
  auto it = inners_.find(deviceType);
  if (it == inners_.end()) {
    // Built on first use, so a group that never runs a CPU collective never builds Gloo.
    it = inners_.emplace(deviceType, innerFactory_(c10::DeviceTypeName(deviceType, true))).first;
  }
  return *it->second;
}

c10d::Backend& SmFreeBackend::innerFor(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "smfree: collective called with no tensors");
  return inner(tensors.front().device().type());
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                        const c10d::BroadcastOptions& opts) {
  checkOpen("broadcast");
  if (!tensors.empty() && onCopyEngines(Collective::kBroadcast, "broadcast", tensors[0],
                                         tensors[0].nbytes())) {
    TORCH_CHECK_VALUE(opts.rootTensor == 0, "smfree: broadcast: root tensor ", opts.rootTensor,
                      " of a single tensor");
    return runOnCopyEngines(planBroadcast(tensors, opts.rootRank, getRank(), getSize()));
  }
  return innerFor(tensors).broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::AllreduceOptions& opts) {
  checkOpen("allreduce");
  return innerFor(tensors).allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  checkOpen("allreduce_coalesced");
  return innerFor(tensors).allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::reduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::ReduceOptions& opts) {
  checkOpen("reduce");
  return innerFor(tensors).reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  checkOpen("allgather");
  if (!inputs.empty() && onCopyEngines(Collective::kAllGather, "all_gather", inputs[0],
                                         inputs[0].nbytes())) {
    return runOnCopyEngines(planAllGather(outputs, inputs, getRank(), getSize()));
  }
  return innerFor(inputs).allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::_allgather_base(at::Tensor& output,
                                                              at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  checkOpen("allgather");
  if (onCopyEngines(Collective::kAllGather, "all_gather_into_tensor", input, input.nbytes())) {
    return runOnCopyEngines(planAllGatherIntoTensor(output, input, getRank(), getSize()));
  }
  return inner(input.device().type())._allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  checkOpen("allgather_coalesced");
  return innerFor(inputs).allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  checkOpen("allgather_into_tensor_coalesced");
  if (!inputs.empty() &&
      onCopyEngines(Collective::kAllGather, "all_gather_into_tensor (coalesced)", inputs[0],
                    totalBytes(inputs))) {
    return runOnCopyEngines(
        planAllGatherIntoTensorCoalesced(outputs, inputs, getRank(), getSize()));
  }
  return innerFor(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::GatherOptions& opts) {
  checkOpen("gather");
  if (!inputs.empty() && onCopyEngines(Collective::kGather, "gather", inputs[0], inputs[0].nbytes())) {
    return runOnCopyEngines(planGather(outputs, inputs, opts.rootRank, getRank(), getSize()));
  }
  return innerFor(inputs).gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::scatter(std::vector<at::Tensor>& outputs,
                                                      std::vector<std::vector<at::Tensor>>& inputs,
                                                      const c10d::ScatterOptions& opts) {
  checkOpen("scatter");
  if (!outputs.empty() && onCopyEngines(Collective::kScatter, "scatter", outputs[0],
                                         outputs[0].nbytes())) {
    return runOnCopyEngines(planScatter(outputs, inputs, opts.rootRank, getRank(), getSize()));
  }
  return innerFor(outputs).scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  checkOpen("reduce_scatter");
  return innerFor(outputs).reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  checkOpen("reduce_scatter");
  return inner(input.device().type())._reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  checkOpen("reduce_scatter_tensor_coalesced");
  return innerFor(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  checkOpen("alltoall");
  // Uneven splits differ from rank to rank: no size all ranks see alike to go by.
  const bool even = outputSplitSizes.empty() && inputSplitSizes.empty();
  if (onCopyEngines(Collective::kAllToAll, "all_to_all_single", input,
                    even ? std::optional<int64_t>(input.nbytes() / getSize()) : std::nullopt)) {
    return runOnCopyEngines(planAllToAllSingle(output, input, outputSplitSizes, inputSplitSizes,
                                               getRank(), getSize()));
  }
  return inner(input.device().type())
      .alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllToAllOptions& opts) {
  checkOpen("alltoall");
  if (!inputs.empty() && onCopyEngines(Collective::kAllToAll, "all_to_all", inputs[0], std::nullopt)) {
    return runOnCopyEngines(planAllToAll(outputs, inputs, getRank(), getSize()));
  }
  return innerFor(inputs).alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> SmFreeBackend::barrier(const c10d::BarrierOptions& opts) {
  checkOpen("barrier");
  const bool onCuda = !opts.device_ids.empty() || (opts.device && opts.device->is_cuda());
  return inner(onCuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU).barrier(opts);
}

void SmFreeBackend::stop(const char* state, bool abortInner) {
  const char* expected = nullptr;
  if (!stopped_.compare_exchange_strong(expected, state)) {
    return;
  }
  WithoutGil released;  // the inner backends' shutdown and the group's close wait for threads
  selfExchange_->close(c10::str("group '", group_->config().name, "' was ", state));
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
