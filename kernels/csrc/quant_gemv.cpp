// C++ source of the quantized matmuls for few rows (GEMV), compiled into :mod:`laneserve.kernels.cpu_ext`.
//
// ``torch.ops.laneserve.int4_gemv(x, qs, scale, offset, block_groups)`` and
// ``torch.ops.laneserve.q8_0_gemv(x, qs, d, block_groups)`` compute ``y = x @ W.T`` for float32 or
// bfloat16 activations (the result in x's dtype) from the GGUF blocks' values (ggml's ``block_q4_0`` /
// ``block_q4_1`` / ``block_q8_0``): Q8_0 ones where they lie, int4 ones in the GGUF's nibble order
// or, where the build reads it (``int4_gemv_block_groups()`` is 8: AVX2 without AVX-512BW), in the
// block order described at the end.
//
// Layouts (N outputs, K inputs, G = K / 32 groups):
//
//     int4:  qs uint8 [N, K / 2]   byte 16 g + j of row n: q[n, 32 g + j] | q[n, 32 g + 16 + j] << 4
//                                  (the GGUF's order; the block order permutes each 128 bytes)
//            scale, offset float32 [N, G]   W[n, 32 g + i] = q * scale[n, g] + offset[n, g]
//            (Q4_1: scale = d, offset = m; Q4_0: scale = d, offset = -8 d: exact)
//     q8_0:  qs int8 [N, K]; d float32 [N, G]          W[n, 32 g + i] = qs * d[n, g]  (exact)
//
// Activations as 16-bit integers: each row's 32-element group g is rounded once to ``x'_i = a_g *
// e_i``, ``e_i = round(x_i * 32767 / max|x_g|)`` (int16, ``a_g = max|x_g| / 32767``), so ``y = sum_g
// a_g * (scale * (q . e_g) + offset * sum(e_g))`` = ``W . x'`` up to float32 rounding. The dot
// products are integer (AVX2 ``vpmaddwd``: 16 weight-activation pairs per instruction, exact), one
// conversion and one FMA per group in the GGUF order (per 8 groups in the block order): the
// weights need no conversion to floats (a float32 loop spent 2 shuffles and a convert per 8
// weights unpacking them, and ran at half this speed at M = 1 on a 2-core AVX2 EPYC). The rounding moves an element by about ``max|x_g| / 65534`` at most: outputs are
// within ~3e-5 relative of float32 activations', against ~4e-3 for the bf16 rounding torch's
// int4/int8 kernels make (llama.cpp rounds activations to 8 bits). A NaN or an infinity in a row
// makes all its outputs NaN. Each output row's arithmetic is the same whatever M or the thread split
// (work is split over N only, a row is rounded on its own), so a row's result does not depend on the
// batch. AVX2 intrinsics under ``#ifdef __AVX2__`` (the build uses ``-march=native``; AVX-512BW
// does 32 pairs per ``vpmaddwd``: 0.9x the AVX2 loop's time at M = 1 on a 2-core Zen 5 EPYC), the
// same integer arithmetic as scalar loops otherwise. Each row sums into two accumulators (even
// and odd groups; with AVX-512BW and int4, even and odd pairs of groups): one chain of FMAs bound
// the loop by its latency at one row (two: 0.85-0.95x the time for int4, 0.76-0.82x for Q8_0 at
// M = 1 with AVX-512, 0.85-0.97x with AVX2; 1.0-1.09x at M = 4, where the rows' chains already
// overlap); every row count uses them, so rows stay independent of M. With AVX-512BW, int4 groups
// go in pairs: each row's activations are stored with the middle halves of every pair of groups
// swapped (`pair_order`), so the 32 bytes of a pair unpack to exactly the int16 lanes they
// multiply (low nibbles, then high ones) with no shuffle; one load and multiply of 16 groups'
// scales serves 8 pairs, each pair picking its two with one permute per row (and one vpdpwssd
// where the CPU has AVX512-VNNI): against the previous loop (shuffles, a broadcast per group and
// row) 0.91-0.96x the time at 1-4 float32 rows over SmolLM2's 120 layer linears (2-core Zen 4 EPYC).
//
// int4 with AVX2 but not AVX-512BW reads its weights in the block order (`int4_gemv_block_groups()`
// is 8; `GemvBlocks.prepare` in gpu_worker/gemv_blocks.py reorders the GGUF's bytes once, and the
// op refuses weights in another order): every full block of 8 groups is 8 chunks of 16 bytes
// whose byte i holds element 2 c + i % 2 of the block's group i / 2 (low nibble) and element
// 2 (c + 8) + i % 2 (high nibble), and each row's activations are stored to match
// (`block_order`). A chunk then unpacks to two vectors whose vpmaddwd with the activations leaves
// int32 lane j holding group j's products, so a block's 8 group dots add up in one vector (exact
// integers, at most 32 x 32767 x 15 < 2^24, so the conversion is exact too) and take one
// conversion, one scale product and one FMA per row, and the offset term one more FMA: the GGUF
// order's loop spent a conversion, a scalar product with its broadcast and an FMA per group and
// row, and that, not vpmaddwd (one per cycle on Zen 2), bounded it (3.9 cycles per group and row
// against 2.7 in an ad-hoc copy of both loops, one thread, 16 rows). The last G % 8 groups go one
// at a time, each row into the same single accumulator (the block order's rows keep one chain:
// the blocks' FMAs are few). On a 2-core Zen 2 EPYC (AVX2 only) whole float32 decode steps of
// SmolLM2 took 0.78-0.82x the time from 4 rows up (26.8 vs 33.0 ms at 8 rows; 8.8 vs 9.2 at one;
// `scripts/bench_quant.py --steps --dtype float32`, two runs, not interleaved).
//
// Q8_0 with AVX-512BW: where the weights come with a copy in the Q8_0 block order (the op's
// block_groups is `q8_0_gemv_block_groups()`, 16; `GemvBlocks.prepare` makes it for a tied LM head,
// whose own blocks are the embedding's and stay in the GGUF's order), every full block of 16 groups
// is 16 chunks of 32 bytes whose byte i holds element 2 c + i % 2 of the block's group i / 2, and
// the int16 path stores each row's activations to match (`q8_block_order`): a chunk widens to 32
// int16 whose vpmaddwd (vpdpwssd with AVX512-VNNI) with the activations leaves int32 lane j with
// group j's products, so a block's 16 dots add up in one vector (exact integers; the conversion
// of a sum above 2^24 rounds) and take one conversion, one scale product and one FMA per row, up
// to 8 rows per pass over a weight row. On a 2-core Zen 4 the 49,152 x 576 head took 0.73-0.92x
// the GGUF order's time from 4 rows (three noisy runs; 1 row unchanged, bound by memory), and
// whole bf16 decode steps of 2-8 rows 0.94-0.99x (the two orders alternating step by step in one
// engine, docs/benchmarks.md Run 15). The bf16 path reads the GGUF's order only (the op refuses
// the copy there).
//
// bfloat16 activations, on a CPU with AVX512-BF16: the weights of a group are dequantized once to
// bfloat16 (``fma(q, scale, offset)`` in float32, rounded to nearest even: a dense bf16 copy's
// values but for a rare last-bit difference) and each row's group dot is one ``vdpbf16ps`` (bf16
// products are exact in float32, float32 sums; the instruction treats denormals as zero), 4 weight
// rows and up to 6 activation rows per pass, so extra rows cost little: a
// speculative verification of 5 rows took 0.47-0.74x the time of torch's int4 kernel (which
// unpacks the weights once per 4 rows) on SmolLM2's linears. It runs calls of 5 rows or more
// (`kBf16GemvMinRows`, equal to `BF16_GEMV_MIN_TOKENS` in gpu_worker/gemv_blocks.py); fewer bf16
// rows, and every bf16 row on a CPU without AVX512-BF16, are read exactly into the int16 path above
// (no float32 copy to make) and the result rounded once to bf16. So a bf16 row's result depends
// on M only through whether M < 5 (with AVX512-BF16), never on the thread split (weight rows go in
// blocks aligned to multiples of 4, a short last block repeats its last row). A NaN in a bf16 row
// makes its outputs NaN; an infinity gives infinities or NaN there (the int16 path: NaN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;  // rows of x per pass over one weight row

