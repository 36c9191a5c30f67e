// The DLPack dtypes of epd's tensors (client.h "Dtypes"), named once for every test. FP8
// data is epd::kDLFloat8E4m3fn (epd/client.h).
#pragma once

#include <dlpack/dlpack.h>

namespace epd::testing {

inline constexpr DLDataType kBf16{kDLBfloat, 16, 1};  // x, recv_x, combine's y.
inline constexpr DLDataType kF32{kDLFloat, 32, 1};    // topk_weights, FP8 scales.
inline constexpr DLDataType kI64{kDLInt, 64, 1};      // topk_idx.
inline constexpr DLDataType kI32{kDLInt, 32, 1};      // counts, num_tokens.
inline constexpr DLDataType kU8{kDLUInt, 8, 1};       // is_token_in_rank.

}  // namespace epd::testing
