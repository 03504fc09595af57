"""Small C++ CPU kernels, built on first use: paged attention that reads K/V in place.

The same build holds the fused layer ops below, the multi-token attention
``torch.ops.laneserve.paged_prefill_attention`` (prefill chunks and speculative verification
rows; see its comment: 8 query tokens x their query heads share each 32-key tile of K and V,
online softmax, a row's result independent of its chunk of 2+ tokens and of its batch; 1.5x the
speed of the gather + float copy + PyTorch CPU flash attention it replaces over 64-460-token
prompts on a 2-core EPYC, 1.1x at 1,024 tokens, 2.8x on 5 verification rows) and the
quantized GEMVs of :mod:`laneserve.kernels.cpu_ext_quant` (``int4_gemv``, ``q8_0_gemv``) and, on a CPU with
AMX, the tile matmuls of :mod:`laneserve.kernels.cpu_ext_amx` (``int4_amx``, ``q8_0_amx``).

``torch.ops.laneserve.paged_decode_attention`` computes one query token per sequence against its
context, walking the block table and reading each block where it lies in the cache: no gather, no
padding to the longest sequence. One ``at::parallel_for`` task per (sequence, KV head) keeps the
``g = Hq / Hk`` query heads of the group together. Scores, softmax and the weighted sum of V are in
fp32 (two passes: K then V); the output is rounded once to the output dtype. float32, bfloat16 and
float16 caches; any cache strides with a contiguous head dimension. On an AVX2 CPU the passes use
8-lane vectors: each K and V row is converted once for up to 4 query rows of its KV head, 8
tokens' scores are 8 x rows independent FMA chains with one horizontal add, V accumulators stay in
registers, K rows are prefetched ahead (and the next task's K and V lines into L2 while a task
runs), and ``exp`` is Cephes' polynomial (within 2 ulp of ``std::exp``; also in SiLU-mul); the
other CPUs run the same arithmetic as scalar loops. A 16-lane AVX-512 variant was measured no
faster on a Zen 4 EPYC (905 vs 938 us per layer at batch 64) and is not kept.

The source is compiled with ``torch.utils.cpp_extension.load_inline`` into torch's extension cache
(``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR``) the first time :func:`load` runs on a
machine (1-4 minutes on 2 cores, then loaded in milliseconds). ``-march=native`` is used, so the
module name carries a hash of the CPU's flags. Without a C++ compiler, or with
``LANESERVE_CPU_KERNELS=0``, :func:`load` returns False and callers use the PyTorch reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from laneserve.contracts import env
from laneserve.kernels import cpu_ext_amx, cpu_ext_quant

logger = logging.getLogger(__name__)

_SOURCE = r"""
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

namespace {

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

constexpr int64_t kRows = 4;  // query rows (of one KV head) sharing each K / V row load

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

#ifdef LANESERVE_VEC8
// The vector body of score8 for NR rows: 8 tokens x NR rows of independent FMA chains, walked
// one 8-lane slice of the head dim at a time (a token's chain runs over the slices in order).
// Tokens j >= n read token 0's row; their sums are dropped.
template <typename T, int NR>
inline void score8_vec(const float* q, const T* k, const int64_t* off, int64_t n, int64_t D,
                       float* s, int64_t ls) {
  const T* kr[8];
  for (int64_t j = 0; j < 8; ++j) kr[j] = k + off[j < n ? j : 0];
  __m256 a[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) a[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    __m256 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q + r * D + i);
    for (int j = 0; j < 8; ++j) {
      const __m256 kv = load8(kr[j] + i);  // converted once for every row
      for (int r = 0; r < NR; ++r) a[r][j] = _mm256_fmadd_ps(qv[r], kv, a[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m256 sums = hsum8x8(a[r]);  // one horizontal sum for the 8 tokens
    if (n == 8) {
      _mm256_storeu_ps(s + r * ls, sums);
    } else {
      float tail[8];
      _mm256_storeu_ps(tail, sums);
      std::memcpy(s + r * ls, tail, n * sizeof(float));
    }
  }
}
#endif

// s[r * ls + j] = q_r . k_j for r < nr <= kRows, j < n <= 8; q_r = q + r * D (fp32),
// k_j = k + off[j] (D elements).
template <typename T>
inline void score8(const float* q, int64_t nr, const T* k, const int64_t* off, int64_t n,
                   int64_t D, float* s, int64_t ls) {
#ifdef LANESERVE_VEC8
  if constexpr (kHasLoad8<T>) if (D % 8 == 0) {
    switch (nr) {
      case 1: return score8_vec<T, 1>(q, k, off, n, D, s, ls);
      case 2: return score8_vec<T, 2>(q, k, off, n, D, s, ls);
      case 3: return score8_vec<T, 3>(q, k, off, n, D, s, ls);
      default: return score8_vec<T, kRows>(q, k, off, n, D, s, ls);
    }
  }
#endif
  for (int64_t r = 0; r < nr; ++r)  // scalar: double, or a head dim not a multiple of 8
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * static_cast<float>(k[off[j] + d]);
      s[r * ls + j] = acc;
    }
}

// Ask for the cache lines of rows [t0, t1) (heads [h0, h1)) ahead of their use.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* off, int64_t t0, int64_t t1, int64_t h0,
                          int64_t h1, int64_t hs, int64_t D) {
#ifdef LANESERVE_VEC8
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = h0; h < h1; ++h) {
      const char* p = reinterpret_cast<const char*>(base + off[t] + h * hs);
      for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64)
        _mm_prefetch(p + byte, _MM_HINT_T0);
    }