// int4 weights and activations in blocks of this many groups, lanes = groups (AVX2 without
// AVX-512BW: see the module docstring and `block_order`); 1: the GGUF's order.
#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define LANESERVE_INT4_BLOCKED 1
constexpr int64_t kInt4BlockGroups = 8;
#else
constexpr int64_t kInt4BlockGroups = 1;
#endif

// Q8_0 weights and activations in blocks of this many groups, lanes = groups (AVX-512BW: see the
// module docstring and `q8_block_order`); 1: the GGUF's order only. The int16 path reads either
// order (the op's block_groups says which), the bf16 path only the GGUF's.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANESERVE_Q8_BLOCKED 1
constexpr int64_t kQ8BlockGroups = 16;
constexpr int64_t kQ8RowTile = 8;  // rows of x per pass over a weight row in the block order
#else
constexpr int64_t kQ8BlockGroups = 1;
#endif

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The activations as the kernels read them (see the module docstring): e int16 [M, K]; per row
// and group a [M, G] (the step) and t [M, G] = a * sum(e_g) (the offset term's factor).
struct RoundedRows {
  std::vector<int16_t> e;
  std::vector<float> a, t;
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> float32 is a 16-bit shift, exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
RoundedRows round_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  RoundedRows out{std::vector<int16_t>(M * K), std::vector<float>(M * G),
                  std::vector<float>(M * G)};
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int64_t i = 0; i < M * G; ++i) {
    const T* xg = x + i * kGroup;
    int16_t* eg = out.e.data() + i * kGroup;
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < kGroup; ++j) {
      const float v = std::fabs(to_float(xg[j]));
      finite = finite && v <= kMax;  // false for NaN and infinities
      amax = std::max(amax, v);
    }
    const float inv = 32767.f / amax;  // inf for zeros and for a max too small to scale
    if (!finite || !(inv <= kMax)) {
      // A NaN or an infinity makes the row's outputs NaN (a = NaN), as float32 arithmetic would
      // make them NaN or infinite; zeros, or values too small for a finite scale (max below
      // 32767 / FLT_MAX, ~1e-34), contribute nothing.
      std::fill(eg, eg + kGroup, int16_t{0});
      out.a[i] = out.t[i] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    int32_t sum = 0;
#ifdef __AVX2__
    const __m256 mul = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int j = 0; j < 4; ++j)  // round to nearest even, as std::nearbyint below
      q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xg + 8 * j), mul));
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(eg), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(eg + 16), hi);
#else
    for (int64_t j = 0; j < kGroup; ++j)
      eg[j] = static_cast<int16_t>(
          std::clamp(std::nearbyint(to_float(xg[j]) * inv), -32768.f, 32767.f));
