// The RDMA transport's device lifecycle (rdma_device.h).
#include "daemon/transport/rdma/rdma_device.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"

namespace epd::transport::rdma {
namespace {

absl::Status Range(absl::string_view name, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rdma ", name, " ", value, " not in [", lo, ", ", hi, "]"));
}

std::string Errno(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

}  // namespace

absl::Status ValidateRdmaOptions(const RdmaTransportOptions& o) {
  if (o.ports.empty()) {
    return absl::InvalidArgumentError("rdma ports: empty (at least one device port is needed)");
  }
  for (size_t i = 0; i < o.ports.size(); ++i) {
    const RdmaPort& p = o.ports[i];
    const std::string what = absl::StrCat("ports[", i, "]");
    if (p.device.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("rdma ", what, ".device: empty"));
    }
    if (p.device.size() >= IBV_SYSFS_NAME_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("rdma ", what, ".device '", p.device,
                                                     "': longer than ", IBV_SYSFS_NAME_MAX - 1,
                                                     " characters"));
    }
    if (const absl::Status s = Range(what + ".port", p.port, 1, 255); !s.ok()) return s;
    if (const absl::Status s = Range(what + ".gid_index", p.gid_index, 0, 255); !s.ok()) return s;
    for (int d : p.cuda_devices) {
      if (const absl::Status s = Range(what + ".cuda_devices entry", d, 0, 1023); !s.ok()) {
        return s;
      }
    }
    for (size_t j = 0; j < i; ++j) {
      if (o.ports[j].device == p.device && o.ports[j].port == p.port) {
        return absl::InvalidArgumentError(absl::StrCat("rdma ", what, ": device ", p.device,
                                                       " port ", p.port, " is listed twice"));
      }
    }
  }
  if (const absl::Status s = Range("service_level", o.service_level, 0, 15); !s.ok()) return s;
  if (const absl::Status s = Range("traffic_class", o.traffic_class, 0, 255); !s.ok()) return s;
  if (const absl::Status s = Range("timeout", o.timeout, 1, 31); !s.ok()) return s;
  if (const absl::Status s = Range("retry_count", o.retry_count, 0, 7); !s.ok()) return s;
  if (const absl::Status s = Range("rnr_retry", o.rnr_retry, 0, 7); !s.ok()) return s;
  if (const absl::Status s = Range("qps_per_peer", o.qps_per_peer, 1, 16); !s.ok()) return s;
  if (const absl::Status s = Range("max_send_wr", o.max_send_wr, 2, 1 << 20); !s.ok()) return s;
  if (const absl::Status s = Range("cq_depth", o.cq_depth, 8, 1 << 24); !s.ok()) return s;
  if (const absl::Status s = Range("connect_timeout_ms", o.connect_timeout_ms, 1, 3600 * 1000);
      !s.ok()) {
    return s;
  }
  if (o.mtu != 0 && !MtuFromBytes(o.mtu).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma mtu ", o.mtu, ": must be 0 (the port's) or 256, 512, 1024, 2048, 4096"));
  }
  switch (o.gpudirect) {
    case GpuDirectMode::kAuto:
    case GpuDirectMode::kOn:
    case GpuDirectMode::kOff:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rdma gpudirect ", static_cast<int>(o.gpudirect), ": not auto, on or off"));
  }
  return absl::OkStatus();
}

absl::StatusOr<QueuePlan> PlanQueues(const RdmaTransportOptions& o, const DeviceCaps& caps) {
  QueuePlan plan;
  plan.cq_depth = std::min(o.cq_depth, caps.max_cqe);
  uint32_t per_queue = std::min(o.max_send_wr, caps.max_qp_wr);
  const uint32_t qps = std::max<uint32_t>(o.qps_per_peer, 1);
  // Each queue pair brings send_wr signalled completions at most and recv_wr receive ones.
  per_queue = std::min<uint64_t>(per_queue, plan.cq_depth / (2ull * qps));
  if (per_queue < 2) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "rdma: queues too small: max_send_wr ", o.max_send_wr, " (device max_qp_wr ",
            caps.max_qp_wr, "), cq_depth ", o.cq_depth, " (device max_cqe ", caps.max_cqe, ") for ",
            qps, " queue pairs per peer leave ", per_queue,
            " work requests per queue; raise cq_depth or lower qps_per_peer")),
        errors::Reason::kRdmaUnavailable);
  }
  plan.send_wr = per_queue;
  plan.recv_wr = per_queue;
  plan.cq_depth = static_cast<uint32_t>(2ull * qps * per_queue);
  plan.signal_every = std::max<uint32_t>(1, std::min<uint32_t>(64, per_queue / 4));
  return plan;
}

absl::StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes) {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    case 4096:
      return IBV_MTU_4096;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("mtu ", bytes, " bytes: not 256, 512, 1024, 2048 or 4096"));
  }
}

uint32_t MtuBytes(int mtu) { return mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096 ? 128u << mtu : 0u; }

absl::StatusOr<ibv_mtu> ChooseMtu(uint32_t option_bytes, ibv_mtu active, const std::string& where) {
  if (option_bytes == 0) return active;
  absl::StatusOr<ibv_mtu> mtu = MtuFromBytes(option_bytes);
  if (!mtu.ok()) return absl::InvalidArgumentError(absl::StrCat("rdma ", mtu.status().message()));
  if (*mtu > active) {
    return absl::InvalidArgumentError(absl::StrCat("rdma mtu ", option_bytes, " exceeds ", where,
                                                   "'s active MTU of ", MtuBytes(active),
                                                   " bytes"));
  }
  return *mtu;
}