#endif
}

#ifdef LANESERVE_VEC8
// The vector body of weighted_sum for NR rows and NV x 8 dims from c0. NR and NV are template
// arguments so that the accumulators live in registers: with run-time loop bounds they were
// kept on the stack, a load and a store around every FMA (0.85-0.9x the time of that loop on a
// 2-core AVX2 EPYC whenever the cache rows are in cache). Each (row, dim) still sums over the
// tokens in order: the same results, bit for bit.
template <typename T, int NR, int NV>
inline void weighted_sum_vec(const float* p, int64_t lp, const T* v, const int64_t* off,
                             int64_t len, int64_t c0, int64_t D, float* acc) {
  __m256 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const T* vr = v + off[t] + c0;
    __m256 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load8(vr + 8 * i);  // converted once
    for (int r = 0; r < NR; ++r) {
      const __m256 pt = _mm256_set1_ps(p[r * lp + t]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(pt, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + r * D + c0 + 8 * i, a[r][i]);
}

template <typename T, int NR>
inline void weighted_sum_rows(const float* p, int64_t lp, const T* v, const int64_t* off,
                              int64_t len, int64_t D, float* acc) {
#ifdef __AVX512VL__
  constexpr int kNV = 4;  // 32 vector registers (ymm16-31 need AVX512VL)
#else
  constexpr int kNV = NR > 2 ? 2 : 4;  // 16: NR x kNV accumulators + kNV V vectors
#endif
  int64_t c0 = 0;
  for (; c0 + 8 * kNV <= D; c0 += 8 * kNV)
    weighted_sum_vec<T, NR, kNV>(p, lp, v, off, len, c0, D, acc);
  for (; c0 < D; c0 += 8) weighted_sum_vec<T, NR, 1>(p, lp, v, off, len, c0, D, acc);
}
#endif

// acc[r * D + d] = sum_t p[r * lp + t] * v_t[d] for r < nr <= kRows, t < len;
// v_t = v + off[t] (D elements).
template <typename T>
inline void weighted_sum(const float* p, int64_t lp, int64_t nr, const T* v, const int64_t* off,
                         int64_t len, int64_t D, float* acc) {
#ifdef LANESERVE_VEC8
  if constexpr (kHasLoad8<T>) if (D % 8 == 0) {
    switch (nr) {
      case 1: return weighted_sum_rows<T, 1>(p, lp, v, off, len, D, acc);
      case 2: return weighted_sum_rows<T, 2>(p, lp, v, off, len, D, acc);
      case 3: return weighted_sum_rows<T, 3>(p, lp, v, off, len, D, acc);
      default: return weighted_sum_rows<T, kRows>(p, lp, v, off, len, D, acc);
    }
  }
#endif
  std::vector<float> row(D);
  std::fill(acc, acc + nr * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    load_row(v + off[t], row.data(), D);
    for (int64_t r = 0; r < nr; ++r) {
      const float pt = p[r * lp + t];
      float* ar = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ar[d] += pt * row[d];
    }
  }
}

// The query, output and cache pointers and strides an attention kernel walks (element units).
template <typename T>
struct PagedView {
  const T* qp;
  const T* kp;
  const T* vp;
  T* op;
  int64_t qs0, qs1, os0, os1, ks0, ks1, ks2, vs0, vs1, vs2;
  PagedView(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out)
      : qp(q.data_ptr<T>()), kp(kc.data_ptr<T>()), vp(vc.data_ptr<T>()), op(out.data_ptr<T>()),
        qs0(q.stride(0)), qs1(q.stride(1)), os0(out.stride(0)), os1(out.stride(1)),
        ks0(kc.stride(0)), ks1(kc.stride(1)), ks2(kc.stride(2)), vs0(vc.stride(0)),
        vs1(vc.stride(1)), vs2(vc.stride(2)) {}
};

// The cache lines of sequence b's K and V rows for heads [h0, h1), block by block (K and V lines
// interleaved), into `lines`, at most `kAheadBytes` of them: what a decode task reads first,
// listed so that the task before it can ask for them ahead (`prefetch_next`). Bounded so that a
// long context does not push the current task's rows (or the next task's first ones) out of L2.
constexpr int64_t kAheadBytes = 512 * 1024;

template <typename T>
inline void list_task_lines(const PagedView<T>& p, const int32_t* table, int64_t len, int64_t bs,
                            int64_t h0, int64_t h1, int64_t D, std::vector<const char*>& lines) {
  lines.clear();
#ifdef LANESERVE_VEC8
  const int64_t row = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t0 = 0, j = 0; t0 < len; t0 += bs, ++j) {
    const int64_t blk = table[j], n = std::min(bs, len - t0);
    for (int64_t off = 0; off < n; ++off)
      for (int64_t h = h0; h < h1; ++h) {
        if (static_cast<int64_t>(lines.size()) * 64 >= kAheadBytes) return;
        const char* k = reinterpret_cast<const char*>(p.kp + blk * p.ks0 + off * p.ks1 + h * p.ks2);
        const char* v = reinterpret_cast<const char*>(p.vp + blk * p.vs0 + off * p.vs1 + h * p.vs2);
        for (int64_t byte = 0; byte < row; byte += 64) {
          lines.push_back(k + byte);
          lines.push_back(v + byte);
        }
      }
  }
#endif
}

// Ask for lines [next, next + n) of `lines` into L2, advancing `next`.
inline void prefetch_next(const std::vector<const char*>& lines, size_t& next, int64_t n) {
  const size_t stop = std::min(lines.size(), next + static_cast<size_t>(std::max<int64_t>(n, 0)));
#ifdef LANESERVE_VEC8
  for (; next < stop; ++next) _mm_prefetch(lines[next], _MM_HINT_T1);
#else
  next = stop;
#endif
}

// q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hk, D]; seq_lens int32 [B];
// block_tables int32 [B, max_blocks]; out [B, Hq, D]
// One task = one sequence and a range of its KV heads [h0, h1): all heads when the batch alone
// keeps the threads busy, one head otherwise. A task first lists where each context token's K and
// V rows lie (block table walked once); pass 1 walks the tokens 8 at a time and scores every
// query row against them (each K row converted once for up to kRows rows, one horizontal sum per
// 8 tokens); softmax per row; pass 2 sums the V rows per KV head for up to kRows query rows per
// sweep (accumulators in registers). A row's arithmetic depends on its own query and context
// only, not on the batch, its neighbours in a sweep or the thread split. While a task runs pass 1
// it asks for the next task's first K and V lines (512 KB at most) into L2, spread over its
// iterations: the blocks of a long-running cache lie scattered, and with only the next 16 tokens'
// K asked for, the loads waited on memory one block at a time (batch 64 over 384 tokens on a
// 2-core Zen 4: 1.5x the time per layer with shuffled blocks, 1.25x with sequential ones).
// Fetching changes no result.
template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const at::Tensor& seq_lens, const at::Tensor& bt, double scale,
                 at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hk = kc.size(2), g = Hq / Hk;
  const PagedView<T> p(q, kc, vc, out);
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t bts0 = bt.stride(0);
  const float fscale = static_cast<float>(scale);
  const int64_t per_task = B >= 4 * at::get_num_threads() ? Hk : 1;
  const int64_t tasks_per_seq = Hk / per_task;
  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(kRows * D), scores, inv_sum(Hq);
    std::vector<int64_t> koff, voff;
    std::vector<const char*> ahead;  // the next task's cache lines
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / tasks_per_seq;
      const int64_t h0 = (w % tasks_per_seq) * per_task, h1 = h0 + per_task;
      const int64_t len = sl[b];
      ahead.clear();
      if (w + 1 < end) {
        const int64_t b1 = (w + 1) / tasks_per_seq, g0 = ((w + 1) % tasks_per_seq) * per_task;
        list_task_lines(p, btp + b1 * bts0, sl[b1], bs, g0, g0 + per_task, D, ahead);
      }
      const int64_t ahead_per_iter = (static_cast<int64_t>(ahead.size()) + (len + 7) / 8 - 1) /
                                     ((len + 7) / 8);
      size_t next_line = 0;
      koff.resize(len);
      voff.resize(len);
      for (int64_t t0 = 0, j = 0; t0 < len; t0 += bs, ++j) {  // block by block: no divisions
        const int64_t blk = btp[b * bts0 + j], n = std::min(bs, len - t0);
        for (int64_t off = 0; off < n; ++off) {
          koff[t0 + off] = blk * p.ks0 + off * p.ks1;
          voff[t0 + off] = blk * p.vs0 + off * p.vs1;
        }
      }
      scores.resize(Hq * len);
      for (int64_t r = h0 * g; r < h1 * g; ++r) {
        load_row(p.qp + b * p.qs0 + r * p.qs1, qf.data() + r * D, D);
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= fscale;
      }
      // pass 1, token by token through the blocks: every head's scores for 8 tokens, while the
      // K rows 16 tokens ahead, this group's V rows (pass 2) and a share of the next task's
      // lines are fetched
      for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, len - t0);
        prefetch_next(ahead, next_line, ahead_per_iter);
        prefetch_rows(p.kp, koff.data(), std::min(t0 + 16, len), std::min(t0 + 24, len), h0, h1,
                      p.ks2, D);
        prefetch_rows(p.vp, voff.data(), t0, t0 + n, h0, h1, p.vs2, D);
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t r = h * g; r < (h + 1) * g; r += kRows)
            score8(qf.data() + r * D, std::min(kRows, (h + 1) * g - r), p.kp + h * p.ks2,
                   koff.data() + t0, n, D, scores.data() + r * len + t0, len);
      }
      for (int64_t r = h0 * g; r < h1 * g; ++r) {
        float* s = scores.data() + r * len;
        const float m = row_max(s, len);
        for (int64_t t = 0; t < len; ++t) s[t] -= m;
        exp_row(s, len);
        inv_sum[r] = 1.f / row_sum(s, len);
      }
      // pass 2: per KV head, up to kRows query rows per sweep over its V rows
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t r0 = h * g; r0 < (h + 1) * g; r0 += kRows) {
          const int64_t nr = std::min(kRows, (h + 1) * g - r0);
          weighted_sum(scores.data() + r0 * len, len, nr, p.vp + h * p.vs2, voff.data(), len, D,
                       acc.data());
          for (int64_t r = r0; r < r0 + nr; ++r) {
            float* ar = acc.data() + (r - r0) * D;
            for (int64_t d = 0; d < D; ++d) ar[d] *= inv_sum[r];
            store_row(ar, p.op + b * p.os0 + r * p.os1, D);
          }
        }
    }
  });
}