#endif
    for (int64_t j = 0; j < kGroup; ++j) sum += eg[j];
    out.a[i] = amax / 32767.f;
    out.t[i] = out.a[i] * static_cast<float>(sum);
  }
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Lanes 0..7: element 2 j, 8..15: element 2 j + 1 (pair j's two group scales, see gemv_row).
alignas(64) constexpr int32_t kPairScaleIndex[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

// d + hi . e pairwise (int32 lanes; vpdpwssd where the CPU has AVX512-VNNI), exact
inline __m512i dot_pairs(__m512i d, __m512i hi, __m512i e) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(d, hi, e);
#else
  return _mm512_add_epi32(d, _mm512_madd_epi16(hi, e));
#endif
}

// Q4 groups in pairs as the AVX-512 loop of gemv_row reads them: within each row's pair of groups
// (2 p, 2 p + 1) the middle halves swap, so the 64 elements run g 0..15, g + 1 0..15, g 16..31,
// g + 1 16..31: the order of the weights' low nibbles, then high nibbles, of the pair's 32 bytes.
inline void pair_order(std::vector<int16_t>& e, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k + 2 * kGroup <= K; k += 2 * kGroup) {
      int16_t* p = e.data() + m * K + k;
      std::swap_ranges(p + 16, p + 32, p + 32);
    }
}
#endif

// One weight row (G groups) against R rows of x: y[r * ldy] = W_n . x'_r, x'_r rounded as in
// `round_rows` (e: R rows of ldx int16, a and t: R rows of G; for int4 with AVX-512BW, e in
// `pair_order`, as `gemv_typed` stores it).
// offset[r] = sum_g off_g * t[r, g] (int4's offset term), 8 groups at a time; 0 without off.
template <int R>
inline void offset_terms(const float* off, int64_t G, const float* t, float* offset) {
  for (int r = 0; r < R; ++r) {
    offset[r] = 0.f;
    if (off == nullptr) continue;
    int64_t g = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= G; g += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(off + g), _mm256_loadu_ps(t + r * G + g), acc);
    offset[r] = hsum8(acc);
#endif
    for (; g < G; ++g) offset[r] += off[g] * t[r * G + g];
  }
}

