#include "engine/channels/ucx/UcxChannel.h"

#include <cstring>
#include <optional>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {

struct UcxChannel::Transfer {
  UcxChannel* channel;
  std::shared_ptr<Op> op;
  std::shared_ptr<cuda::PinnedMemory> host;  // what UCX moves instead of a staged op's buffer
  // Set while the posting call runs: UCX may complete the request inside that call.
  bool* finishedWhilePosting = nullptr;
};

namespace {

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

ucs_memory_type_t memoryType(const Buffer& buffer) {
  return buffer.memory == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

Status abandoned(const Op& op) {
  return Status::failure(StatusCode::kAborted, concat(op.describe(), " was cancelled"));
}

Status transportFailure(const Op& op, ucs_status_t status) {
  return Status::failure(StatusCode::kTransport,
                         concat("UCX failed ", op.describe(), ": ", ucxStatusText(status)));
}

// UCX's CUDA transports work in the current context: the buffer's device's primary one.
void enterContextOf(const Buffer& buffer, std::optional<cuda::ContextGuard>& context) {
  if (buffer.memory == MemoryKind::kCuda) context.emplace(buffer.device);
}

}  // namespace

UcxChannel::UcxChannel(UcxWorker& worker, const cuda::FlagSegment& flags, Done onDone)
    : worker_(worker), flags_(flags), onDone_(std::move(onDone)) {}

ucp_request_param_t UcxChannel::requestParams(Transfer& transfer) const {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.user_data = &transfer;
  params.memory_type =
      transfer.host ? UCS_MEMORY_TYPE_HOST : memoryType(transfer.op->request.buffer);
  return params;
}

bool UcxChannel::streamReached(const Op& op) const {
  return !op.streamReady || flags_.isSet(*op.streamReady);
}

bool UcxChannel::stagesThroughHost(const Op& op, Peer& peer) {
  const Buffer& buffer = op.request.buffer;
  if (buffer.memory != MemoryKind::kCuda || buffer.bytes == 0 || !peer.endpoint) return false;
  auto [decision, first] = stagingDecisions_.try_emplace(&peer, false);
  if (first) decision->second = onlyTcpToward(peer);
  return decision->second;
}

bool UcxChannel::onlyTcpToward(const Peer& peer) const {
  const auto transports = peer.endpoint->transports();
  if (!transports) {
    logOnce("ucx-transports-unknown",
            "this UCX cannot list an endpoint's transports (UCX < 1.14): CUDA tensors go to "
            "UCX as they are, also where it copies them in small pieces (TCP)");
    return false;
  }
  bool tcpOnly = !transports->empty();
  std::string names;
  for (const std::string& transport : *transports) {
    tcpOnly = tcpOnly && transport.rfind("tcp/", 0) == 0;
    names += (names.empty() ? "" : ", ") + transport;
  }
  if (tcpOnly) {
    log(LogLevel::kInfo, "UCX reaches ", peer.describe(), " over TCP only (", names,
        "), where it copies CUDA memory in small pieces: CUDA tensors to and from it go through "
        "pinned host memory, copied by copy engines");
  }
  return tcpOnly;
}

std::string UcxChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source) {
  const ucp_tag_t tag = recv->id;
  if (stagesThroughHost(*recv, source)) {
    const Buffer& buffer = recv->request.buffer;
    postRecv(recv, tag, staging_.take(buffer.device, buffer.bytes));
  } else if (streamReached(*recv)) {
    postRecv(recv, tag, nullptr);
  } else {
    ++recv->outstanding;  // the buffer is promised to UCX
    waiting_.push_back(Waiting{recv, nullptr, tag});
  }
  std::string channelData(sizeof(tag), '\0');
  std::memcpy(channelData.data(), &tag, sizeof(tag));
  return channelData;
}

