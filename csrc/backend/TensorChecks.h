#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "engine/TensorDesc.h"

namespace smfree {

// Validates the one tensor of a point-to-point op; throws ValueError naming the problem.
at::Tensor& checkP2PTensor(std::vector<at::Tensor>& tensors, const char* op);
// Throws ValueError unless `peer` is a rank of a group of `size` (this rank itself included).
void checkPeer(int peer, int size, const char* op);
// Throws ValueError for a tag below 0: those are smfree's own (engine::kCollectiveTag).
void checkTag(int tag, const char* op);
engine::TensorDesc describeTensor(const at::Tensor& tensor);

}  // namespace smfree