template <int R, bool Q4, typename Y>
inline void gemv_row(const uint8_t* qs, const float* sc, const float* off, int64_t G,
                     const int16_t* e, int64_t ldx, const float* a, const float* t, Y* y,
                     int64_t ldy) {
  float offset[R];
  offset_terms<R>(Q4 ? off : nullptr, G, t, offset);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // 32 weight-activation pairs per vpmaddwd, into two accumulators per row (at one row a single
  // chain of FMAs bounded the loop by its latency)
  __m512 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  int64_t g = 0;
  if (Q4) {
    // Groups in pairs, the activations in `pair_order` (e's halves match the nibbles as they
    // unpack: no shuffles): lanes 0..7 of a pair's int32 dots are group g's, 8..15 group g + 1's,
    // scaled by their two scale * a, permuted out of the 16 groups' loaded at once. Even pairs go
    // to acc, odd ones to acc2.
    const int64_t G2 = G & ~int64_t{1};
    for (int64_t g0 = 0; g0 < G2; g0 += 16) {
      const int64_t ng = std::min<int64_t>(16, G2 - g0);
      const __mmask16 mask = static_cast<__mmask16>((1u << ng) - 1);
      const __m512 scale = _mm512_maskz_loadu_ps(mask, sc + g0);
      __m512 s16[R];
      for (int r = 0; r < R; ++r)
        s16[r] = _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(mask, a + r * G + g0));
      for (int64_t j = 0; 2 * j < ng; ++j) {
        const int64_t gg = g0 + 2 * j;
        const __m512i b = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + gg * 16)));
        const __m512i lo = _mm512_and_si512(b, low4), hi = _mm512_srli_epi16(b, 4);
        const __m512i idx = _mm512_load_si512(kPairScaleIndex[j]);
        for (int r = 0; r < R; ++r) {
          const int16_t* er = e + r * ldx + gg * kGroup;
          const __m512i d = dot_pairs(_mm512_madd_epi16(lo, _mm512_loadu_si512(er)), hi,
                                      _mm512_loadu_si512(er + kGroup));
          const __m512 s = _mm512_permutexvar_ps(idx, s16[r]);
          if (j & 1)
            acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc2[r]);
          else
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r]);
        }
      }
    }
    g = G2;
  }
  for (; !Q4 && g + 2 <= G; g += 2) {
    const __m256i* q = reinterpret_cast<const __m256i*>(qs + g * kGroup);
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(q));  // group g as int16
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(q + 1));
    for (int r = 0; r < R; ++r) {
      const int16_t* er = e + r * ldx + g * kGroup;
      const __m512i d0 = _mm512_madd_epi16(w0, _mm512_loadu_si512(er));
      const __m512i d1 = _mm512_madd_epi16(w1, _mm512_loadu_si512(er + kGroup));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(sc[g] * a[r * G + g]),
                               acc[r]);
      acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1),
                                _mm512_set1_ps(sc[g + 1] * a[r * G + g + 1]), acc2[r]);
    }
  }
  if (g < G) {  // an odd group count's last group
    __m512i w;
    if (Q4) {
      const __m256i b = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16)));
      w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0x0F))),
          _mm256_srli_epi16(b, 4), 1);
    } else {
      w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g * kGroup)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i d = _mm512_madd_epi16(w, _mm512_loadu_si512(e + r * ldx + g * kGroup));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sc[g] * a[r * G + g]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r * ldy] = static_cast<Y>(_mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r])) + offset[r]);
#elif defined(__AVX2__)
  // two groups per iteration into two accumulators per row, as above
  __m256 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  // weights 0..15 and 16..31 of group g as int16
  auto unpack = [&](int64_t g, __m256i& w0, __m256i& w1) {
    if (Q4) {
      const __m256i b = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16)));
      w0 = _mm256_and_si256(b, low4);
      w1 = _mm256_srli_epi16(b, 4);
    } else {
      const __m128i* q = reinterpret_cast<const __m128i*>(qs + g * kGroup);
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(q));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1));
    }
  };
  auto fma_group = [&](int r, int64_t g, __m256i w0, __m256i w1, __m256 into) {
    const __m256i* er = reinterpret_cast<const __m256i*>(e + r * ldx + g * kGroup);
    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(er)),
                                       _mm256_madd_epi16(w1, _mm256_loadu_si256(er + 1)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sc[g] * a[r * G + g]), into);
  };
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    __m256i w0, w1, v0, v1;
    unpack(g, w0, w1);
    unpack(g + 1, v0, v1);
    for (int r = 0; r < R; ++r) {
      acc[r] = fma_group(r, g, w0, w1, acc[r]);
      acc2[r] = fma_group(r, g + 1, v0, v1, acc2[r]);
    }
  }
  if (g < G) {
    __m256i w0, w1;
    unpack(g, w0, w1);
    for (int r = 0; r < R; ++r) acc[r] = fma_group(r, g, w0, w1, acc[r]);
  }
  for (int r = 0; r < R; ++r)
    y[r * ldy] = static_cast<Y>(hsum8(_mm256_add_ps(acc[r], acc2[r])) + offset[r]);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int16_t* eg = e + r * ldx + g * kGroup;
      int32_t dot = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        int32_t q;
        if (Q4) {
          const uint8_t b = qs[g * 16 + (i & 15)];
          q = i < 16 ? (b & 15) : (b >> 4);
        } else {
          q = reinterpret_cast<const int8_t*>(qs)[g * kGroup + i];
        }
        dot += q * eg[i];
      }
      total += static_cast<float>(dot) * (sc[g] * a[r * G + g]);
    }
    y[r * ldy] = static_cast<Y>(total + offset[r]);
  }
#endif
}

#ifdef LANESERVE_INT4_BLOCKED
// Each row's activations in the int4 block order: within every full block of 8 groups the 256
// elements run k = 0..15, then group j = 0..7, then t = 0..1 (element 2 k + t of group j), the
// order the weights' nibbles unpack in; the last G % 8 groups stay in order.
inline void block_order(std::vector<int16_t>& e, int64_t M, int64_t K) {
  int16_t tmp[8 * kGroup];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 + 8 * kGroup <= K; k0 += 8 * kGroup) {
      int16_t* p = e.data() + m * K + k0;
      std::copy(p, p + 8 * kGroup, tmp);
      for (int k = 0; k < 16; ++k)
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 2; ++t) p[k * 16 + j * 2 + t] = tmp[j * kGroup + 2 * k + t];
    }
}

