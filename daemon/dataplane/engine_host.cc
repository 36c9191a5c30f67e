// The doorbell page set-up shared by both data planes (see engine_host.h).
#include "daemon/dataplane/engine_host.h"

#include "proto/abi/shm_abi.h"

namespace epd {

absl::StatusOr<ShmRegion> CreateDoorbellPage() {
  auto region = ShmRegion::Create("epd-doorbell", sizeof(abi::DoorbellPage));
  if (!region.ok()) return region.status();
  auto* page = reinterpret_cast<abi::DoorbellPage*>(region->data());
  page->size = sizeof(abi::DoorbellPage);
  page->magic = abi::kDoorbellMagic;
  page->version = abi::kShmAbiVersion;
  return region;
}

}  // namespace epd