// The checks both attention ops make of their tensors: q and out [rows, Hq, D] and the caches
// [N, bs, Hk, D] in one dtype with a contiguous head dimension, Hq a multiple of Hk, int32
// seq_lens and block_tables (one row per sequence), a block size of at least 1.
void check_paged_attention(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.sizes() == q.sizes(),
              "q and out [rows, Hq, D], k_cache [N, bs, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "q, out and the caches share one dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
              block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
              block_tables.size(0) == seq_lens.size(0), "int32 metadata, a table row per sequence");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache have one shape");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && k_cache.size(2) >= 1 &&
              q.size(1) % k_cache.size(2) == 0,
              "q [rows, Hq, D] against caches [N, bs, Hk, D]: one D, Hq a multiple of Hk");
  TORCH_CHECK(k_cache.size(1) >= 1, "the caches' block size must be at least 1");
}

// Every block sequence s reads for its `len` keys is in its block table row and in the pool.
void check_sequence_blocks(const at::Tensor& block_tables, int64_t s, int64_t len,
                           int64_t num_blocks, int64_t bs) {
  TORCH_CHECK((len + bs - 1) / bs <= block_tables.size(1),
              "seq_lens[", s, "] = ", len, " does not fit its block table");
  const int32_t* row = block_tables.data_ptr<int32_t>() + s * block_tables.stride(0);
  for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "block id ", row[j], " outside [0, ",
                num_blocks, ")");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& seq_lens,
                                  const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.dim() == 3, "q [B, Hq, D]");
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  check_paged_attention(q, out, k_cache, v_cache, seq_lens, block_tables);
  TORCH_CHECK(seq_lens.size(0) == q.size(0), "one query row, length and table row per sequence");
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {  // every block a sequence reads must exist
    TORCH_CHECK(sl[b] >= 1, "seq_lens[", b, "] = ", sl[b], " does not fit its block table");
    check_sequence_blocks(block_tables, b, sl[b], k_cache.size(0), k_cache.size(1));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
  });
  return out;
}

