#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "backend/SmFreeWork.h"
#include "engine/TensorDesc.h"

namespace smfree {

// Validates the one tensor of a point-to-point op; throws ValueError naming the problem.
at::Tensor& checkP2PTensor(std::vector<at::Tensor>& tensors, const char* op);
// Throws ValueError, naming the call, unless `label.peer` is a rank of a group of `size` (this
// rank itself included). A recv from any source (kAnySource) comes only through torch's
// recvAnysource, which does not call this: a -1 anywhere else is a bad rank, not a wildcard.
void checkPeer(const WorkLabel& label, int size);
// Throws ValueError for a tag below 0: those are smfree's own (engine::kCollectiveTag).
void checkTag(int tag, const char* op);
engine::TensorDesc describeTensor(const at::Tensor& tensor);

}  // namespace smfree
