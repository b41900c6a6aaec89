#include "backend/Collectives.h"

#include <c10/util/Exception.h>

#include <array>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "engine/Config.h"
#include "engine/Error.h"

namespace smfree {
namespace {

constexpr std::array<Collective, 5> kCollectives{Collective::kAllGather, Collective::kAllToAll,
                                                 Collective::kBroadcast, Collective::kGather,
                                                 Collective::kScatter};
// What SMFREE_COLLECTIVES means unset (docs/benchmarks.md, "Collectives", says why).
constexpr const char* kDefaultCollectives = "all_gather";
constexpr int64_t kDefaultMinBytes = 16 << 20;

uint8_t bit(Collective collective) { return uint8_t{1} << static_cast<uint8_t>(collective); }

uint8_t parseCollectives() {
  const char* env = std::getenv("SMFREE_COLLECTIVES");
  const std::string value = env && *env ? env : kDefaultCollectives;
  if (value == "off") return 0;
  if (value == "all") return 0xff;
  uint8_t set = 0;
  std::stringstream names(value);
  std::string name;
  while (std::getline(names, name, ',')) {
    bool known = false;
    for (Collective collective : kCollectives) {
      if (name == settingName(collective)) {
        set |= bit(collective);
        known = true;
      }
    }
    TORCH_CHECK_VALUE(known, "smfree: SMFREE_COLLECTIVES='", value, "': '", name,
                      "' is not one of all_gather, all_to_all, broadcast, gather, scatter (or "
                      "say all, or off)");
  }
  return set;
}

uint8_t collectiveSet() {
  static const uint8_t set = parseCollectives();
  return set;
}

// Every tensor of a collective: on this rank's CUDA device or all on the CPU, contiguous (its
// pieces are byte ranges), of one dtype.
void checkTensor(const at::Tensor& tensor, const at::Tensor& first, const char* op,
                 const char* what) {
  TORCH_CHECK_VALUE(tensor.defined(), "smfree: ", op, ": ", what, " is undefined");
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "smfree: ", op, ": ", what,
                    " must be contiguous (its pieces move as byte ranges)");
  TORCH_CHECK_VALUE(tensor.device() == first.device(), "smfree: ", op, ": ", what, " is on ",
                    tensor.device(), " and the op's first tensor on ", first.device(),
                    "; one collective uses one device per rank");
  TORCH_CHECK_VALUE(tensor.scalar_type() == first.scalar_type(), "smfree: ", op, ": ", what,
                    " is ", tensor.scalar_type(), " and the op's first tensor ",
                    first.scalar_type(), "; NCCL needs one dtype too");
}

void checkSameNumel(const at::Tensor& tensor, int64_t numel, const char* op, const char* what) {
  TORCH_CHECK_VALUE(tensor.numel() == numel, "smfree: ", op, ": ", what, " has ", tensor.numel(),
                    " elements; it needs ", numel);
}

void checkRoot(int root, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "smfree: ", op, ": root rank ", root,
                    " is not a rank of a group of ", size);
}

void checkCount(size_t count, size_t wanted, const char* op, const char* what) {
  TORCH_CHECK_VALUE(count == wanted, "smfree: ", op, " takes ", wanted, " ", what, ", not ",
                    count);
}

// The piece this rank keeps: a copy from `from` into `into`, none where they are the same
// bytes (an all-gather in place).
void keep(CollectivePlan& plan, int rank, const at::Tensor& from, const at::Tensor& into) {
  if (from.data_ptr() == into.data_ptr() && from.nbytes() == into.nbytes()) return;
  plan.sends.push_back({rank, from});
  plan.recvs.push_back({rank, into});
}

// This rank's pieces with `peer` in an exchange with every rank: `sent` goes to it and
// `received` comes from it; with itself, the piece it keeps.
void exchangeWith(CollectivePlan& plan, int rank, int peer, const at::Tensor& sent,
                  const at::Tensor& received) {
  if (peer == rank) {
    keep(plan, rank, sent, received);
    return;
  }
  plan.recvs.push_back({peer, received});
  plan.sends.push_back({peer, sent});
}

// Row offsets of dim 0 split as `splits` (equal splits where empty); throws for bad splits.
std::vector<int64_t> rowsOf(const at::Tensor& tensor, const std::vector<int64_t>& splits,
                            int size, const char* op, const char* what) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, "smfree: ", op, ": ", what,
                    " must have a dim 0 to split");
  const int64_t rows = tensor.size(0);
  std::vector<int64_t> out;
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "smfree: ", op, ": ", what, "'s dim 0 (", rows,
                      ") does not split equally among ", size, " ranks");
    out.assign(size, rows / size);
    return out;
  }
  checkCount(splits.size(), static_cast<size_t>(size), op, c10::str(what, " split sizes").c_str());
  for (int64_t split : splits) {
    TORCH_CHECK_VALUE(split >= 0, "smfree: ", op, ": a negative ", what, " split size (", split,
                      ")");
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == rows, "smfree: ", op, ": ", what, " split sizes add up to ", total,
                    " rows; its dim 0 has ", rows);
  return splits;
}