// One int4 weight row in the block order (see `int4_block_order` in gpu_worker/gemv_blocks.py:
// byte i of a block's chunk c holds element 2 c + i % 2 of group i / 2 in its low nibble and
// element 2 (c + 8) + i % 2 in its high one) against R rows of x in `block_order`. A chunk
// unpacks to two vectors of 16 int16 whose vpmaddwd with the activations leaves lane j with group
// j's products, so a block's 8 integer dots add up in one vector (exact) and take one conversion,
// one scale product and one FMA per row; the GGUF order's loop spent those per group. The last
// G % 8 groups go one at a time, as in gemv_row.
template <int R, typename Y>
inline void int4_row_blocked(const uint8_t* qs, const float* sc, const float* off, int64_t G,
                             const int16_t* e, int64_t ldx, const float* a, const float* t,
                             Y* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t blocks = G / 8;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    const uint8_t* qb = qs + blk * 8 * 16;
    for (int c = 0; c < 8; ++c) {
      const __m256i b =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + c * 16)));
      const __m256i w0 = _mm256_and_si256(b, low4), w1 = _mm256_srli_epi16(b, 4);
      for (int r = 0; r < R; ++r) {
        const __m256i* er = reinterpret_cast<const __m256i*>(e + r * ldx + blk * 8 * kGroup);
        dot[r] = _mm256_add_epi32(
            dot[r], _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(er + c)),
                                     _mm256_madd_epi16(w1, _mm256_loadu_si256(er + c + 8))));
      }
    }
    const __m256 s = _mm256_loadu_ps(sc + blk * 8), o = _mm256_loadu_ps(off + blk * 8);
    for (int r = 0; r < R; ++r) {  // the block's 8 groups' dots, then their offset terms
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                               _mm256_mul_ps(s, _mm256_loadu_ps(a + r * G + blk * 8)), acc[r]);
      acc[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(t + r * G + blk * 8), acc[r]);
    }
  }
  float tail[R] = {};
  for (int64_t g = blocks * 8; g < G; ++g) {
    const __m256i b =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16)));
    const __m256i w0 = _mm256_and_si256(b, low4), w1 = _mm256_srli_epi16(b, 4);
    for (int r = 0; r < R; ++r) {
      const __m256i* er = reinterpret_cast<const __m256i*>(e + r * ldx + g * kGroup);
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(er)),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256(er + 1)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sc[g] * a[r * G + g]),
                               acc[r]);
      tail[r] += off[g] * t[r * G + g];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = static_cast<Y>(hsum8(acc[r]) + tail[r]);
}
#endif

#ifdef LANESERVE_Q8_BLOCKED
// Each row's activations in the Q8_0 block order: within every full block of 16 groups the 512
// elements run c = 0..15, then group j = 0..15, then t = 0..1 (element 2 c + t of group j), the
// order the weights of `q8_0_block_order` (gpu_worker/gemv_blocks.py) unpack in; the last G % 16
// groups stay in order.
inline void q8_block_order(std::vector<int16_t>& e, int64_t M, int64_t K) {
  constexpr int64_t kBlock = 16 * kGroup;
  int16_t tmp[kBlock];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 + kBlock <= K; k0 += kBlock) {
      int16_t* p = e.data() + m * K + k0;
      std::copy(p, p + kBlock, tmp);
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 16; ++j)
          for (int t = 0; t < 2; ++t) p[c * 32 + j * 2 + t] = tmp[j * kGroup + 2 * c + t];
    }
}

