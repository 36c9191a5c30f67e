// Internal helpers shared by the host ops: a fork-join ParallelFor, token chunking, and
// the argument checks every op performs before it writes anything.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"

namespace epd::kernels::host::internal {

/// Threads to use for `exec`: num_threads, or hardware_concurrency() when it is 0
/// (at least 1).
int ResolveThreads(const HostExecution& exec);

/// Calls fn(i) once for every i in [0, n), on up to `num_threads` threads (the caller is
/// one of them). Indices are handed out dynamically; callers make every index write a
/// disjoint part of the output, so the result does not depend on the thread count or on
/// scheduling. Returns when every call has returned. If a thread cannot be started the
/// remaining threads (at least the caller) do all the work.
void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn);

/// A run of tokens [begin, end) of one rank: the unit of work of the per-token loops.
struct TokenChunk {
  int32_t rank = 0;
  int32_t begin = 0;
  int32_t end = 0;
};

/// Splits every rank's tokens [0, num_tokens[r]) into chunks of at most `grain` tokens
/// (grain >= 1), rank by rank.
std::vector<TokenChunk> SplitTokens(std::span<const int32_t> num_tokens, int32_t grain);

/// Tokens per chunk for rows of `row_bytes` bytes: about 64 KiB of row data per chunk.
int32_t GrainForRowBytes(int64_t row_bytes);

/// Checks the group shape itself: R >= 1, E >= R, E % R == 0, H >= 1, K >= 1, M >= 0,
/// Mll >= 0. INVALID_ARGUMENT naming the field and value otherwise.
absl::Status CheckGroupShape(const GroupShape& shape);

/// INVALID_ARGUMENT when `fp8` and H % 128 != 0 (FP8 needs whole 128-channel blocks).
absl::Status CheckFp8Hidden(const GroupShape& shape, bool fp8, const char* op);

/// INVALID_ARGUMENT unless `num_args` == R.
absl::Status CheckNumRankArgs(const GroupShape& shape, size_t num_args, const char* op);

/// INVALID_ARGUMENT unless 0 <= num_tokens <= capacity (`capacity_name` names the limit).
absl::Status CheckNumTokens(int32_t rank, int32_t num_tokens, int32_t capacity,
                            const char* capacity_name);

/// INVALID_ARGUMENT "<op>: rank <r>: <field> is null" when `needed` and ptr is null.
absl::Status CheckPointer(const void* ptr, bool needed, const char* op, int32_t rank,
                          const char* field);

/// Same as CheckTopkIdx, with `rank` < 0 meaning "rank unknown" (left out of the message).
absl::Status CheckTopkIdxImpl(const GroupShape& shape, int32_t rank, int32_t num_tokens,
                              const int64_t* topk_idx);

/// True when topk_idx[k] also appears at an earlier position of the same row [0, k).
inline bool IsDuplicateInRow(const int64_t* row, int k) {
  for (int j = 0; j < k; ++j) {
    if (row[j] == row[k]) return true;
  }
  return false;
}

}  // namespace epd::kernels::host::internal
