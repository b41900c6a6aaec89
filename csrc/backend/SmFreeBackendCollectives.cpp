// The backend's collectives: those SMFREE_COLLECTIVES runs on the copy engines, as batches of
// point-to-point ops (Collectives.h), and the others, forwarded to the wrapped backend of their
// device type.
#include "backend/SmFreeBackend.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <mutex>

#include "engine/Error.h"
#include "engine/Log.h"

namespace smfree {
namespace {

int64_t totalBytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& tensor : tensors) total += static_cast<int64_t>(tensor.nbytes());
  return total;
}

}  // namespace

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
  // Once per process, without building the line at every call (a CPU-bound loop pays it).
  static std::once_flag logged;
  std::call_once(logged, [] {
    engine::log(engine::LogLevel::kInfo, "collectives on the copy engines (SMFREE_COLLECTIVES): ",
                c10::Join(",", collectivesOnCopyEngines()), ", from pieces of ",
                collectiveMinBytes(), " B (SMFREE_COLLECTIVE_MIN_BYTES); smaller ones, the others "
                "and reductions go to NCCL");
  });
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
                                    tensors, piece.peer, false, engine::kCollectiveTag, reportTo,
                                    plan.op));
      }
    }
  } catch (...) {
    if (block) {
      std::lock_guard<std::mutex> lock(coalescingMutex_);
      dropBatch();  // none of the block's ops was posted: it can start again
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

}  // namespace smfree