// Multi-token attention: for every sequence s whose query has q_len = cu[s + 1] - cu[s] >= 2
// tokens (prefill chunks, speculative verification), query token i sits at position
// seq_lens[s] - q_len + i and attends keys 0..position, K and V read where they lie in the cache.
// Rows of one-token sequences are left alone (paged_decode_attention does them). One task =
// (sequence, KV head, kTileQ query tokens): the tile's g query heads x tokens share each
// kTileK-key tile of K and V, converted once to fp32; scores (two rows per K read), an online
// softmax (running max and sum per row) and the weighted sum of V in fp32, the output rounded
// once. Key tiles start at multiples of kTileK whatever the chunking, and a tile past a row's
// position leaves it exactly as it was, so a row's result depends on its query and context
// only: not on the chunk of two or more tokens it came in (a one-token chunk is a decode row),
// the batch or the thread split.
constexpr int64_t kTileQ = 8;   // query tokens per task
constexpr int64_t kTileK = 32;  // keys per softmax update, converted to fp32 once per task

template <typename T>
void prefill_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& bt,
                  double scale, at::Tensor& out) {
  const int64_t S = seq_lens.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hk = kc.size(2), g = Hq / Hk;
  const PagedView<T> p(q, kc, vc, out);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t bts0 = bt.stride(0);
  const float fscale = static_cast<float>(scale);
  std::vector<int64_t> tasks;  // s * 2^40 + tile start * 2^20 + KV head (one int64 each)
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = cu[s + 1] - cu[s];
    if (qlen < 2) continue;
    for (int64_t t0 = 0; t0 < qlen; t0 += kTileQ)
      for (int64_t h = 0; h < Hk; ++h) tasks.push_back((s << 40) | (t0 << 20) | h);
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int64_t R = kTileQ * g;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks)))
  {
    std::vector<float> qf(R * D), acc(R * D), kt(kTileK * D), vt(kTileK * D), m(R), l(R);
    int64_t off_d[kTileK];
    for (int64_t j = 0; j < kTileK; ++j) off_d[j] = j * D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_tasks; ++w) {
      const int64_t s = tasks[w] >> 40, t0 = (tasks[w] >> 20) & 0xFFFFF, h = tasks[w] & 0xFFFFF;
      const int64_t lo = cu[s], qlen = cu[s + 1] - lo, start = sl[s] - qlen;
      const int64_t nt = std::min(kTileQ, qlen - t0), rows = nt * g;
      for (int64_t r = 0; r < rows; ++r) {  // row r: token t0 + r / g, query head h * g + r % g
        float* qr = qf.data() + r * D;
        load_row(p.qp + (lo + t0 + r / g) * p.qs0 + (h * g + r % g) * p.qs1, qr, D);
        for (int64_t d = 0; d < D; ++d) qr[d] *= fscale;
        m[r] = neg_inf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      const int64_t last = start + t0 + nt;  // keys [0, last): the tile's last row sees them all
      for (int64_t k0 = 0; k0 < last; k0 += kTileK) {
        const int64_t kn = std::min(kTileK, last - k0);
        for (int64_t j = 0; j < kTileK; ++j) {  // missing keys: zero rows (their scores are masked)
          if (j < kn) {
            const int64_t key = k0 + j, blk = btp[s * bts0 + key / bs], off = key % bs;
            load_row(p.kp + blk * p.ks0 + off * p.ks1 + h * p.ks2, kt.data() + j * D, D);
            load_row(p.vp + blk * p.vs0 + off * p.vs1 + h * p.vs2, vt.data() + j * D, D);
          } else {
            std::fill(kt.begin() + j * D, kt.begin() + (j + 1) * D, 0.f);
            std::fill(vt.begin() + j * D, vt.begin() + (j + 1) * D, 0.f);
          }
        }
        float sc2[2 * kTileK];  // two rows' scores: each K row is read once for both
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min(kn, start + t0 + r / g - k0 + 1);
          // rows r, r + 1 (a later token or the same): when the partner sees keys, r may not
          if (r % 2 == 0 && start + t0 + std::min(r + 1, rows - 1) / g - k0 >= 0) {
            // a row's sums are the same alone or in a pair (see score8_vec)
            const int64_t nr = std::min<int64_t>(2, rows - r);
            for (int64_t j0 = 0; j0 < kTileK; j0 += 8)
              score8(qf.data() + r * D, nr, kt.data(), off_d + j0, 8, D, sc2 + j0, kTileK);
          }
          if (visible <= 0) continue;  // the whole tile lies past this row's position
          float* sc = sc2 + (r % 2) * kTileK;
          for (int64_t j = visible; j < kTileK; ++j) sc[j] = neg_inf;
          const float m_new = std::max(m[r], row_max(sc, kTileK));
          const float alpha =  // the old sums' scale: 1 while the running max holds
              m_new == m[r] ? 1.f : (m[r] == neg_inf ? 0.f : std::exp(m[r] - m_new));
          for (int64_t j = 0; j < kTileK; ++j) sc[j] -= m_new;
          exp_row(sc, kTileK);
          l[r] = l[r] * alpha + row_sum(sc, kTileK);
          m[r] = m_new;
          float* ar = acc.data() + r * D;
          const int64_t nk = (visible + 7) / 8 * 8;  // keys past visible add exact zeros: skip
          int64_t d0 = 0;
#ifdef LANESERVE_VEC8
          const __m256 av = _mm256_set1_ps(alpha);
          for (; d0 + 32 <= D; d0 += 32) {  // 4 accumulators in registers
            __m256 a[4];
            for (int i = 0; i < 4; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(ar + d0 + 8 * i), av);
            for (int64_t j = 0; j < nk; ++j) {
              const __m256 pj = _mm256_set1_ps(sc[j]);
              const float* vj = vt.data() + j * D + d0;
              for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
            }
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(ar + d0 + 8 * i, a[i]);
          }
#endif
          for (int64_t d = d0; d < D; ++d) {
            float a = ar[d] * alpha;
#ifdef __FMA__
            for (int64_t j = 0; j < nk; ++j) a = std::fma(sc[j], vt[j * D + d], a);
#else  // std::fma without the instruction is a libm call per element
            for (int64_t j = 0; j < nk; ++j) a += sc[j] * vt[j * D + d];
#endif
            ar[d] = a;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = acc.data() + r * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) ar[d] *= inv;
        store_row(ar, p.op + (lo + t0 + r / g) * p.os0 + (h * g + r % g) * p.os1, D);
      }
    }
  }
}

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale, at::Tensor out) {
  check_paged_attention(q, out, k_cache, v_cache, seq_lens, block_tables);
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
              cu_seqlens_q.size(0) == seq_lens.size(0) + 1, "int32 cu_seqlens_q [S + 1]");
  const int64_t S = seq_lens.size(0);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[S] == q.size(0), "cu_seqlens_q runs from 0 to T");
  for (int64_t s = 0; s < S; ++s) {  // every block a sequence of 2+ query tokens reads must exist
    const int64_t qlen = cu[s + 1] - cu[s];
    TORCH_CHECK(qlen >= 0 && qlen < (int64_t(1) << 20) && sl[s] >= qlen,
                "sequence ", s, ": query length ", qlen, " against seq_lens ", sl[s]);
    if (qlen >= 2) check_sequence_blocks(block_tables, s, sl[s], k_cache.size(0), k_cache.size(1));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    prefill_impl<scalar_t>(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out);
  });
}