// One Q8_0 weight row in the block order (chunk c of a block: 32 bytes, byte i = element
// 2 c + i % 2 of the block's group i / 2) against R rows of x in `q8_block_order`. A chunk
// widens to 32 int16 whose vpmaddwd (vpdpwssd with AVX512-VNNI) with the activations adds
// into int32 lane j group j's products, so a block's 16 integer dots add up in one vector
// (exact: at most 32 x 128 x 32768 < 2^31; the conversion of a sum above 2^24 rounds) and take
// one conversion, one scale product and one FMA per row; the GGUF order's loop spent a
// conversion, a broadcast scale product and an FMA per group and row (3.8 vs 1.9 cycles per
// group and row at 4 rows, one thread of a Zen 4, an ad-hoc copy of both loops). The last
// G % 16 groups go one at a time.
template <int R, typename Y>
inline void q8_row_blocked(const uint8_t* qs, const float* sc, int64_t G, const int16_t* e,
                           int64_t ldx, const float* a, Y* y, int64_t ldy) {
  const int8_t* q = reinterpret_cast<const int8_t*>(qs);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = G / 16;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    // even and odd chunks into two integer sums per row (one chain of vpdpwssd bounded the
    // loop by its latency at one row); integer sums are exact, so the split changes nothing
    __m512i dot[R], dot2[R];
    for (int r = 0; r < R; ++r) dot[r] = dot2[r] = _mm512_setzero_si512();
    const int8_t* qb = q + blk * 16 * kGroup;
    for (int c = 0; c < 16; c += 2) {
      const __m512i w0 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * kGroup)));
      const __m512i w1 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (c + 1) * kGroup)));
      for (int r = 0; r < R; ++r) {
        const int16_t* er = e + r * ldx + blk * 16 * kGroup + c * 32;
        dot[r] = dot_pairs(dot[r], w0, _mm512_loadu_si512(er));
        dot2[r] = dot_pairs(dot2[r], w1, _mm512_loadu_si512(er + 32));
      }
    }
    const __m512 s = _mm512_loadu_ps(sc + blk * 16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[r], dot2[r])),
                               _mm512_mul_ps(s, _mm512_loadu_ps(a + r * G + blk * 16)), acc[r]);
  }
  for (int64_t g = blocks * 16; g < G; ++g) {
    const __m512i w = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroup)));
    for (int r = 0; r < R; ++r) {
      const __m512i d = _mm512_madd_epi16(w, _mm512_loadu_si512(e + r * ldx + g * kGroup));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sc[g] * a[r * G + g]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = static_cast<Y>(_mm512_reduce_add_ps(acc[r]));
}
#endif

template <int R, bool Q4, typename Y>
inline void gemv_tile(const uint8_t* qs, const float* sc, const float* off, int64_t G,
                      const int16_t* e, int64_t ldx, const float* a, const float* t, Y* y,
                      int64_t ldy, bool q8_blocked) {
#ifdef LANESERVE_INT4_BLOCKED
  if constexpr (Q4) return int4_row_blocked<R>(qs, sc, off, G, e, ldx, a, t, y, ldy);
#endif
#ifdef LANESERVE_Q8_BLOCKED
  if constexpr (!Q4) if (q8_blocked) return q8_row_blocked<R>(qs, sc, G, e, ldx, a, y, ldy);
#endif
  (void)q8_blocked;
  gemv_row<R, Q4>(qs, sc, off, G, e, ldx, a, t, y, ldy);
}

// Read `bytes` at `p` into the caches ahead of use, a line at a time: the hardware prefetchers
// alone left DRAM-resident weights at 0.4-0.55x the rate of cache-resident ones (Run 31).
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Weight rows read this many rows ahead of the one being multiplied (its quants and scales).
constexpr int64_t kPrefetchRows = 2;

template <bool Q4, typename Y>
void gemv_rows(const uint8_t* qs, const float* sc, const float* off, int64_t N, int64_t K,
               int64_t row_bytes, const RoundedRows& x, int64_t M, Y* y, int64_t n0,
               int64_t n1, bool q8_blocked) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = qs + n * row_bytes;
    const float* sn = sc + n * G;
    const float* on = Q4 ? off + n * G : nullptr;
    if (n + kPrefetchRows < n1) {
      prefetch_lines(qn + kPrefetchRows * row_bytes, row_bytes);
      prefetch_lines(sn + kPrefetchRows * G, G * 4);
      if (Q4) prefetch_lines(on + kPrefetchRows * G, G * 4);
    }
    for (int64_t m = 0; m < M;) {
      const int16_t* em = x.e.data() + m * K;
      const float* am = x.a.data() + m * G;
      const float* tm = x.t.data() + m * G;
      Y* ym = y + m * N + n;
#ifdef LANESERVE_Q8_BLOCKED
      if (!Q4 && q8_blocked && M - m > kRowTile) {  // up to 8 rows per pass (32 registers)
        switch (std::min<int64_t>(M - m, kQ8RowTile)) {
          case 8: q8_row_blocked<8>(qn, sn, G, em, K, am, ym, N); m += 8; break;
          case 7: q8_row_blocked<7>(qn, sn, G, em, K, am, ym, N); m += 7; break;
          case 6: q8_row_blocked<6>(qn, sn, G, em, K, am, ym, N); m += 6; break;
          default: q8_row_blocked<5>(qn, sn, G, em, K, am, ym, N); m += 5; break;
        }
        continue;
      }
#endif
      switch (std::min<int64_t>(M - m, kRowTile)) {
        case 4: gemv_tile<4, Q4>(qn, sn, on, G, em, K, am, tm, ym, N, q8_blocked); m += 4; break;
        case 3: gemv_tile<3, Q4>(qn, sn, on, G, em, K, am, tm, ym, N, q8_blocked); m += 3; break;
        case 2: gemv_tile<2, Q4>(qn, sn, on, G, em, K, am, tm, ym, N, q8_blocked); m += 2; break;
        default: gemv_tile<1, Q4>(qn, sn, on, G, em, K, am, tm, ym, N, q8_blocked); m += 1; break;
      }
    }
  }
}