template <typename Call>
ucs_status_t UcxChannel::post(const std::shared_ptr<Op>& op,
                              std::shared_ptr<cuda::PinnedMemory> host, Call&& call) {
  auto transfer = std::make_unique<Transfer>(Transfer{this, op, std::move(host)});
  bool finishedWhilePosting = false;
  transfer->finishedWhilePosting = &finishedWhilePosting;
  ucp_request_param_t params = requestParams(*transfer);
  std::optional<cuda::ContextGuard> context;
  if (!transfer->host) enterContextOf(op->request.buffer, context);
  if (context) cudaDevice_ = op->request.buffer.device;
  ++op->outstanding;  // before the call, which may already run the completion callback
  Transfer* owned = transfer.release();  // owned by the request until its callback
  void* request = call(params);
  if (UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<Transfer> back(owned);  // no callback will come
    --op->outstanding;
    return UCS_PTR_STATUS(request);
  }
  if (!finishedWhilePosting) {
    owned->finishedWhilePosting = nullptr;
    op->transportRequest = request;
  }
  return UCS_OK;
}

void UcxChannel::postRecv(const std::shared_ptr<Op>& recv, ucp_tag_t tag,
                          std::shared_ptr<cuda::PinnedMemory> host) {
  void* data = host ? host->data() : recv->request.buffer.data;
  const ucs_status_t status = post(recv, std::move(host), [&](ucp_request_param_t& params) {
    params.cb.recv = &UcxChannel::onReceived;
    return ucp_tag_recv_nbx(worker_.handle(), data, recv->request.buffer.bytes, tag, kFullMask,
                            &params);
  });
  if (status != UCS_OK) {
    fail("UCX could not post ", recv->describe(), ": ", ucxStatusText(status));
  }
}

void UcxChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                           const std::string& channelData) {
  ucp_tag_t tag = 0;
  if (channelData.size() != sizeof(tag)) {
    onDone_(send, Status::failure(StatusCode::kTransport,
                                  concat("malformed clear-to-send for ", send->describe())));
    return;
  }
  std::memcpy(&tag, channelData.data(), sizeof(tag));
  if (streamReached(*send)) {
    postSend(send, destination, tag);
  } else {
    ++send->outstanding;  // the buffer is promised to UCX
    waiting_.push_back(Waiting{send, &destination, tag});
  }
}

void UcxChannel::postSend(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag) {
  if (stagesThroughHost(*send, destination)) {
    copyOut(send, destination, tag);
  } else {
    transmit(send, destination, tag, nullptr);
  }
}

void UcxChannel::transmit(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag,
                          std::shared_ptr<cuda::PinnedMemory> host) {
  const void* data = host ? host->data() : send->request.buffer.data;
  const ucs_status_t status = post(send, std::move(host), [&](ucp_request_param_t& params) {
    params.cb.send = &UcxChannel::onSent;
    return ucp_tag_send_nbx(destination.endpoint->handle(), data, send->request.buffer.bytes,
                            tag, &params);
  });
  if (status != UCS_OK) {
    onDone_(send, transportFailure(*send, status));
  }
}

void UcxChannel::copyOut(const std::shared_ptr<Op>& send, Peer& destination, ucp_tag_t tag) {
  const Buffer& buffer = send->request.buffer;
  try {
    std::shared_ptr<cuda::PinnedMemory> host = staging_.take(buffer.device, buffer.bytes);
    std::shared_ptr<cuda::Event> copied = staging_.copyToHost(buffer, *host);
    ++send->outstanding;  // the copy reads the buffer
    staged_.push_back(Staged{send, std::move(host), std::move(copied), &destination, tag});
    ++hostStagedSends_;
  } catch (const Error& error) {
    onDone_(send, Status::failure(StatusCode::kTransport,
                                  concat(send->describe(), ": ", error.what())));
  }
}

bool UcxChannel::progress() {
  const bool posted = advanceWaiting();
  return advanceStaged() || posted;
}

