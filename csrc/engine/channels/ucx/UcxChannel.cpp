#include "engine/channels/ucx/UcxChannel.h"

#include <cstring>
#include <optional>

#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {

struct UcxChannel::Transfer {
  UcxChannel* channel;
  std::shared_ptr<Op> op;
  // Set while the posting call runs: UCX may complete the request inside that call.
  bool* finishedWhilePosting = nullptr;
};

namespace {

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

ucs_memory_type_t memoryType(const Buffer& buffer) {
  return buffer.memory == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
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
  params.memory_type = memoryType(transfer.op->request.buffer);
  return params;
}

bool UcxChannel::streamReached(const Op& op) const {
  return !op.streamReady || flags_.isSet(*op.streamReady);
}

std::string UcxChannel::armRecv(const std::shared_ptr<Op>& recv, Peer&) {
  const ucp_tag_t tag = recv->id;
  if (streamReached(*recv)) {
    postRecv(recv, tag);
  } else {
    ++recv->outstanding;  // the buffer is promised to UCX
    waiting_.push_back(Waiting{recv, nullptr, tag});
  }
  std::string channelData(sizeof(tag), '\0');
  std::memcpy(channelData.data(), &tag, sizeof(tag));
  return channelData;
}

template <typename Call>
ucs_status_t UcxChannel::post(const std::shared_ptr<Op>& op, Call&& call) {
  auto transfer = std::make_unique<Transfer>(Transfer{this, op});
  bool finishedWhilePosting = false;
  transfer->finishedWhilePosting = &finishedWhilePosting;
  ucp_request_param_t params = requestParams(*transfer);
  std::optional<cuda::ContextGuard> context;
  enterContextOf(op->request.buffer, context);
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

void UcxChannel::postRecv(const std::shared_ptr<Op>& recv, ucp_tag_t tag) {
  const ucs_status_t status = post(recv, [&](ucp_request_param_t& params) {
    params.cb.recv = &UcxChannel::onReceived;
    return ucp_tag_recv_nbx(worker_.handle(), recv->request.buffer.data,
                            recv->request.buffer.bytes, tag, kFullMask, &params);
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
  const ucs_status_t status = post(send, [&](ucp_request_param_t& params) {
    params.cb.send = &UcxChannel::onSent;
    return ucp_tag_send_nbx(destination.endpoint->handle(), send->request.buffer.data,
                            send->request.buffer.bytes, tag, &params);
  });
  if (status != UCS_OK) {
    onDone_(send, transportFailure(*send, status));
  }
}

bool UcxChannel::progress() {
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
      postRecv(ready.op, ready.tag);
    } catch (const Error& error) {
      onDone_(ready.op, Status::failure(StatusCode::kTransport, error.what()));
    }
  }
  return posted;
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
    onDone_(cancelled, Status::failure(StatusCode::kAborted,
                                       concat(cancelled->describe(), " was cancelled")));
    return;
  }
}

void UcxChannel::finish(Transfer& transfer, void* request, const Status& status) {
  Op& op = *transfer.op;
  if (transfer.finishedWhilePosting) *transfer.finishedWhilePosting = true;
  op.transportRequest = nullptr;
  --op.outstanding;
  ucp_request_free(request);
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