void check_gemv_args(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     int64_t row_bytes_per_group, at::ScalarType qtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K], contiguous");
  const int64_t K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % kGroup == 0, "K = ", K, " is not a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == qtype && qs.is_contiguous() &&
              qs.size(1) == K / kGroup * row_bytes_per_group, "qs must be [N, ",
              K / kGroup * row_bytes_per_group, "] ", qtype, ", contiguous; got ", qs.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == N && scale.size(1) == K / kGroup,
              "scales must be float32 [N, K / 32], contiguous");
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 activations on a CPU with AVX512-BF16: each weight group is dequantized once to
// bfloat16 (w = q * scale + offset in float32, rounded to nearest even: the rounding of a dense
// bf16 copy) and every row's group dot product is one vdpbf16ps (products exact in float32,
// float32 sums). Weight rows go kNb at a time (blocks aligned to multiples of kNb, so a row's
// arithmetic does not depend on the thread split), activation rows up to kRowTileBf16 at a time:
// the work per extra activation row is one dot per group, so a few rows (a speculative
// verification, a small decode batch) cost little more than one.
constexpr int64_t kNb = 4;
constexpr int64_t kRowTileBf16 = 6;
// Fewer bf16 rows go through the int16 path (see the module docstring). Keep equal to
// BF16_GEMV_MIN_TOKENS (gpu_worker/gemv_blocks.py: fewer int4 rows go to torch's kernel).
constexpr int64_t kBf16GemvMinRows = 5;

template <bool Q4>
inline __m512bh group_as_bf16(const uint8_t* qs, int64_t g, float scale, float offset) {
  __m512 lo, hi;  // weights 0..15 and 16..31 as floats (small integers: exact)
  if (Q4) {
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
    lo = _mm512_fmadd_ps(lo, s, o);
    hi = _mm512_fmadd_ps(hi, s, o);
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(qs + g * kGroup);
    const __m512 s = _mm512_set1_ps(scale);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from lo, 16..31 from hi
}

// The sums of 4 accumulators' 16 lanes, in one fixed order for every output.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  const __m512 t = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0x4E));
  return _mm512_castps512_ps128(_mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1)));
}

// Weight rows qs[b]..qs[b + kNb) (pointers; a short block repeats its last row) against R rows
// of x: y[r * ldy + b] for b < nb.
template <int R, bool Q4>
inline void gemv_block_bf16(const uint8_t* const* qs, const float* const* sc,
                            const float* const* off, int64_t G, const c10::BFloat16* x,
                            int64_t ldx, c10::BFloat16* y, int64_t ldy, int64_t nb) {
  __m512 acc[R][kNb];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < kNb; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512bh w[kNb];
    for (int b = 0; b < kNb; ++b)
      w[b] = group_as_bf16<Q4>(qs[b], g, sc[b][g], Q4 ? off[b][g] : 0.f);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_loadu_si512(x + r * ldx + g * kGroup);
      for (int b = 0; b < kNb; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[b], xr);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float out[4];
    _mm_store_ps(out, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int64_t b = 0; b < nb; ++b) y[r * ldy + b] = static_cast<c10::BFloat16>(out[b]);
  }
}

template <bool Q4>
void gemv_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
               const at::Tensor* offset, at::Tensor& y) {
  static_assert(kNb == 4, "reduce4");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / kGroup;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offset ? offset->data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t row_bytes = qs.size(1);
  const int64_t blocks = (N + kNb - 1) / kNb;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, kNb * row_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kNb, nb = std::min(kNb, N - n);
      const uint8_t* q[kNb];
      const float* s[kNb];
      const float* o[kNb];
      for (int64_t b = 0; b < kNb; ++b) {
        const int64_t nn = n + std::min(b, nb - 1);
        q[b] = qp + nn * row_bytes;
        s[b] = sp + nn * G;
        o[b] = Q4 ? op + nn * G : nullptr;
      }
      if (blk + 1 < b1) {  // the next block's rows (`prefetch_lines`)
        const int64_t ahead = std::min(kNb, N - n - kNb);
        prefetch_lines(qp + (n + kNb) * row_bytes, ahead * row_bytes);
        prefetch_lines(sp + (n + kNb) * G, ahead * G * 4);
        if (Q4) prefetch_lines(op + (n + kNb) * G, ahead * G * 4);
      }
      for (int64_t m = 0; m < M;) {
        const c10::BFloat16* xm = xp + m * K;
        c10::BFloat16* ym = yp + m * N + n;
        switch (std::min<int64_t>(M - m, kRowTileBf16)) {
          case 6: gemv_block_bf16<6, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 6; break;
          case 5: gemv_block_bf16<5, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 5; break;
          case 4: gemv_block_bf16<4, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 4; break;
          case 3: gemv_block_bf16<3, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 3; break;
          case 2: gemv_block_bf16<2, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 2; break;
          default: gemv_block_bf16<1, Q4>(q, s, o, G, xm, K, ym, N, nb); m += 1; break;
        }
      }
    }
  });
}
#endif

