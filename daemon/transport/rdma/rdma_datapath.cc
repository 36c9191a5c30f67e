// The RDMA transport's data path, device-free parts (rdma_datapath.h).
#include "daemon/transport/rdma/rdma_datapath.h"

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"

namespace epd::transport::rdma {

absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_err, absl::string_view peer,
                              uint32_t qp, bool receive) {
  if (status == IBV_WC_SUCCESS) return absl::OkStatus();
  const std::string head =
      absl::StrCat(peer, ": queue pair ", qp, receive ? " (receive)" : " (send)", ": ",
                   ibv_wc_status_str(status), " (status ", static_cast<int>(status),
                   ", vendor error 0x", absl::Hex(vendor_err), ")");
  switch (status) {
    case IBV_WC_RETRY_EXC_ERR:
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat(
              head,
              ": no acknowledgement within timeout and retry_count: the peer daemon, its NIC "
              "or the path to it is gone")),
          errors::Reason::kTransportFailed);
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat(
              head,
              ": the peer posted no receive within rnr_retry retries (it stopped taking "
              "immediates)")),
          errors::Reason::kTransportFailed);
    case IBV_WC_WR_FLUSH_ERR:
      return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                    head, ": flushed: the queue pair had already failed")),
                                errors::Reason::kTransportFailed);
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat(head, ": the peer aborted the request")),
          errors::Reason::kTransportFailed);
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return errors::WithReason(
          absl::DataLossError(absl::StrCat(
              head,
              ": the peer refused the write (its receive region or key differs from its "
              "descriptor: a stale descriptor?)")),
          errors::Reason::kPeerProtocol);
    default:
      return absl::InternalError(
          absl::StrCat(head, ": a local error (registration, length or queue pair state)"));
  }
}

}  // namespace epd::transport::rdma
