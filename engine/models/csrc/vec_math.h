// Branch-free float32 math that GCC vectorizes (std::exp stays scalar without -ffast-math).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pdserve {

// e^x within 2 ulp over the float range (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial for e^r, then scaled by 2^n). x is clamped to [-87.3, 88.3], so e^-inf gives 1e-38,
// not 0: callers only multiply by it.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace pdserve
