// Half and bfloat16 <-> float conversions (portable scalar; kernels use F16C/AVX-512 in bulk).
#pragma once

#include <bit>
#include <cstdint>

namespace troupe::kernels {

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return std::bit_cast<float>(bits);
}

/// Round to nearest even, as numpy's astype(float16) does.
inline uint16_t f32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) {  // NaN: keep the top payload bits, never collapse to inf (as numpy)
    const uint32_t payload = (ax & 0x7fffffu) >> 13;
    return (uint16_t)(sign | 0x7c00u | (payload != 0 ? payload : 1u));
  }
  if (ax == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // overflow -> inf
  if (ax < 0x38800000u) {                                    // subnormal or zero
    const float v = std::bit_cast<float>(ax) + 0.5f;        // align mantissa, hardware rounding
    return (uint16_t)(sign | (std::bit_cast<uint32_t>(v) - 0x3f000000u));
  }
  const uint32_t mant_odd = (ax >> 13) & 1u;
  const uint32_t r = ax + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return (uint16_t)(sign | (r >> 13));
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>((uint32_t)h << 16); }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

}  // namespace troupe::kernels