absl::StatusOr<std::unique_ptr<RdmaDevice>> OpenRdmaDevice(const std::string& name) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr || num == 0) {
    const int err = errno;
    if (list != nullptr) ibv_free_device_list(list);
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            "rdma device '", name, "': no RDMA device: ibv_get_device_list returned 0 devices",
            list == nullptr ? absl::StrCat(" (", Errno(err), ")") : std::string(),
            "; use transport \"tcp\" on this machine")),
        errors::Reason::kRdmaUnavailable);
  }
  std::vector<std::string> found;
  ibv_device* match = nullptr;
  for (int i = 0; i < num; ++i) {
    const char* n = ibv_get_device_name(list[i]);
    found.emplace_back(n != nullptr ? n : "?");
    if (found.back() == name) match = list[i];
  }
  auto dev = std::make_unique<RdmaDevice>();
  dev->name_ = name;
  if (match != nullptr) dev->context_.reset(ibv_open_device(match));
  const int open_err = errno;
  ibv_free_device_list(list);
  if (match == nullptr) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            "rdma device '", name, "' not found; devices here: ", absl::StrJoin(found, ", "))),
        errors::Reason::kRdmaUnavailable);
  }
  if (dev->context_ == nullptr) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                  "rdma device '", name, "': ibv_open_device: ", Errno(open_err))),
                              errors::Reason::kRdmaUnavailable);
  }
  ibv_device_attr attr{};
  if (const int rc = ibv_query_device(dev->context(), &attr); rc != 0) {
    return absl::InternalError(
        absl::StrCat("rdma device '", name, "': ibv_query_device: ", Errno(rc > 0 ? rc : errno)));
  }
  dev->caps_.max_qp_wr = static_cast<uint32_t>(std::max(attr.max_qp_wr, 0));
  dev->caps_.max_cqe = static_cast<uint32_t>(std::max(attr.max_cqe, 0));
  dev->caps_.max_qp = static_cast<uint32_t>(std::max(attr.max_qp, 0));
  dev->caps_.max_cq = static_cast<uint32_t>(std::max(attr.max_cq, 0));
  dev->pd_.reset(ibv_alloc_pd(dev->context()));
  if (dev->pd_ == nullptr) {
    return absl::InternalError(
        absl::StrCat("rdma device '", name, "': ibv_alloc_pd: ", Errno(errno)));
  }
  dev->channel_.reset(ibv_create_comp_channel(dev->context()));
  if (dev->channel_ == nullptr) {
    return absl::InternalError(
        absl::StrCat("rdma device '", name, "': ibv_create_comp_channel: ", Errno(errno)));
  }
  const int fd = dev->channel_->fd;
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) {
    return absl::InternalError(
        absl::StrCat("rdma device '", name, "': completion channel O_NONBLOCK: ", Errno(errno)));
  }
  return dev;
}

absl::StatusOr<PortInfo> QueryPort(const RdmaDevice& device, uint32_t port, int32_t gid_index,
                                   uint32_t mtu_bytes) {
  const std::string where = absl::StrCat("rdma device ", device.name(), " port ", port);
  ibv_port_attr attr{};
  if (port < 1 || port > 255 ||
      ibv_query_port(device.context(), static_cast<uint8_t>(port), &attr) != 0) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(where, ": no such port")),
                              errors::Reason::kRdmaUnavailable);
  }
  if (attr.state != IBV_PORT_ACTIVE) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                  where, ": not active (state ", ibv_port_state_str(attr.state),
                                  "): check the cable, the switch and the link")),
                              errors::Reason::kRdmaUnavailable);
  }
  if (gid_index < 0 || gid_index >= attr.gid_tbl_len) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(where, ": gid_index ", gid_index,
                                            " outside its GID table of ", attr.gid_tbl_len)),
        errors::Reason::kRdmaUnavailable);
  }
  PortInfo info;
  info.port = port;
  info.gid_index = gid_index;
  info.link_layer = attr.link_layer;
  info.lid = attr.lid;
  info.active_mtu = attr.active_mtu;
  info.max_msg_sz = attr.max_msg_sz;
  ibv_gid gid{};
  if (ibv_query_gid(device.context(), static_cast<uint8_t>(port), gid_index, &gid) != 0) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(where, ": ibv_query_gid(",
                                                                  gid_index, "): ", Errno(errno))),
                              errors::Reason::kRdmaUnavailable);
  }
  std::memcpy(info.gid.data(), gid.raw, info.gid.size());
  const bool zero = std::all_of(info.gid.begin(), info.gid.end(), [](uint8_t b) { return b == 0; });
  if (info.link_layer == IBV_LINK_LAYER_ETHERNET && zero) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            where, ": GID ", gid_index, " is empty (no address on the interface for that index?)")),
        errors::Reason::kRdmaUnavailable);
  }
  if (info.link_layer != IBV_LINK_LAYER_ETHERNET && info.lid == 0) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                  where, ": InfiniBand port without a LID (no subnet manager?)")),
                              errors::Reason::kRdmaUnavailable);
  }
  absl::StatusOr<ibv_mtu> mtu = ChooseMtu(mtu_bytes, attr.active_mtu, where);
  if (!mtu.ok()) return mtu.status();
  info.mtu = *mtu;
  return info;
}

}  // namespace epd::transport::rdma
