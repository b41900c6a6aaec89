#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace smfree {

// Collectives on the copy engines. Where every rank of a group is on this host, a collective
// that moves bytes without reducing them is the point-to-point messages it is made of: each rank
// posts, as one batch, a recv for every piece it is owed and a send of every piece it owes, on
// the group's collective line (engine::kCollectiveTag). The engine moves each piece as it moves
// any message of that line: by rendezvous, one copy-engine copy straight into the receiver's
// tensor (docs/design.md, "Collectives"). A rank's own piece is an op to itself (LoopbackChannel).
enum class Collective : uint8_t { kAllGather, kAllToAll, kBroadcast, kGather, kScatter };

// As SMFREE_COLLECTIVES spells it: "all_gather", "all_to_all", "broadcast", "gather", "scatter".
const char* settingName(Collective collective);

// Which collectives SMFREE_COLLECTIVES sends to the copy engines, read once; throws ValueError
// for a value it does not know.
bool onCopyEngines(Collective collective);
// Their setting names, in the order above (empty: all go to NCCL).
std::vector<std::string> collectivesOnCopyEngines();
// SMFREE_COLLECTIVE_MIN_BYTES, read once: calls whose pieces are smaller go to NCCL, which
// reaches small ones sooner. It counts where every rank sees the same size.
int64_t collectiveMinBytes();

// One piece of a collective: a tensor this rank sends to `peer`, or receives from it.
struct Piece {
  int peer = 0;
  at::Tensor tensor;
};

// A collective as this rank's pieces, checked as NCCL checks the call.
struct CollectivePlan {
  const char* op = "";  // the c10d call, as errors name it: "all_gather_into_tensor"
  Collective collective = Collective::kAllGather;
  c10d::OpType type = c10d::OpType::UNKNOWN;
  std::vector<Piece> sends;
  std::vector<Piece> recvs;
  std::vector<at::Tensor> outputs;  // the Work's result()

  int64_t bytes() const;  // this rank's bytes in and out, for the log
};

// Each throws ValueError for a call NCCL would refuse, naming the op and the tensor.
CollectivePlan planAllGatherIntoTensor(const at::Tensor& output, const at::Tensor& input, int rank,
                                       int size);
CollectivePlan planAllGather(const std::vector<std::vector<at::Tensor>>& outputs,
                             const std::vector<at::Tensor>& inputs, int rank, int size);
// Several all_gather_into_tensor calls coalesced: output i gathers input i.
CollectivePlan planAllGatherIntoTensorCoalesced(const std::vector<at::Tensor>& outputs,
                                                const std::vector<at::Tensor>& inputs, int rank,
                                                int size);
// Splits along dim 0, by rows; empty split sizes: equal splits.
CollectivePlan planAllToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                  const std::vector<int64_t>& outputSplits,
                                  const std::vector<int64_t>& inputSplits, int rank, int size);
CollectivePlan planAllToAll(const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, int rank, int size);
CollectivePlan planBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank, int size);
CollectivePlan planGather(const std::vector<std::vector<at::Tensor>>& outputs,
                          const std::vector<at::Tensor>& inputs, int root, int rank, int size);
CollectivePlan planScatter(const std::vector<at::Tensor>& outputs,
                           const std::vector<std::vector<at::Tensor>>& inputs, int root, int rank,
                           int size);

}  // namespace smfree