// The rows of `tensor` split as `rows`, piece k for rank k.
std::vector<at::Tensor> splitRows(const at::Tensor& tensor, const std::vector<int64_t>& rows) {
  std::vector<at::Tensor> pieces;
  int64_t at = 0;
  for (int64_t count : rows) {
    pieces.push_back(tensor.narrow(0, at, count));
    at += count;
  }
  return pieces;
}

}  // namespace

const char* settingName(Collective collective) {
  switch (collective) {
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kAllToAll:
      return "all_to_all";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kGather:
      return "gather";
    case Collective::kScatter:
      return "scatter";
  }
  return "?";
}

int64_t collectiveMinBytes() {
  static const int64_t bytes = [] {
    try {
      return static_cast<int64_t>(
          engine::parseNonNegative("SMFREE_COLLECTIVE_MIN_BYTES", kDefaultMinBytes));
    } catch (const engine::Error& error) {
      C10_THROW_ERROR(ValueError, error.what());
    }
  }();
  return bytes;
}

bool onCopyEngines(Collective collective) { return (collectiveSet() & bit(collective)) != 0; }

std::vector<std::string> collectivesOnCopyEngines() {
  std::vector<std::string> names;
  for (Collective collective : kCollectives) {
    if (onCopyEngines(collective)) names.emplace_back(settingName(collective));
  }
  return names;
}

int64_t CollectivePlan::bytes() const {
  int64_t total = 0;
  for (const auto* pieces : {&sends, &recvs}) {
    for (const Piece& piece : *pieces) total += static_cast<int64_t>(piece.tensor.nbytes());
  }
  return total;
}

CollectivePlan planAllGatherIntoTensor(const at::Tensor& output, const at::Tensor& input, int rank,
                                       int size) {
  CollectivePlan plan{"all_gather_into_tensor", Collective::kAllGather,
                      c10d::OpType::_ALLGATHER_BASE};
  checkTensor(input, input, plan.op, "the input");
  checkTensor(output, input, plan.op, "the output");
  checkSameNumel(output, input.numel() * size, plan.op, "the output");
  const at::Tensor flat = output.view(-1);
  const int64_t numel = input.numel();
  for (int peer = 0; peer < size; ++peer) {
    exchangeWith(plan, rank, peer, input, flat.narrow(0, peer * numel, numel));
  }
  plan.outputs = {output};
  return plan;
}

CollectivePlan planAllGatherIntoTensorCoalesced(const std::vector<at::Tensor>& outputs,
                                                const std::vector<at::Tensor>& inputs, int rank,
                                                int size) {
  checkCount(outputs.size(), inputs.size(), "all_gather_into_tensor (coalesced)",
             "outputs as inputs");
  CollectivePlan plan{"all_gather_into_tensor (coalesced)", Collective::kAllGather,
                      c10d::OpType::COALESCED};
  for (size_t i = 0; i < inputs.size(); ++i) {
    CollectivePlan one = planAllGatherIntoTensor(outputs[i], inputs[i], rank, size);
    // Each (peer, direction) keeps the call order, so the n-th piece between two ranks is the
    // same tensor's on both.
    plan.sends.insert(plan.sends.end(), one.sends.begin(), one.sends.end());
    plan.recvs.insert(plan.recvs.end(), one.recvs.begin(), one.recvs.end());
    plan.outputs.push_back(outputs[i]);
  }
  return plan;
}

CollectivePlan planAllGather(const std::vector<std::vector<at::Tensor>>& outputs,
                             const std::vector<at::Tensor>& inputs, int rank, int size) {
  CollectivePlan plan{"all_gather", Collective::kAllGather, c10d::OpType::ALLGATHER};
  checkCount(inputs.size(), 1, plan.op, "input tensor (one device per rank)");
  checkCount(outputs.size(), 1, plan.op, "output list (one device per rank)");
  checkCount(outputs[0].size(), static_cast<size_t>(size), plan.op, "output tensors");
  const at::Tensor& input = inputs[0];
  checkTensor(input, input, plan.op, "the input");
  for (int peer = 0; peer < size; ++peer) {
    const at::Tensor& piece = outputs[0][peer];
    checkTensor(piece, input, plan.op, "an output");
    checkSameNumel(piece, input.numel(), plan.op, "an output");
    exchangeWith(plan, rank, peer, input, piece);
  }
  plan.outputs = outputs[0];
  return plan;
}

