// Exhaustive and brute-force checks of the scalar formats in epd/kernels/types.h: bf16 and
// FP8 e4m3 conversions and the FP8 scale rule, each against an independent computation
// (double arithmetic, std::ldexp / std::frexp), never against the functions under test.
#include "epd/kernels/types.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace epd::kernels {
namespace {

/// Value of an e4m3 (E4M3FN) code from the format's definition; NaN for 0x7f / 0xff.
double E4m3Reference(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xf, man = code & 0x7;
  if (exp == 0xf && man == 0x7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

/// Brute force: the e4m3 code nearest to f among all 126 non-negative finite magnitudes,
/// ties to the even code, |f| > 448 (and inf) saturating to 448, sign copied, NaN → 0x7f.
uint8_t E4m3NearestBruteForce(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double mag = std::fabs(static_cast<double>(f));
  if (std::isinf(mag)) return sign | 0x7e;
  uint8_t best = 0;
  double best_dist = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7e; ++code) {
    const double dist = std::fabs(E4m3Reference(static_cast<uint8_t>(code)) - mag);
    if (dist < best_dist || (dist == best_dist && (code & 1) == 0)) {
      best = static_cast<uint8_t>(code);
      best_dist = dist;
    }
  }
  return sign | best;
}

/// f32 → bf16 from the definition: the two bf16 neighbours of f (truncation and the next
/// code up), nearest in exact double arithmetic, ties to the even code.
uint16_t Bf16NearestReference(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // truncation toward zero
  if ((u & 0xffffu) == 0) return lo;
  auto value = [](uint16_t b) {
    // The code above the largest finite bf16 is inf; its distance counts as 2^128.
    if ((b & 0x7fffu) == 0x7f80u) return std::ldexp((b & 0x8000u) ? -1.0 : 1.0, 128);
    uint32_t bits = static_cast<uint32_t>(b) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return static_cast<double>(v);
  };
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // next magnitude away from zero
  const double d_lo = std::fabs(static_cast<double>(f) - value(lo));
  const double d_hi = std::fabs(static_cast<double>(f) - value(hi));
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(Bf16Test, AllCodesConvertExactlyAndRoundTrip) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const uint16_t b = static_cast<uint16_t>(code);
    const float f = Bf16ToFloat(b);
    const uint32_t exp = (code >> 7) & 0xff, man = code & 0x7f;
    if (exp == 0xff && man != 0) {
      EXPECT_TRUE(std::isnan(f)) << code;
      // NaN stays NaN (quiet bit set), sign and payload kept.
      EXPECT_EQ(FloatToBf16(f), b | 0x40) << code;
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(man / 128.0, -126)
                                : (exp == 0xff ? std::numeric_limits<double>::infinity()
                                               : std::ldexp(1.0 + man / 128.0, int(exp) - 127));
    EXPECT_EQ(static_cast<double>(f), (code & 0x8000) ? -mag : mag) << code;
    EXPECT_EQ(FloatToBf16(f), b) << code;
  }
}

TEST(Bf16Test, RoundsToNearestEvenLikeTheDefinition) {
  std::vector<float> inputs;
  // Every bf16 midpoint and its f32 neighbours (the ties and the cases next to them),
  // over all exponents, both signs.
  for (uint32_t code = 0; code < 0x10000; code += 1) {
    if (((code >> 7) & 0xff) == 0xff) continue;
    const uint32_t mid = (code << 16) | 0x8000u;
    for (uint32_t bits : {mid - 1, mid, mid + 1, (code << 16) | 1u, (code << 16) | 0xffffu}) {
      inputs.push_back(FloatOf(bits));
    }
  }
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = FloatOf(static_cast<uint32_t>(rng()));
    if (!std::isnan(f)) inputs.push_back(f);
  }
  int64_t failures = 0;
  for (float f : inputs) {
    const uint16_t want = Bf16NearestReference(f);
    if (FloatToBf16(f) != want && ++failures <= 10) {
      ADD_FAILURE() << "FloatToBf16(" << f << ") = " << FloatToBf16(f) << ", want " << want;
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past max
}

TEST(E4m3Test, All256CodesDecodeExactlyAndRoundTrip) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t c = static_cast<uint8_t>(code);
    const float f = E4m3ToFloat(c);
    const double want = E4m3Reference(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << code;
      EXPECT_EQ(FloatToE4m3(f), 0x7f) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), want) << code;
    EXPECT_EQ(std::signbit(f), (code & 0x80) != 0) << code;  // -0 keeps its sign
    EXPECT_EQ(FloatToE4m3(f), c) << code;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
}

TEST(E4m3Test, FloatToE4m3MatchesBruteForceNearestWithTiesToEvenAndSaturation) {
  std::vector<float> inputs;
  // Every representable value, every midpoint between neighbours (ties), the f32 values
  // one ulp either side of each midpoint, and the region past 448.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = E4m3ToFloat(static_cast<uint8_t>(code));
    const float hi = E4m3ToFloat(static_cast<uint8_t>(code + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);  // exact
    for (float f : {lo, hi, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      inputs.push_back(f);
      inputs.push_back(-f);
    }
  }
  for (float f : {448.0f, 449.0f, 464.0f, 465.0f, 479.9f, 480.0f, 1e6f, 3e38f,
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                  std::ldexp(1.0f, -10), std::ldexp(1.0f, -11), std::ldexp(3.0f, -11),
                  std::numeric_limits<float>::quiet_NaN()}) {
    inputs.push_back(f);
    inputs.push_back(-f);
  }
  std::mt19937_64 rng(777);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 200'000; ++i) {
    // Random magnitudes over the whole e4m3 range and beyond, both signs.
    const float f = std::exp2(exponent(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    inputs.push_back(f);
    inputs.push_back(FloatOf(static_cast<uint32_t>(rng())));  // arbitrary bit patterns
  }
  int64_t failures = 0;
  for (float f : inputs) {
    const uint8_t want = E4m3NearestBruteForce(f);
    if (FloatToE4m3(f) != want && ++failures <= 10) {
      ADD_FAILURE() << "FloatToE4m3(" << f << ") = " << int(FloatToE4m3(f)) << ", want "
                    << int(want);
    }
  }
  EXPECT_EQ(failures, 0);
}

/// Fp8Scale from its definition, in double: max(amax, 1e-4) / 448 rounded once to f32
/// (an f32 quotient computed in double and rounded to f32 is correctly rounded: double
/// has more than 2 * 24 + 2 significand bits), or the smallest power of two >= that value
/// (via frexp).
float Fp8ScaleReference(float amax, bool round_scale) {
  const double a = std::max(static_cast<double>(amax), static_cast<double>(kFp8AmaxFloor));
  const float s = static_cast<float>(a / 448.0);
  if (!round_scale) return s;
  int e = 0;
  const double m = std::frexp(static_cast<double>(s), &e);  // s = m * 2^e, m in [0.5, 1)
  return static_cast<float>(m == 0.5 ? s : std::ldexp(1.0, e));
}

TEST(Fp8ScaleTest, MatchesDefinitionWithAndWithoutRoundScale) {
  std::vector<float> amaxes = {
      0.0f,    1e-6f,    9.99e-5f, kFp8AmaxFloor, std::nextafter(kFp8AmaxFloor, 1.0f),
      1.0f,    448.0f,   896.0f,   3.5f,          7.0f,
      0.4375f, 65504.0f, 1e30f};
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<float> exponent(-20.0f, 40.0f);
  for (int i = 0; i < 200'000; ++i) amaxes.push_back(std::exp2(exponent(rng)));
  for (int i = 0; i < 64; ++i) amaxes.push_back(448.0f * std::ldexp(1.0f, i - 32));  // exact
  for (float amax : amaxes) {
    for (bool round_scale : {false, true}) {
      const float got = Fp8Scale(amax, round_scale);
      const float want = Fp8ScaleReference(amax, round_scale);
      ASSERT_EQ(got, want) << "amax " << amax << " round_scale " << round_scale;
      if (round_scale) {
        ASSERT_GE(got, Fp8Scale(amax, false));  // rounds up, never down
      }
    }
  }
  // The floor: an all-zero block gets 1e-4 / 448.
  EXPECT_EQ(Fp8Scale(0.0f, false), static_cast<float>(1e-4f / 448.0));
  // With the scale, the block's largest magnitude quantizes to 448 (or just below with
  // round_scale, never saturating beyond it).
  for (float amax : {0.5f, 3.0f, 100.0f, 1234.5f}) {
    EXPECT_EQ(E4m3ToFloat(QuantizeE4m3(amax, Fp8Scale(amax, false))), 448.0f) << amax;
    EXPECT_LE(E4m3ToFloat(QuantizeE4m3(amax, Fp8Scale(amax, true))), 448.0f) << amax;
  }
}

// The UE8M0 code of a round_scale scale is e with scale == 2^(e - 127), by the definition
// (std::ilogb), over the whole range of amax.
TEST(Fp8ScaleTest, Ue8m0CodeIsTheExponentOfThePowerOfTwoScale) {
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<float> exponent(-30.0f, 60.0f);
  std::vector<float> amaxes = {0.0f, kFp8AmaxFloor, 1.0f, 448.0f, 449.0f, 1e30f};
  for (int i = 0; i < 100'000; ++i) amaxes.push_back(std::exp2(exponent(rng)));
  for (float amax : amaxes) {
    const float scale = Fp8Scale(amax, true);
    const int e = std::ilogb(scale);
    ASSERT_EQ(std::ldexp(1.0f, e), scale) << amax;
    ASSERT_EQ(static_cast<int>(Ue8m0Code(scale)), e + 127) << "amax " << amax;
  }
  EXPECT_EQ(Ue8m0Code(1.0f), 127);
  EXPECT_EQ(Ue8m0Code(0.5f), 126);
}

TEST(Fp8ScaleTest, QuantizeUsesTrueDivision) {
  // x / scale is correctly rounded f32 division (computed here in double, then rounded:
  // exact for f32 operands); check against the brute-force e4m3 search.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> v(-500.0f, 500.0f), a(1e-3f, 1e3f);
  for (int i = 0; i < 100'000; ++i) {
    const float x = v(rng), scale = Fp8Scale(a(rng), (i & 1) != 0);
    const float q = static_cast<float>(static_cast<double>(x) / scale);
    ASSERT_EQ(QuantizeE4m3(x, scale), E4m3NearestBruteForce(q)) << x << " / " << scale;
  }
}

}  // namespace
}  // namespace epd::kernels
