#include "engine/TensorDesc.h"

#include <sstream>

#include "engine/Status.h"

namespace smfree::engine {

std::string TensorDesc::describe() const {
  std::ostringstream out;
  out << dtype << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << "] (" << bytes << " B)";
  if (!device.empty() && device != "cpu") out << " on " << device;
  return out.str();
}

const char* toString(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kMismatch: return "mismatch";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kPeerFailure: return "peer failure";
    case StatusCode::kAborted: return "aborted";
    case StatusCode::kChannel: return "channel error";
  }
  return "unknown";
}

}  // namespace smfree::engine