CollectivePlan planAllToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                  const std::vector<int64_t>& outputSplits,
                                  const std::vector<int64_t>& inputSplits, int rank, int size) {
  CollectivePlan plan{"all_to_all_single", Collective::kAllToAll, c10d::OpType::ALLTOALL_BASE};
  checkTensor(input, input, plan.op, "the input");
  checkTensor(output, input, plan.op, "the output");
  const std::vector<at::Tensor> outs =
      splitRows(output, rowsOf(output, outputSplits, size, plan.op, "the output"));
  const std::vector<at::Tensor> ins =
      splitRows(input, rowsOf(input, inputSplits, size, plan.op, "the input"));
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) {
      checkSameNumel(outs[peer], ins[peer].numel(), plan.op, "this rank's own output piece");
    }
    exchangeWith(plan, rank, peer, ins[peer], outs[peer]);
  }
  plan.outputs = {output};
  return plan;
}

CollectivePlan planAllToAll(const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, int rank, int size) {
  CollectivePlan plan{"all_to_all", Collective::kAllToAll, c10d::OpType::ALLTOALL};
  checkCount(inputs.size(), static_cast<size_t>(size), plan.op, "input tensors");
  checkCount(outputs.size(), static_cast<size_t>(size), plan.op, "output tensors");
  const at::Tensor& first = inputs[0];
  for (int peer = 0; peer < size; ++peer) {
    checkTensor(inputs[peer], first, plan.op, "an input");
    checkTensor(outputs[peer], first, plan.op, "an output");
    if (peer == rank) {
      checkSameNumel(outputs[peer], inputs[peer].numel(), plan.op, "this rank's own output");
    }
    exchangeWith(plan, rank, peer, inputs[peer], outputs[peer]);
  }
  plan.outputs = outputs;
  return plan;
}

CollectivePlan planBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank,
                             int size) {
  CollectivePlan plan{"broadcast", Collective::kBroadcast, c10d::OpType::BROADCAST};
  checkCount(tensors.size(), 1, plan.op, "tensor (one device per rank)");
  checkRoot(root, size, plan.op);
  const at::Tensor& tensor = tensors[0];
  checkTensor(tensor, tensor, plan.op, "the tensor");
  if (rank == root) {
    for (int peer = 0; peer < size; ++peer) {
      if (peer != rank) plan.sends.push_back({peer, tensor});
    }
  } else {
    plan.recvs.push_back({root, tensor});
  }
  plan.outputs = tensors;
  return plan;
}

namespace {

// Gather (`gathering`) and scatter: this rank's one tensor, `mine`, against the root's list of a
// piece per rank, `lists` (empty elsewhere). The root keeps its own piece and moves the others
// in (gather) or out (scatter); every other rank moves `mine` to or from the root.
void planRooted(CollectivePlan& plan, const std::vector<std::vector<at::Tensor>>& lists,
                const at::Tensor& mine, int root, int rank, int size, bool gathering) {
  checkRoot(root, size, plan.op);
  checkTensor(mine, mine, plan.op, gathering ? "the input" : "the output");
  const char* listed = gathering ? "outputs" : "inputs";
  std::vector<Piece>& out = gathering ? plan.sends : plan.recvs;
  std::vector<Piece>& in = gathering ? plan.recvs : plan.sends;
  if (rank != root) {
    TORCH_CHECK_VALUE(lists.empty() || (lists.size() == 1 && lists[0].empty()), "smfree: ",
                      plan.op, ": only the root (rank ", root, ") takes ", listed);
    out.push_back({root, mine});
    return;
  }
  checkCount(lists.size(), 1, plan.op,
             c10::str(listed, " list at the root (one device per rank)").c_str());
  checkCount(lists[0].size(), static_cast<size_t>(size), plan.op,
             c10::str(listed, " at the root").c_str());
  for (int peer = 0; peer < size; ++peer) {
    const at::Tensor& piece = lists[0][peer];
    checkTensor(piece, mine, plan.op, gathering ? "an output" : "an input");
    checkSameNumel(piece, mine.numel(), plan.op, gathering ? "an output" : "an input");
    if (peer == rank) {
      keep(plan, rank, gathering ? mine : piece, gathering ? piece : mine);
    } else {
      in.push_back({peer, piece});
    }
  }
}

}  // namespace

CollectivePlan planGather(const std::vector<std::vector<at::Tensor>>& outputs,
                          const std::vector<at::Tensor>& inputs, int root, int rank, int size) {
  CollectivePlan plan{"gather", Collective::kGather, c10d::OpType::GATHER};
  checkCount(inputs.size(), 1, plan.op, "input tensor (one device per rank)");
  planRooted(plan, outputs, inputs[0], root, rank, size, true);
  if (rank == root) plan.outputs = outputs[0];
  return plan;
}

CollectivePlan planScatter(const std::vector<at::Tensor>& outputs,
                           const std::vector<std::vector<at::Tensor>>& inputs, int root, int rank,
                           int size) {
  CollectivePlan plan{"scatter", Collective::kScatter, c10d::OpType::SCATTER};
  checkCount(outputs.size(), 1, plan.op, "output tensor (one device per rank)");
  planRooted(plan, inputs, outputs[0], root, rank, size, false);
  plan.outputs = outputs;
  return plan;
}

}  // namespace smfree
