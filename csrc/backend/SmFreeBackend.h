#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/Collectives.h"
#include "backend/InFlight.h"
#include "backend/SmFreeWork.h"
#include "engine/Group.h"

namespace smfree {

// torch.distributed backend "smfree": point-to-point ops go to the smfree engine, and so do the
// collectives SMFREE_COLLECTIVES names, on CUDA tensors of ranks of one host (Collectives.h);
// other collectives go to a wrapped backend per device type (Gloo for CPU, NCCL for CUDA),
// built on first use by the factory the Python side provides.
class SmFreeBackend final : public c10d::Backend {
 public:
  using InnerFactory = std::function<c10::intrusive_ptr<c10d::Backend>(const std::string&)>;

  SmFreeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                std::chrono::milliseconds timeout, const std::string& groupName,
                InnerFactory innerFactory);
  ~SmFreeBackend() override;

  const std::string getBackendName() const override { return "smfree"; }
  bool supportsCoalescing() const override { return true; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;

  // Point to point.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Collectives: on the copy engines (Collectives.h) or forwarded.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  void abort() override;
  void shutdown() override;

  // The ops of this group that are not finished, one per line.
  std::string dumpPending();
  std::map<std::string, int64_t> stats();

 private:
  // A point-to-point op, checked, with its Work, not yet posted.
  struct PreparedOp {
    engine::OpRequest request;
    c10::intrusive_ptr<SmFreeWork> work;
    bool cpuWaited = true;
    std::shared_ptr<InFlightSpan> span;  // its bytes in inFlight_: a user's op to another rank
  };
  // The ops called between startCoalescing and endCoalescing. Each is checked when it is
  // called, and all are posted at endCoalescing: a batch with a refused op posts none.
  struct Batch {
    c10::intrusive_ptr<SmFreeWork> work;
    std::vector<PreparedOp> ops;
  };

  // `fromAnySource`: torch's recvAnysource, the one call whose peer may be kAnySource.
  c10::intrusive_ptr<c10d::Work> pointToPoint(engine::OpKind kind, std::vector<at::Tensor>& tensors,
                                              int peer, bool fromAnySource, int tag);
  // Checks the call and connects to the peer; `batch`, if set, will also report the op.
  // `collective`: the collective the op is a piece of (its tag is then kCollectiveTag).
  PreparedOp prepare(engine::OpKind kind, std::vector<at::Tensor>& tensors, int peer,
                     bool fromAnySource, int tag,
                     const c10::intrusive_ptr<SmFreeWork>& batch,
                     const char* collective = nullptr);
  void post(PreparedOp& op, const c10::intrusive_ptr<SmFreeWork>& batch);
  // Drops the coalescing block, none of whose ops was posted (under coalescingMutex_).
  void dropBatch();
  // Posts a batch's ops, its recvs first and its sends to this rank last, and seals its Work.
  void postBatch(Batch& batch);
  // Whether this call of a collective runs on the copy engines (Collectives.h): SMFREE_COLLECTIVES
  // names it, its tensors are CUDA tensors, every other rank is reached through copy engines,
  // and `pieceBytes`, where every rank sees the same, is at least SMFREE_COLLECTIVE_MIN_BYTES.
  bool onCopyEngines(Collective collective, const char* op, const at::Tensor& tensor,
                     std::optional<int64_t> pieceBytes);
  c10::intrusive_ptr<c10d::Work> runOnCopyEngines(CollectivePlan plan);
  void checkOpen(const char* op) const;
  c10d::Backend& inner(c10::DeviceType deviceType);
  c10d::Backend& innerFor(const std::vector<at::Tensor>& tensors);
  void stop(const char* state, bool abortInner);
  void bindDevice(const at::Tensor& tensor, const char* op);

  std::shared_ptr<engine::Group> group_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const std::string> groupName_;  // shared by the labels of its Works
  const std::shared_ptr<InFlight> inFlight_ = InFlight::ofProcess();

  std::mutex innerMutex_;
  InnerFactory innerFactory_;
  std::map<c10::DeviceType, c10::intrusive_ptr<c10d::Backend>> inners_;

  std::mutex coalescingMutex_;
  std::optional<Batch> batch_;  // set between startCoalescing and endCoalescing

  std::atomic<const char*> stopped_{nullptr};  // "aborted" or "shut down" once stopped
  std::atomic<int> device_{-1};  // the CUDA device this rank uses in the group, once known
  std::atomic<int> p2pSeq_{0};  // numbers the point-to-point ops in profiler traces
  std::atomic<int64_t> copyEngineCollectives_{0};  // calls run on the copy engines (stats())
};

}  // namespace smfree