// One row of rms_impl. The sizes are parameters (locals) and the pointers restrict-qualified:
// read through the enclosing lambda's references, every loop bound was reloaded after each
// float store (-fno-strict-aliasing) and the loops stayed scalar.
template <typename T>
inline void rms_row(const T* __restrict x, const T* __restrict res, const float* __restrict wf,
                    T* __restrict out, T* __restrict new_res, float* __restrict h,
                    float* __restrict r, const int64_t H, const float eps) {
  load_row(x, h, H);
  if (res) {
    load_row(res, r, H);
    for (int64_t j = 0; j < H; ++j) h[j] += r[j];
    round_row<T>(h, H);  // x + residual rounded once to T, as torch adds
    store_row(h, new_res, H);
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += h[j] * h[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) h[j] *= inv;
  round_row<T>(h, H);
  for (int64_t j = 0; j < H; ++j) h[j] *= wf[j];
  store_row(h, out, H);
}

// x [T, H] (+ residual [T, H]) -> out [T, H], new_residual [T, H], transformers' LlamaRMSNorm:
// r = x + residual in T; h = float(r); out = T(w * T(h * rsqrt(mean(h^2) + eps))).
template <typename T>
void rms_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, double eps,
              at::Tensor& out, at::Tensor* new_res) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* np = new_res ? new_res->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H), r(H), wf(H);
    load_row(wp, wf.data(), H);
    for (int64_t i = begin; i < end; ++i)
      rms_row<T>(xp + i * H, rp ? rp + i * H : nullptr, wf.data(), op + i * H,
                 np ? np + i * H : nullptr, h.data(), r.data(), H, static_cast<float>(eps));
  });
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight [H] dense, in x's dtype");
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.dim() == 2, "x [T, H] dense");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual has x's shape and dtype");
  check_norm_weight(x, weight);
  auto out = at::empty_like(x);
  auto new_res = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms", [&] {
    rms_impl<scalar_t>(x, &residual, weight, eps, out, &new_res);
  });
  return {out, new_res};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "x [T, H] dense");
  check_norm_weight(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms", [&] {
    rms_impl<scalar_t>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

// x [T, 2I] -> [T, I] = T(T(silu(gate)) * up), transformers' act_fn(gate) * up in dtype T.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "x [T, 2I] dense");
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({rows, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    constexpr int64_t kChunk = 256;  // elements per pass through the fp32 buffers
    const int64_t chunks = (I + kChunk - 1) / kChunk;
    at::parallel_for(0, rows * chunks, 16, [&](int64_t begin, int64_t end) {
      float g[kChunk], e[kChunk], u[kChunk];
      for (int64_t w = begin; w < end; ++w) {
        const int64_t i = w / chunks, j0 = (w % chunks) * kChunk, n = std::min(kChunk, I - j0);
        load_row(xp + i * 2 * I + j0, g, n);
        load_row(xp + i * 2 * I + I + j0, u, n);
        for (int64_t j = 0; j < n; ++j) e[j] = -g[j];
        exp_row(e, n);
        for (int64_t j = 0; j < n; ++j) g[j] = g[j] / (1.f + e[j]);
        round_row<scalar_t>(g, n);
        for (int64_t j = 0; j < n; ++j) g[j] *= u[j];
        store_row(g, op + i * I + j0, n);
      }
    });
  });
  return out;
}

