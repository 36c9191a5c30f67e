// Validation of what a client asks at JoinGroup (DESIGN.md §1, §3.4): the group
// spec, the rank, the fit of the buffers in memory, and the comparison of a joiner's spec
// with the live group's. Every error names the field and the value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/client_text.h"
#include "epd/v1/control.pb.h"

namespace epd {

/// Upper bounds that keep every buffer size computed from a spec (EndpointLayout, 64-bit
/// bytes) far from overflow: the largest region, El·R·Mll·H·2 bytes, stays below 2^54.
/// They are not model limits: DeepSeek-V3 (E=256, H=7168, K=8) sits far inside them.
inline constexpr int32_t kMaxGroupNameBytes = 64;
inline constexpr int32_t kMaxRanks = 4096;
inline constexpr int32_t kMaxExperts = 1 << 16;
inline constexpr int32_t kMaxHidden = 1 << 16;
inline constexpr int32_t kMaxTokensPerRank = 1 << 20;
/// Channels per FP8 scale: hidden must be a multiple of it when use_fp8.
inline constexpr int32_t kFp8HiddenMultiple = 128;

/// Checks every field of `spec` (an error echoes the name through EscapeClientText):
///   name               [A-Za-z0-9_.-]{1,64}
///   num_ranks          1 <= R <= kMaxRanks
///   num_experts        1 <= E <= kMaxExperts and E % R == 0
///   hidden             1 <= H <= kMaxHidden, and H % 128 == 0 when use_fp8
///   num_topk           1 <= K <= E (no other cap: K = 128 and more are allowed)
///   max_tokens_per_rank 1 <= M <= kMaxTokensPerRank
///   ll_max_tokens_per_rank 0 <= Mll <= kMaxTokensPerRank (0 = low-latency disabled)
///   on_rank_failure    a RankFailurePolicy value
///   nodes              empty (a one-node group), or 1 to kMaxNodes entries, each with a
///                      well-formed peer_address (PeerAddressIsWellFormed), all distinct,
///                      and num_ranks >= 1 summing to num_ranks. One entry is allowed and
///                      is a one-node group (no Peer service involved).
/// Returns INVALID_ARGUMENT "spec.<field>: <value> ..." for the first failing rule.
absl::Status ValidateGroupSpec(const v1::GroupSpec& spec);

/// Most nodes a spec may list.
inline constexpr int32_t kMaxNodes = 4096;
/// Longest NodeSpec.peer_address, in bytes.
inline constexpr size_t kMaxPeerAddressBytes = 255;

/// Whether `address` is "host:port" with a port 1..65535 and a host that is a DNS name
/// ([A-Za-z0-9.-], not starting with '-' or '.'), or an IPv6 address in brackets.
bool PeerAddressIsWellFormed(absl::string_view address);

/// Whether `spec` spans nodes (lists at least two).
inline bool SpansNodes(const v1::GroupSpec& spec) { return spec.nodes_size() >= 2; }

/// The node hosting `rank` of a spec that passed ValidateGroupSpec with nodes listed, and
/// that node's first rank; -1 when `rank` is out of range.
int32_t NodeOfRank(const v1::GroupSpec& spec, int32_t rank, int32_t* first_rank = nullptr);

/// The limits of `backend` ("host" or "cuda") on a spec that passed ValidateGroupSpec, so
/// that every spec Join accepts works on the daemon's backend: none on "host"; on "cuda"
/// (one node or across nodes alike) kernels/cuda's (epd/kernels/cuda_limits.h CheckCudaShape:
/// num_ranks <= 64, and num_experts within the sync region's normal-mode state and, with
/// low-latency mode on, its count exchange; no limit on ll_max_tokens_per_rank, num_topk or
/// hidden). Returns INVALID_ARGUMENT "spec.<field>: <value> ..." naming the largest value that
/// works there.
absl::Status ValidateGroupSpecForBackend(const v1::GroupSpec& spec, absl::string_view backend);

/// Whether `backend` ("host" or "cuda") runs spec.on_rank_failure for a group of
/// `launch_mode` (the group's, resolved): MASK needs a one-node group, on the host backend,
/// or on the CUDA backend daemon-launched (a masked rank's kernels must still run, and no
/// one launches a dead client's). FAILED_PRECONDITION naming on_rank_failure (and
/// launch_mode) and the reason; OK for FAIL (or unspecified).
absl::Status CheckRankFailurePolicy(const v1::GroupSpec& spec, absl::string_view backend,
                                    v1::LaunchMode launch_mode = v1::LAUNCH_MODE_DAEMON);

/// Checks 0 <= rank < spec.num_ranks. INVALID_ARGUMENT naming the rank and the range.
absl::Status ValidateRank(const v1::GroupSpec& spec, int32_t rank);

/// RESOURCE_EXHAUSTED when `bytes_needed` (one rank's buffers) exceeds `bytes_free` on
/// `where` (a GPU UUID, or host memory); the message gives both byte counts.
absl::Status CheckBuffersFit(const v1::GroupSpec& spec, uint64_t bytes_needed, uint64_t bytes_free,
                             const std::string& where);

/// The fields whose values differ between `live` and `requested`, each as
/// "field: live=<v> requested=<v>", in field-number order (on_rank_failure unspecified
/// compares equal to FAIL). Empty when equal.
std::vector<std::string> DiffGroupSpecs(const v1::GroupSpec& live, const v1::GroupSpec& requested);

/// FAILED_PRECONDITION listing every differing field (DiffGroupSpecs), or OK when equal.
absl::Status CheckSameSpec(const v1::GroupSpec& live, const v1::GroupSpec& requested);

/// One-line summary of a spec for logs: "name R=.. E=.. H=.. K=.. M=.. fp8=.. Mll=..".
std::string SpecSummary(const v1::GroupSpec& spec);

}  // namespace epd
