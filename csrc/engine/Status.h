#pragma once

#include <string>
#include <utility>

namespace smfree::engine {

enum class StatusCode {
  kOk,
  kMismatch,      // matched send and recv disagree on bytes or dtype
  kTimeout,       // not matched or not finished within the group timeout
  kPeerFailure,   // the peer process is gone or its endpoint failed
  kAborted,       // the group was aborted or shut down
  kChannel,       // a channel failed to move the bytes
};

// Outcome of one point-to-point op; the message already names op, peer, tag and bytes.
struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status success() { return {}; }
  static Status failure(StatusCode code, std::string message) {
    return Status{code, std::move(message)};
  }
};

const char* toString(StatusCode code);

}  // namespace smfree::engine
