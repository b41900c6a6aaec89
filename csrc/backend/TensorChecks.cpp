#include "backend/TensorChecks.h"

#include <c10/util/Exception.h>

namespace smfree {

at::Tensor& checkP2PTensor(std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "smfree: ", op, " takes exactly one tensor, got ",
                    tensors.size());
  at::Tensor& tensor = tensors[0];
  TORCH_CHECK_VALUE(tensor.defined(), "smfree: ", op, " got an undefined tensor");
  TORCH_CHECK_VALUE(tensor.layout() == at::kStrided, "smfree: ", op,
                    " supports only dense (strided) tensors, got layout ", tensor.layout());
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "smfree: ", op,
                    " needs a contiguous tensor (got sizes ", tensor.sizes(), ", strides ",
                    tensor.strides(), "); call .contiguous() first");
  TORCH_CHECK_VALUE(tensor.device().is_cpu() || tensor.device().is_cuda(), "smfree: ", op,
                    " of a ", tensor.device().type(),
                    " tensor is not supported: smfree moves CPU and CUDA tensors");
  return tensor;
}

void checkPeer(const WorkLabel& label, int size) {
  if (label.peer >= 0 && label.peer < size) return;
  const bool isSend = label.kind == engine::OpKind::kSend;
  TORCH_CHECK_VALUE(false, "smfree: ", isSend ? "send" : "recv", " on rank ", label.rank,
                    isSend ? " to" : " from", " invalid rank ", label.peer, " (group '",
                    *label.group, "' of size ", size, ", tag ", label.tag, ", ", label.bytes,
                    " B)",
                    !isSend && label.peer == engine::kAnySource
                        ? "; a recv from any source is irecv or recv without a source (src=None)"
                        : "");
}

void checkTag(int tag, const char* op) {
  TORCH_CHECK_VALUE(tag >= 0, "smfree: ", op, " with tag ", tag,
                    ": tags below 0 are smfree's own (its collectives' messages)");
}

namespace {

// torch's Python names, as users see them in messages.
std::string dtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    default: return c10::toString(type);
  }
}

}  // namespace

engine::TensorDesc describeTensor(const at::Tensor& tensor) {
  engine::TensorDesc desc;
  desc.bytes = tensor.nbytes();
  desc.dtype = dtypeName(tensor.scalar_type());
  desc.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  desc.device = tensor.device().is_cuda() ? "cuda" : "cpu";
  return desc;
}

}  // namespace smfree