// cos and sin of one position, each half repeated, rounded to T as the reference's
// cache.to(dtype). Sizes are parameters and pointers restrict-qualified so the loops vectorize
// (see rms_row).
template <typename T>
inline void rope_cos_sin(const float* __restrict c, float* __restrict cd, float* __restrict sd,
                         const int64_t half) {
  for (int64_t d = 0; d < half; ++d) {
    cd[d] = cd[d + half] = c[d];
    sd[d] = sd[d + half] = c[half + d];
  }
  round_row<T>(cd, 2 * half);
  round_row<T>(sd, 2 * half);
}

// One head row: x * T(cos) + rotate_half(x) * T(sin) over the first 2 * half dimensions, each
// product and the sum rounded to T; dimensions past them are copied unchanged.
template <typename T>
inline void rope_row(const T* __restrict src, T* __restrict dst, const float* __restrict cd,
                     const float* __restrict sd, float* __restrict xf, float* __restrict rf,
                     const int64_t D, const int64_t half) {
  const int64_t rot = 2 * half;
  load_row(src, xf, D);
  for (int64_t d = 0; d < half; ++d) rf[d] = -xf[d + half];
  for (int64_t d = half; d < rot; ++d) rf[d] = xf[d - half];
  for (int64_t d = 0; d < rot; ++d) rf[d] *= sd[d];
  round_row<T>(rf, rot);
  for (int64_t d = 0; d < rot; ++d) xf[d] *= cd[d];
  round_row<T>(xf, rot);
  for (int64_t d = 0; d < rot; ++d) xf[d] += rf[d];
  store_row(xf, dst, D);
}