bool UcxChannel::advanceWaiting() {
  bool posted = false;
  for (size_t i = 0; i < waiting_.size();) {
    if (!streamReached(*waiting_[i].op)) {
      ++i;
      continue;
    }
    Waiting ready = std::move(waiting_[i]);
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    --ready.op->outstanding;
    posted = true;
    if (ready.destination) {
      postSend(ready.op, *ready.destination, ready.tag);
      continue;
    }
    try {
      postRecv(ready.op, ready.tag, nullptr);
    } catch (const Error& error) {
      onDone_(ready.op, Status::failure(StatusCode::kTransport, error.what()));
    }
  }
  return posted;
}

bool UcxChannel::advanceStaged() {
  bool advanced = false;
  for (size_t i = 0; i < staged_.size();) {
    Staged& staged = staged_[i];
    const bool failed = staged.op->finished();
    if (!staged.copied && !failed) {
      // A landed recv: copied in once its stream no longer uses the buffer.
      if (streamReached(*staged.op)) {
        try {
          staged.copied = staging_.copyToDevice(*staged.host, staged.op->request.buffer);
          ++hostStagedRecvs_;
          advanced = true;
        } catch (const Error& error) {
          std::shared_ptr<Op> op = std::move(staged.op);
          staged_.erase(staged_.begin() + static_cast<std::ptrdiff_t>(i));
          --op->outstanding;
          onDone_(op, Status::failure(StatusCode::kTransport,
                                      concat(op->describe(), ": ", error.what())));
          continue;
        }
      }
      ++i;
      continue;
    }
    if (staged.copied && !staged.copied->reached()) {
      ++i;
      continue;
    }
    Staged done = std::move(staged);
    staged_.erase(staged_.begin() + static_cast<std::ptrdiff_t>(i));
    --done.op->outstanding;
    advanced = true;
    if (failed) {
      onDone_(done.op, abandoned(*done.op));  // releases it: its outcome is already told
    } else if (done.destination) {
      transmit(done.op, *done.destination, done.tag, std::move(done.host));
    } else {
      onDone_(done.op, Status::success());
    }
  }
  return advanced;
}

void UcxChannel::cancel(Op& op) {
  if (op.transportRequest) {
    ucp_request_cancel(worker_.handle(), op.transportRequest);
    return;
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->op.get() != &op) continue;
    std::shared_ptr<Op> cancelled = std::move(it->op);
    waiting_.erase(it);
    --cancelled->outstanding;
    onDone_(cancelled, abandoned(*cancelled));
    return;
  }
  // Staged ops end in advanceStaged(): at once unless a copy still touches the buffer.
}

void UcxChannel::finish(Transfer& transfer, void* request, const Status& status) {
  Op& op = *transfer.op;
  if (transfer.finishedWhilePosting) *transfer.finishedWhilePosting = true;
  op.transportRequest = nullptr;
  --op.outstanding;
  ucp_request_free(request);
  if (status.ok() && transfer.host && !op.isSend()) {
    ++op.outstanding;  // promised to the copy in
    staged_.push_back(Staged{transfer.op, std::move(transfer.host), nullptr, nullptr, 0});
    return;
  }
  onDone_(transfer.op, status);
}

void UcxChannel::onSent(void* request, ucs_status_t status, void* userData) {
  std::unique_ptr<Transfer> transfer(static_cast<Transfer*>(userData));
  const Status result =
      status == UCS_OK ? Status::success() : transportFailure(*transfer->op, status);
  transfer->channel->finish(*transfer, request, result);
}

void UcxChannel::onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* userData) {
  std::unique_ptr<Transfer> transfer(static_cast<Transfer*>(userData));
  const Op& op = *transfer->op;
  Status result = Status::success();
  if (status != UCS_OK) {
    result = transportFailure(op, status);
  } else if (info->length != op.request.buffer.bytes) {
    result = Status::failure(StatusCode::kTransport,
                             concat(op.describe(), " received ", info->length, " B"));
  }
  transfer->channel->finish(*transfer, request, result);
}

}  // namespace smfree::engine