template <bool Q4, typename T>
void gemv_typed(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                const at::Tensor* offset, at::Tensor& y, bool q8_blocked) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  RoundedRows rows = round_rows(x.data_ptr<T>(), M, K);
#ifdef LANESERVE_Q8_BLOCKED
  if (!Q4 && q8_blocked) q8_block_order(rows.e, M, K);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (Q4) pair_order(rows.e, M, K);
#endif
#ifdef LANESERVE_INT4_BLOCKED
  if (Q4) block_order(rows.e, M, K);
#endif
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offset ? offset->data_ptr<float>() : nullptr;
  T* yp = y.data_ptr<T>();
  const int64_t row_bytes = qs.size(1);
  // ~16 KB of weights per task at least, so a small matrix stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    gemv_rows<Q4>(qp, sp, op, N, K, row_bytes, rows, M, yp, n0, n1, q8_blocked);
  });
}

// Whether a call of M rows of `dtype` runs the bf16 path (which reads the GGUF order only).
bool takes_bf16_path(at::ScalarType dtype, int64_t M) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return dtype == at::kBFloat16 && M >= kBf16GemvMinRows;
#else
  (void)dtype;
  (void)M;
  return false;
#endif
}

// y in x's dtype (float32, or bfloat16 rounded to nearest even from the float32 result);
// q8_blocked: Q8_0 weights in `q8_0_block_order` (the int16 path only)
template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                const at::Tensor* offset, bool q8_blocked = false) {
  auto y = at::empty({x.size(0), qs.size(0)}, x.options());
  if (y.numel() == 0) return y;
  if (takes_bf16_path(x.scalar_type(), x.size(0))) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    gemv_bf16<Q4>(x, qs, scale, offset, y);
#endif
  } else if (x.scalar_type() == at::kBFloat16) {
    gemv_typed<Q4, c10::BFloat16>(x, qs, scale, offset, y, q8_blocked);
  } else {
    gemv_typed<Q4, float>(x, qs, scale, offset, y, q8_blocked);
  }
  return y;
}

// x [M, K] f32 or bf16; qs uint8 [N, K/2] in the block order of block_groups groups (the
// build's `int4_gemv_block_groups()`); scale, offset f32 [N, K/32] -> [M, N] in x's dtype
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& offset, int64_t block_groups) {
  TORCH_CHECK(block_groups == kInt4BlockGroups, "int4 weights in blocks of ", block_groups,
              " groups, but this build reads blocks of ", kInt4BlockGroups,
              " (GemvBlocks converts them on its first call)");
  check_gemv_args(x, qs, scale, 16, at::kByte);
  TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == at::kFloat &&
              offset.is_contiguous(), "offset must be float32 like scale");
  return gemv<true>(x, qs, scale, &offset);
}

// x [M, K] f32 or bf16; qs int8 [N, K] in the GGUF's order (block_groups 1) or in
// `q8_0_block_order` (block_groups = the build's `q8_0_gemv_block_groups()`, read by the int16
// path only: not for bf16 calls of kBf16GemvMinRows rows or more where the CPU has
// AVX512-BF16); d f32 [N, K/32] -> [M, N] in x's dtype
at::Tensor q8_0_gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     int64_t block_groups) {
  TORCH_CHECK(block_groups == 1 || block_groups == kQ8BlockGroups, "Q8_0 weights in blocks of ",
              block_groups, " groups, but this build reads blocks of 1 or ", kQ8BlockGroups);
  check_gemv_args(x, qs, d, 32, at::kChar);
  TORCH_CHECK(block_groups == 1 || !takes_bf16_path(x.scalar_type(), x.size(0)),
              "bf16 calls of ", x.size(0), " rows run the bf16 GEMV, which reads Q8_0 weights in "
              "the GGUF's order (block_groups 1)");
  return gemv<false>(x, qs, d, nullptr, block_groups != 1);
}

int64_t int4_gemv_block_groups() { return kInt4BlockGroups; }
int64_t q8_0_gemv_block_groups() { return kQ8BlockGroups; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("int4_gemv(Tensor x, Tensor qs, Tensor scale, Tensor offset, int block_groups) -> Tensor");
  m.def("int4_gemv_block_groups() -> int", &int4_gemv_block_groups);
  m.def("q8_0_gemv_block_groups() -> int", &q8_0_gemv_block_groups);
  m.def("q8_0_gemv(Tensor x, Tensor qs, Tensor d, int block_groups) -> Tensor");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("q8_0_gemv", &q8_0_gemv);
}