// qkv [T, (Hq + 2 Hk) D] -> q [T, Hq, D] rotated; k rotated and v written to the caches'
// slot_mapping[t] (negative: skipped). Rotate-half RoPE with transformers' numerics in dtype T:
// x * T(cos) + rotate_half(x) * T(sin), each product and the sum rounded to T. cos_sin [P, rot].
template <typename T>
void rope_cache_impl(const at::Tensor& qkv, const at::Tensor& pos, const at::Tensor& cs,
                     at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, int64_t Hq,
                     int64_t Hk, at::Tensor& q_out) {
  const int64_t T_ = qkv.size(0), D = q_out.size(2), rot = cs.size(1), half = rot / 2;
  const int64_t width = qkv.size(1), bs = kc.size(1);
  const T* xp = qkv.data_ptr<T>();
  const float* csp = cs.data_ptr<float>();
  const int64_t css = cs.stride(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* qp = q_out.data_ptr<T>();
  T* kp = kc.data_ptr<T>();
  T* vp = vc.data_ptr<T>();
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  at::parallel_for(0, T_, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cd(rot), sd(rot), xf(D), rf(rot);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = xp + t * width;
      rope_cos_sin<T>(csp + pp[t] * css, cd.data(), sd.data(), half);
      for (int64_t h = 0; h < Hq; ++h)
        rope_row(row + h * D, qp + (t * Hq + h) * D, cd.data(), sd.data(), xf.data(), rf.data(),
                 D, half);
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < Hk; ++h) {
        rope_row(row + (Hq + h) * D, kp + blk * ks0 + off * ks1 + h * ks2, cd.data(), sd.data(),
                 xf.data(), rf.data(), D, half);
        const T* v = row + (Hq + Hk + h) * D;
        T* vd = vp + blk * vs0 + off * vs1 + h * vs2;
        std::memcpy(vd, v, D * sizeof(T));
      }
    }
  });
}

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions,
                          const at::Tensor& cos_sin_cache, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, int64_t num_q_heads,
                          int64_t num_kv_heads) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2, "qkv [T, (Hq + 2 Hk) D] dense");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous(), "int64 positions/slots");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.stride(1) == 1,
              "fp32 cos_sin_cache");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && k_cache.stride(3) == 1 &&
              v_cache.scalar_type() == qkv.scalar_type() && v_cache.stride(3) == 1,
              "caches share qkv's dtype, head dimension contiguous");
  const int64_t D = k_cache.size(3), rot = cos_sin_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D, "qkv width");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "caches [N, bs, num_kv_heads, D], one shape");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && rot % 2 == 0 && rot <= D,
              "cos_sin_cache [P, rot] with an even rot <= head dim");
  TORCH_CHECK(positions.size(0) == qkv.size(0) && slot_mapping.size(0) == qkv.size(0),
              "positions and slot_mapping need one entry per token");
  const int64_t max_pos = cos_sin_cache.size(0), max_slot = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const int64_t p = positions.data_ptr<int64_t>()[t], s = slot_mapping.data_ptr<int64_t>()[t];
    TORCH_CHECK(p >= 0 && p < max_pos, "position ", p, " outside cos_sin_cache [0, ", max_pos, ")");
    TORCH_CHECK(s < max_slot, "slot ", s, " outside the cache's ", max_slot, " slots");
  }
  auto q = at::empty({qkv.size(0), num_q_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_cache", [&] {
    rope_cache_impl<scalar_t>(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                              num_q_heads, num_kv_heads, q);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY(laneserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor)");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor seq_lens, Tensor block_tables, float scale, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_and_cache(Tensor qkv, Tensor positions, Tensor cos_sin_cache, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_q_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
}
"""

BUILD_TIMEOUT_S = 900  # a build takes ~1 min on 2 busy cores; past this, use the PyTorch path
# one build: the layer ops, the quantized GEMVs, the AMX matmuls
_SOURCES = [_SOURCE, cpu_ext_quant.SOURCE, cpu_ext_amx.SOURCE]
_lock = threading.Lock()
_background = threading.Event()  # set while a background build is pending
_state: dict[str, bool] = {}


def _cpu_flags_tag() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256(("".join(_SOURCES) + flags + torch.__version__).encode()).hexdigest()
    return digest[:12]


def load() -> bool:
    """Build (first time on this machine) and load the extension; True when its ops are usable.

    While a build started by :func:`load_or_build_in_background` runs, returns False at once
    (callers take the PyTorch path meanwhile) instead of waiting for it.
    Never raises: a failed build is logged once as a warning and the PyTorch path is used.
    """
    if "ok" in _state:
        return _state["ok"]
    if _background.is_set():
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _try_build()
    return _state["ok"]


def _try_build() -> bool:
    if not env.get("LANESERVE_CPU_KERNELS"):
        return False
    try:
        _build_and_load()
        return hasattr(torch.ops.laneserve, "paged_decode_attention")
    except Exception as exc:  # no compiler, failed build: the reference path still works
        logger.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", exc)
        return False


def is_built() -> bool:
    """Whether this source is already compiled for this CPU and torch (loading then takes
    milliseconds); False means :func:`load` would compile (about 1-4 minutes on 2 cores)."""
    build_dir = build_directory()
    return (build_dir / f"{build_dir.name}.so").exists()


def load_or_build_in_background() -> bool:
    """Load the extension now when it is built; otherwise compile it in a background thread and
    return False, so a fresh machine serves its first tokens on the PyTorch path instead of
    waiting for the compiler (`laneserve model pull` builds it ahead, see laneserve/commands/
    model.py). The ops switch to C++ once the build is loaded."""
    if "ok" in _state or not env.get("LANESERVE_CPU_KERNELS") or is_built():
        return load()
    if not _background.is_set():
        _background.set()
        logger.info("building the C++ CPU kernels in the background (once per machine)")
        threading.Thread(target=_background_build, name="cpu-ext-build", daemon=True).start()
    return False


def _background_build() -> None:
    try:
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _try_build()
                logger.info("C++ CPU kernels %s", "loaded" if _state["ok"] else "unavailable")
    finally:
        _background.clear()


def build_directory() -> Path:
    """Where this source, for this CPU and torch version, is built (in torch's extension root)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"laneserve_cpu_{_cpu_flags_tag()}"


def _build_and_load() -> None:
    """Compile (or reuse) the extension under an OS file lock and load its ops.

    torch guards a build with a lock *file* that a process killed mid-build leaves behind, and
    every later build then waits for it forever. The OS lock taken here is released when its
    holder dies, and whoever holds it is the only builder, so a torch lock file found then is
    stale and is removed.
    """
    from filelock import FileLock
    from torch.utils.cpp_extension import load_inline

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".lock", timeout=BUILD_TIMEOUT_S):
        (build_dir / "lock").unlink(missing_ok=True)
        load_inline(
            name=build_dir.name,
            build_directory=str(build_dir),
            cpp_sources=list(_SOURCES),  # load_inline inserts its include into the list
            extra_cflags=[
                "-O3",
                "-march=native",
                "-fopenmp",
                "-fno-strict-aliasing",
                "-ffp-contract=off",
            ],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
