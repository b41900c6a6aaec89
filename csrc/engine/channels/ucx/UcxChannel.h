#pragma once

#include "engine/Channel.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Moves bytes with UCX tag send/recv straight between the users' buffers. The receiver posts
// its recv under a tag it owns (its op id) before it clears the sender, so the data never
// lands in UCX's unexpected queue.
class UcxChannel final : public Channel {
 public:
  UcxChannel(UcxWorker& worker, Done onDone);

  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;

 private:
  struct Transfer;
  static void onSent(void* request, ucs_status_t status, void* userData);
  static void onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* userData);
  void finish(Transfer& transfer, void* request, const Status& status);
  ucp_request_param_t requestParams(Transfer& transfer) const;

  UcxWorker& worker_;
  Done onDone_;
};

}  // namespace smfree::engine
