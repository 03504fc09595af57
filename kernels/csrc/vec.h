// Row helpers shared by the attention kernels and the layer ops: dtype conversion with
// torch's rounding, Cephes' exp, 8-lane loads and the fixed-order row max and sum.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <limits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif


namespace laneserve {


template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[i] = T(src[i]), round to nearest even as c10's conversions do.
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(src);
  uint16_t* raw = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {  // c10::round_to_nearest_even; NaN stays NaN
    const uint32_t u = bits[i];
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    raw[i] = nan ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// x[i] = float(T(x[i])): the rounding a torch op in dtype T applies to its result.
template <typename T>
inline void round_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<T>(x[i]));
}

template <>
inline void round_row<float>(float*, int64_t) {}

template <>
inline void round_row<c10::BFloat16>(float* x, int64_t n) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits[i];
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    bits[i] = nan ? 0x7FC00000u : ((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  }
}

// exp of 8 floats: Cephes' expf (x = n ln2 + r, a degree-5 polynomial in r, times 2^n), within
// 2 ulp of std::exp over [-87.3, 88.4]; above that +inf, below 0 (std::exp gives a subnormal
// down to -103.9), NaN gives NaN.
// Every element runs the same instructions, so a value's exp does not depend on its position.
#ifdef __AVX2__
inline __m256 exp8(__m256 in) {
  __m256 x = in;
  // x as the second operand: max/min return it when it is NaN, so a NaN stays NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626f), _mm256_max_ps(_mm256_set1_ps(-87.3365f), x));
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  // past the clamp: +inf above (exp overflows float there too), 0 below (NaN compares false)
  const __m256 over = _mm256_cmp_ps(in, _mm256_set1_ps(88.3762626f), _CMP_GT_OQ);
  const __m256 under = _mm256_cmp_ps(in, _mm256_set1_ps(-87.3365f), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), over));
}
#endif

// x[i] = exp(x[i]) (exp8 where the CPU has AVX2, padding the tail to 8; std::exp otherwise).
inline void exp_row(float* x, int64_t n) {
#ifdef __AVX2__
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    std::memcpy(x + i, tail, (n - i) * sizeof(float));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);  // bf16 is the high half of an fp32
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint32_t>(raw[i]) << 16;
}

#if defined(__AVX2__) && defined(__F16C__)
#define LANESERVE_VEC8 1

template <typename T>
constexpr bool kHasLoad8 = false;  // the dtypes load8 converts (double stays scalar)
template <>
constexpr bool kHasLoad8<float> = true;
template <>
constexpr bool kHasLoad8<c10::BFloat16> = true;
template <>
constexpr bool kHasLoad8<c10::Half> = true;

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane j of the result = the sum of the 8 lanes of a[j] (each lane's sum reads a[j] only).
inline __m256 hsum8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

// max and sum of x[0, n): 8 lanes, then the lanes in a fixed order (the order depends on n only).
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef LANESERVE_VEC8
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (float l : lanes) m = l > m ? l : m;
  }
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline float row_sum(const float* x, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef LANESERVE_VEC8
  __m256 v = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) sum += x[i];
  return sum;
}

}  // namespace laneserve
