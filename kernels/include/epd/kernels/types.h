// Scalar formats shared by the host reference and the CUDA kernels: bf16 and FP8 e4m3
// bit conversions, and the per-128-channel FP8 scale rule. Host and device compute the
// same bits from these functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EPD_HD __host__ __device__ __forceinline__
#else
#define EPD_HD inline
#endif

namespace epd::kernels {

/// Channels that share one FP8 scale (DeepEP / DeepGEMM per-token, per-128-channel
/// scaling: one f32 scale for each run of 128 channels of a token).
inline constexpr int kFp8BlockChannels = 128;
/// Largest finite e4m3 magnitude (OCP FP8 spec, "E4M3FN").
inline constexpr float kFp8E4m3Max = 448.0f;
/// amax is floored at this before computing a scale, so an all-zero block has a finite,
/// non-zero scale (DeepEP uses the same floor in its low-latency FP8 cast).
inline constexpr float kFp8AmaxFloor = 1e-4f;

/// bf16 stored as its 16 raw bits.
using bf16_bits = uint16_t;
/// FP8 e4m3 (E4M3FN) stored as its 8 raw bits.
using e4m3_bits = uint8_t;

EPD_HD float FloatFromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
EPD_HD uint32_t BitsFromFloat(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

/// bf16 → f32 (exact).
EPD_HD float Bf16ToFloat(bf16_bits b) { return FloatFromBits(static_cast<uint32_t>(b) << 16); }

/// f32 → bf16, round to nearest even; NaN stays NaN (quiet). Same result as
/// `__float2bfloat16_rn`.
EPD_HD bf16_bits FloatToBf16(float f) {
  uint32_t u = BitsFromFloat(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((u >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>((u + rounding) >> 16);
}

/// e4m3 (E4M3FN: bias 7, no infinities, 0x7f/0xff = NaN) → f32 (exact).
EPD_HD float E4m3ToFloat(e4m3_bits v) {
  uint32_t sign = (v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xfu;
  uint32_t man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return FloatFromBits(sign | 0x7fc00000u);
  if (exp == 0) {
    // Subnormal: man * 2^-9.
    float mag = static_cast<float>(man) * 0.001953125f;
    return sign ? -mag : mag;
  }
  return FloatFromBits(sign | ((exp + 120u) << 23) | (man << 20));
}

/// f32 → e4m3, round to nearest even, saturating to ±448 (the `satfinite` behaviour of
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`); NaN → 0x7f.
EPD_HD e4m3_bits FloatToE4m3(float f) {
  uint32_t u = BitsFromFloat(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;          // NaN
  if (abs >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and inf): saturate
  int exp = static_cast<int>(abs >> 23) - 127;
  if (exp < -6) {
    // Subnormal range of e4m3: quantum 2^-9. Round |f| / 2^-9 to nearest even.
    float mag = FloatFromBits(abs) * 512.0f;  // exact scaling by a power of two
    float fl = floorf(mag);
    float rem = mag - fl;
    uint32_t q = static_cast<uint32_t>(fl);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    // q == 8 becomes the smallest normal (exp field 1, man 0) = 0x08: same encoding.
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  uint32_t man = abs & 0x7fffffu;
  uint32_t keep = man >> 20;
  uint32_t rest = man & 0xfffffu;
  uint32_t e = static_cast<uint32_t>(exp + 7);
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) {
    ++keep;
    if (keep == 8) {
      keep = 0;
      ++e;
    }
  }
  if (e > 15 || (e == 15 && keep == 7)) return sign | 0x7e;  // rounds past 448: saturate
  return sign | static_cast<uint8_t>((e << 3) | keep);
}

/// The FP8 scale of one 128-channel block: `max(amax, 1e-4) / 448`, or, with
/// `round_scale` (DeepEP's `round_scale` / UE8M0-friendly scales), that value rounded up
/// to a power of two: `2^ceil(log2(max(amax,1e-4)/448))`. Values are stored as
/// `e4m3(x / scale)`; the dequantized value is `e4m3 * scale`.
EPD_HD float Fp8Scale(float amax, bool round_scale) {
  float a = amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor;
  float s = a / kFp8E4m3Max;
  if (!round_scale) return s;
  // Round up to a power of two using the exponent bits (exact, no libm).
  uint32_t u = BitsFromFloat(s);
  if ((u & 0x7fffffu) != 0) u = (u & 0xff800000u) + 0x800000u;
  return FloatFromBits(u & 0xff800000u);
}

/// Channels per int32 word of UE8M0-packed scales: four 128-channel blocks (DeepEP's
/// use_ue8m0, which needs hidden % kUe8m0WordChannels == 0).
inline constexpr int32_t kUe8m0WordChannels = 512;
/// Scale blocks per int32 word of UE8M0-packed scales; block 4j + i is byte i (from the
/// least significant) of word j.
inline constexpr int32_t kUe8m0BlocksPerWord = 4;

/// The UE8M0 code of a power-of-two scale (Fp8Scale with round_scale): the f32's biased
/// exponent byte, so the scale is 2^(code - 127).
EPD_HD uint8_t Ue8m0Code(float scale) {
  return static_cast<uint8_t>((BitsFromFloat(scale) >> 23) & 0xffu);
}

/// Quantizes one value with its block's scale. Uses a true division (not a reciprocal
/// multiply) so host and device round identically.
EPD_HD e4m3_bits QuantizeE4m3(float x, float scale) { return FloatToE4m3(x / scale); }

}  // namespace epd::kernels
