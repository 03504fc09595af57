// The int8 route of the K-quant GEMV: integer dot products of the weights' own quants with the
// activations quantized once per call, as llama.cpp's ggml-cpu does (`quantize_row_q8_K`,
// `ggml_vec_dot_q4_K_q8_K` and its Q5_K / Q6_K siblings; the same arithmetic, our own code).
//
// ``torch.ops.laneserve.kquant_gemv_q8k(x, blocks, qtype, route)`` computes ``y = x @ W.T`` for
// float32 or bfloat16 x [M, K] and blocks uint8 [N, K / 256 * bytes] (kquant_gemv.cpp has the
// layouts); y comes in x's dtype (bf16: the float32 sums rounded as torch rounds them). Each
// row of x is first quantized per 256 values to Q8_K: a float scale xd = max|x| / 127, int8
// xq = round(x / xd) (ties to even) and the sums of xq per 16 (bsums). Each task then takes a
// range of outputs; per super-block it cuts the weight's quants out of their packed bytes once
// (q: 0..15 Q4_K, 0..31 Q5_K, 0..63 Q6_K, in the activations' order), with an int16 scale per
// 16 weights and an int16 "min" per 16, and for each row of x adds
//   xd * (d * sum_g scale_g * sum_{i in g} q_i xq_i  -  dmin * sum_g min_g * bsums_g)
// where for Q4_K / Q5_K (w = d sc q - dmin m) scale_g, min_g are the sub-block's sc and m, and for
// Q6_K (w = d sc (q - 32)) scale_g = sc, min_g = 32 sc, dmin = d. The integer sums are exact
// (|q xq| <= 63 * 127; no int16 or int32 sum can overflow), so the result is the float64 dot
// product of the dequantized weights with the Q8_K-rounded activations up to float32 rounding of
// the per-super-block terms: the only approximation is the activations' int8 rounding (~0.4 %
// of a 256-block's largest value per element).
//
// Routes (``route``): 0 the widest this build has, 1 AVX-512 VNNI (512-bit registers,
// ``vpdpwssd`` for the scale multiply-adds: kquant_q8k_avx512.h), 2 AVX2 (256-bit, ``vpmaddwd``
// + ``vpaddd``), both reading each super-block in place into registers (``vpmaddubsw`` for the
// byte products), 3 scalar (the reference: the
// super-block unpacked to a byte array first); ``kquant_q8k_routes()`` lists the ones built
// (-march=native decides). All give the same integer sums; they differ in the float32
// summation order over super-blocks only.
//
// The x16 layout (kquant_q8k_x16.h): ``kquant_repack_x16(blocks, qtype)`` interleaves each 16
// outputs' super-blocks ([N / 16, K / 256 * unit bytes]); a part passed as ``qtype | 256`` is in
// it: route 1 runs its own GEMV (one ``vpdpbusd`` per 4 weights of 16 outputs), the others a
// reference one; ``kquant_dequantize_x16`` gives the weight back. In a fused call a "row" of
// such a part is 16 outputs.
#include "kquant.h"

namespace laneserve {
namespace {

using kquant::kQ5K;
using kquant::kQ6K;
using kquant::kQK;

constexpr int kGroups = kQK / 16;  // the 16-weight groups of a super-block

// One super-block's quants in the activations' order with its per-16 scales and mins.
struct Unpacked {
  alignas(64) uint8_t q[kQK];
  alignas(32) int16_t scale[kGroups];
  alignas(32) int16_t min[kGroups];
  float d, dmin;
};

// Q8_K activations of M rows: xq int8 [M, K], xd [M, K / 256], bsums [M, K / 16].
struct Q8K {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
};

void quantize_block(const float* x, int8_t* q, float* d, int16_t* bsums) {
  float amax = 0.0f;  // NaN if any x is: the outputs then are NaN, as the fp32 route's
  for (int i = 0; i < kQK; ++i) {
    const float a = std::fabs(x[i]);
    amax = (a > amax || a != a) ? a : amax;
  }
  if (amax == 0.0f) {
    std::memset(q, 0, kQK);
    std::memset(bsums, 0, kGroups * sizeof(int16_t));
    *d = 0.0f;
    return;
  }
  const float iscale = 127.0f / amax;
  *d = amax / 127.0f;
#pragma omp simd
  for (int i = 0; i < kQK; ++i) {
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * iscale))));
  }
  for (int g = 0; g < kGroups; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[16 * g + i];
    bsums[g] = static_cast<int16_t>(s);
  }
}

// x float32 or bfloat16 [M, K], contiguous (a bf16 block widened to float32 first: exact).
Q8K quantize_rows(const at::Tensor& x, int64_t M, int64_t K) {
  const int64_t nb = K / kQK;
  Q8K a{std::vector<int8_t>(M * K), std::vector<float>(M * nb),
        std::vector<int16_t>(M * nb * kGroups)};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const c10::BFloat16* xb = bf16 ? x.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    alignas(64) float widened[kQK];
    for (int64_t i = i0; i < i1; ++i) {
      const float* block = xf ? xf + i * kQK : widened;
      if (!xf) load_row(xb + i * kQK, widened, kQK);
      quantize_block(block, a.q.data() + i * kQK, a.d.data() + i, a.bsums.data() + i * kGroups);
    }
  });
  return a;
}

// Q4_K and Q5_K's 12 packed bytes -> scales sc[0..7] (bytes of t[0..1]) and mins m[0..7]
// (t[2..3]), as kquant::scale_min_k4 gives them one at a time.
inline void scales_mins_k4(const uint8_t* packed, uint32_t t[4]) {
  std::memcpy(t, packed, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  t[3] = ((t[2] >> 4) & kLow4) | (((t[1] >> 6) & kLow2) << 4);
  const uint32_t mins_low = t[1] & kLow6;
  t[1] = (t[2] & kLow4) | (((t[0] >> 6) & kLow2) << 4);
  t[2] = mins_low;
  t[0] &= kLow6;
}

// Q4_K and Q5_K: sub-blocks 2j, 2j + 1 are the low and high nibbles of qs[32 j .. 32 j + 31]
// (Q5_K's fifth bit: bits 2j, 2j + 1 of qh[l]).
void unpack_q45_k(const uint8_t* b, bool five, Unpacked* u) {
  u->d = kquant::fp16(b);
  u->dmin = kquant::fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five ? b + 48 : b + 16;
  uint32_t t[4];  // sc[0..7] (bytes 0-7), m[0..7] (bytes 8-15)
  scales_mins_k4(scales, t);
#ifdef __AVX2__
  // each byte widened to int16 twice: the two 16-groups of a sub-block
  const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
  const __m128i sc16 = _mm_cvtepu8_epi16(sm), m16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
  _mm_store_si128(reinterpret_cast<__m128i*>(u->scale), _mm_unpacklo_epi16(sc16, sc16));
  _mm_store_si128(reinterpret_cast<__m128i*>(u->scale + 8), _mm_unpackhi_epi16(sc16, sc16));
  _mm_store_si128(reinterpret_cast<__m128i*>(u->min), _mm_unpacklo_epi16(m16, m16));
  _mm_store_si128(reinterpret_cast<__m128i*>(u->min + 8), _mm_unpackhi_epi16(m16, m16));
#else
  uint8_t sm[16];
  std::memcpy(sm, t, 16);
  for (int g = 0; g < kGroups; ++g) {
    u->scale[g] = sm[g / 2];
    u->min[g] = sm[8 + g / 2];
  }
#endif
  for (int j = 0; j < 4; ++j) {
    const uint8_t* q = qs + 32 * j;
    uint8_t* y = u->q + 64 * j;
    if (five) {
      const int s0 = 2 * j, s1 = 2 * j + 1;
#pragma omp simd
      for (int l = 0; l < 32; ++l) {
        y[l] = static_cast<uint8_t>((q[l] & 0xF) | (((qh[l] >> s0) & 1) << 4));
        y[32 + l] = static_cast<uint8_t>((q[l] >> 4) | (((qh[l] >> s1) & 1) << 4));
      }
    } else {
#pragma omp simd
      for (int l = 0; l < 32; ++l) {
        y[l] = q[l] & 0xF;
        y[32 + l] = q[l] >> 4;
      }
    }
  }
}

// Q6_K: per half of 128, weights l, l + 32, l + 64, l + 96 are the low / high nibbles of ql[l]
// and ql[l + 32] with bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l]; group g's scale is scales[g].
void unpack_q6_k(const uint8_t* b, Unpacked* u) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  u->d = u->dmin = kquant::fp16(b + 208);
  for (int g = 0; g < kGroups; ++g) {
    u->scale[g] = sc[g];
    u->min[g] = static_cast<int16_t>(32 * sc[g]);
  }
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l0 = ql + 64 * half;
    const uint8_t* h0 = qh + 32 * half;
    uint8_t* y = u->q + 128 * half;
#pragma omp simd
    for (int l = 0; l < 32; ++l) {
      const int h = h0[l];
      y[l] = static_cast<uint8_t>((l0[l] & 0xF) | ((h & 3) << 4));
      y[l + 32] = static_cast<uint8_t>((l0[l + 32] & 0xF) | (((h >> 2) & 3) << 4));
      y[l + 64] = static_cast<uint8_t>((l0[l] >> 4) | (((h >> 4) & 3) << 4));
      y[l + 96] = static_cast<uint8_t>((l0[l + 32] >> 4) | (((h >> 6) & 3) << 4));
    }
  }
}

template <int64_t kType>
inline void unpack(const uint8_t* b, Unpacked* u) {
  if constexpr (kType == kQ6K) {
    unpack_q6_k(b, u);
  } else {
    unpack_q45_k(b, kType == kQ5K, u);
  }
}

// acc[0..15] += xd * (d * sum_g scale_g qxq_g - dmin * sum_g min_g bsums_g), in some lanes.
using BlockDot = void (*)(const Unpacked&, const int8_t*, const int16_t*, float, float*);

void block_dot_scalar(const Unpacked& u, const int8_t* xq, const int16_t* bs, float xd,
                      float* acc) {
  int32_t isum = 0, msum = 0;
  for (int g = 0; g < kGroups; ++g) {
    int32_t s = 0;
    for (int i = 16 * g; i < 16 * g + 16; ++i) s += u.q[i] * xq[i];
    isum += u.scale[g] * s;
    msum += u.min[g] * bs[g];
  }
  acc[0] += xd * (u.d * static_cast<float>(isum) - u.dmin * static_cast<float>(msum));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#define LANESERVE_KQUANT_VNNI 1
#endif

#ifdef LANESERVE_KQUANT_VNNI
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

// One part of a (fused) weight: its blocks, and y the part's first column of the output.
struct GemvArgs {
  const uint8_t* blocks;
  int64_t nb, bytes, M, ldy;  // ldy: the output's row stride (all parts' outputs)
  const Q8K* a;
  float* y;
};

// Outputs n0..n1: each super-block unpacked once, then one block dot per row of x (inlined).
template <int64_t kType, BlockDot kDot>
void gemv_rows(const GemvArgs& g, int64_t n0, int64_t n1) {
  Unpacked u;
  std::vector<float> acc(g.M * 16);
  const int8_t* xq = g.a->q.data();
  const int16_t* bsums = g.a->bsums.data();
  const float* xd = g.a->d.data();
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* row = g.blocks + n * g.nb * g.bytes;
    for (int64_t b = 0; b < g.nb; ++b) {
      unpack<kType>(row + b * g.bytes, &u);
      for (int64_t m = 0; m < g.M; ++m) {
        const int64_t i = m * g.nb + b;
        kDot(u, xq + i * kQK, bsums + i * kGroups, xd[i], acc.data() + m * 16);
      }
    }
    for (int64_t m = 0; m < g.M; ++m) {
      const float* s = acc.data() + m * 16;
      float t = 0.0f;
      for (int l = 0; l < 16; ++l) t += s[l];
      g.y[m * g.ldy + n] = t;
    }
  }
}

using Rows = void (*)(const GemvArgs&, int64_t, int64_t);

template <BlockDot kDot>
Rows rows_of(int64_t qtype) {
  if (qtype == kQ6K) return gemv_rows<kQ6K, kDot>;
  if (qtype == kQ5K) return gemv_rows<kQ5K, kDot>;
  return gemv_rows<kquant::kQ4K, kDot>;
}

#if defined(__AVX2__) && defined(__FMA__)
// The SIMD routes read each super-block where it lies (no unpacked copy): the quants are cut out
// of their packed bytes into registers once per super-block, in the activations' order. On the
// AVX2 route 32 weights of one or two scale groups a register, and each row of x takes 8
// `vpmaddubsw` (byte pairs -> int16) and 8 scale multiply-adds (`vpmaddwd` + `vpaddd`: int16 pairs
// -> int32); the AVX-512 VNNI route (kquant_q8k_avx512.h) holds 64 a register. The integer sums
// are those of the scalar route.
inline __m256i dot_pairs(__m256i acc, __m256i pairs, __m256i scale) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
}

// One super-block in registers: q[c] the quants of weights 32c .. 32c + 31 (unsigned bytes),
// scale[c] their int16 scales (lanes 0-7 the first 16 weights', 8-15 the second 16's), min the
// per-16 mins (Q6_K: 32 x scale) as int16 [16], d and dmin its float scales.
struct Regs {
  __m256i q[8], scale[8], min;
  float d, dmin;
};

// an int16 pair broadcast: both 128-bit lanes pick int16 `i` of their lane
inline __m256i pick16(__m256i v, int i) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)));
}

// `scales_mins_k4` in registers: the 12 packed bytes at `packed` (read as 16: a super-block's
// quants follow them) -> sc[0..7] in bytes 0-7, m[0..7] in bytes 8-15. Going through a uint32_t
// array, the 16-byte load of four 4-byte stores cost a store-forwarding stall every super-block.
inline __m128i scales_mins_k4_regs(const uint8_t* packed) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));  // t0 t1 t2 -
  const __m128i low = _mm_and_si128(t, _mm_set1_epi32(0x3f3f3f3f));  // sc[0..3], m[0..3]
  const __m128i t2 = _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 2, 2, 2));
  const __m128i nib = _mm_and_si128(_mm_srlv_epi32(t2, _mm_setr_epi32(0, 4, 0, 4)),
                                    _mm_set1_epi32(0x0f0f0f0f));
  const __m128i top =
      _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(t, 6), _mm_set1_epi32(0x03030303)), 4);
  return _mm_unpacklo_epi32(low, _mm_or_si128(nib, top));  // sc[0..3] sc[4..7] m[0..3] m[4..7]
}

// Q4_K / Q5_K: qs[32 j + l]'s low nibble is weight 64 j + l (sub-block 2 j), its high nibble
// 64 j + 32 + l (sub-block 2 j + 1); Q5_K's fifth bits are bits 2 j, 2 j + 1 of qh[l].
template <bool kFive>
inline void load_q45_k(const uint8_t* b, Regs* r) {
  r->d = kquant::fp16(b);
  r->dmin = kquant::fp16(b + 2);
  const __m128i sm = scales_mins_k4_regs(b + 4);  // sc[0..7] (bytes 0-7), m[0..7] (bytes 8-15)
  const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // sc[0..7] per lane
  const __m128i m = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
  r->min = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* qs = kFive ? b + 48 : b + 16;
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFive) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    if constexpr (kFive) {
      const __m256i bit = _mm256_set1_epi8(0x10);  // bit 2 j (2 j + 1) of qh moved to bit 4
      const __m128i s0 = _mm_cvtsi32_si128(2 * j), s1 = _mm_cvtsi32_si128(2 * j + 1);
      const __m256i at4_lo = _mm256_slli_epi16(_mm256_srl_epi16(qh, s0), 4);
      const __m256i at4_hi = _mm256_slli_epi16(_mm256_srl_epi16(qh, s1), 4);
      lo = _mm256_or_si256(lo, _mm256_and_si256(at4_lo, bit));
      hi = _mm256_or_si256(hi, _mm256_and_si256(at4_hi, bit));
    }
    r->q[2 * j] = lo;
    r->q[2 * j + 1] = hi;
    r->scale[2 * j] = pick16(sc, 2 * j);
    r->scale[2 * j + 1] = pick16(sc, 2 * j + 1);
  }
}

// Q6_K: per half of 128, weights l, l + 32, l + 64, l + 96 are the low / high nibbles of ql[l]
// and ql[l + 32] with bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l]; group g's scale is scales[g].
inline void load_q6_k(const uint8_t* b, Regs* r) {
  r->d = r->dmin = kquant::fp16(b + 208);
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  r->min = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5);  // 32 x scale
  // lane 0 the even groups' scales, lane 1 the odd ones': pick16(., c) gives groups 2c, 2c + 1
  const __m128i eo = _mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                                                         9, 11, 13, 15));
  const __m256i sc =
      _mm256_set_m128i(_mm_cvtepi8_epi16(_mm_srli_si128(eo, 8)), _mm_cvtepi8_epi16(eo));
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; ++half) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    __m256i* q = r->q + 4 * half;
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_and_si256(h, high2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
    for (int c = 0; c < 4; ++c) r->scale[4 * half + c] = pick16(sc, 4 * half + c);
  }
}

// acc[0..7] += xd * (d * sum_g scale_g qxq_g - dmin * sum_g min_g bsums_g) for one row of x.
inline __m256 regs_dot(const Regs& r, const int8_t* xq, const int16_t* bs, float xd, __m256 acc) {
  __m256i isum = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * c));
    isum = dot_pairs(isum, _mm256_maddubs_epi16(r.q[c], x), r.scale[c]);
  }
  const __m256i msum =
      _mm256_madd_epi16(r.min, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(xd * r.d), _mm256_cvtepi32_ps(isum), acc);
  return _mm256_fnmadd_ps(_mm256_set1_ps(xd * r.dmin), _mm256_cvtepi32_ps(msum), acc);
}

// How far ahead of the super-block being read the weights are prefetched: the hardware
// prefetchers alone left a DRAM-resident Q4_K matrix at half the rate of a cache-resident one.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBytes;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
}

// Outputs n0..n1 on a SIMD route: each super-block loaded into registers once for all rows.
template <int64_t kType>
void gemv_rows_simd(const GemvArgs& g, int64_t n0, int64_t n1) {
  std::vector<__m256> acc(g.M);
  const int8_t* xq = g.a->q.data();
  const int16_t* bsums = g.a->bsums.data();
  const float* xd = g.a->d.data();
  Regs r;
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    const uint8_t* row = g.blocks + n * g.nb * g.bytes;
    for (int64_t b = 0; b < g.nb; ++b) {
      prefetch_block(row + b * g.bytes, g.bytes);
      if constexpr (kType == kQ6K) {
        load_q6_k(row + b * g.bytes, &r);
      } else {
        load_q45_k<kType == kQ5K>(row + b * g.bytes, &r);
      }
      for (int64_t m = 0; m < g.M; ++m) {
        const int64_t i = m * g.nb + b;
        acc[m] = regs_dot(r, xq + i * kQK, bsums + i * kGroups, xd[i], acc[m]);
      }
    }
    for (int64_t m = 0; m < g.M; ++m) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
      g.y[m * g.ldy + n] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
  }
}

Rows simd_rows_of(int64_t qtype) {
  if (qtype == kQ6K) return gemv_rows_simd<kQ6K>;
  if (qtype == kQ5K) return gemv_rows_simd<kQ5K>;
  return gemv_rows_simd<kquant::kQ4K>;
}
#endif

#ifdef LANESERVE_KQUANT_VNNI
#include "kquant_q8k_avx512.h"
#endif

#include "kquant_q8k_x16.h"

#ifdef LANESERVE_KQUANT_VNNI
Rows rows_512_of(int64_t qtype) {
  if (qtype == (kQ6K | kX16)) return gemv_x16<kQ6K>;
  if (qtype == (kQ5K | kX16)) return gemv_x16<kQ5K>;
  if (qtype == (kquant::kQ4K | kX16)) return gemv_x16<kquant::kQ4K>;
  if (qtype == kQ6K) return gemv_rows_512<kQ6K>;
  if (qtype == kQ5K) return gemv_rows_512<kQ5K>;
  return gemv_rows_512<kquant::kQ4K>;
}
#endif

Rows rows_for(int64_t route, int64_t qtype) {
  route = kquant::pick_route(kquant::built_routes(kWide), route, "kquant_gemv_q8k");
#ifdef LANESERVE_KQUANT_VNNI
  if (route == 1) return rows_512_of(qtype);
#endif
  if (qtype == (kQ6K | kX16)) return gemv_x16_ref<kQ6K>;
  if (qtype == (kQ5K | kX16)) return gemv_x16_ref<kQ5K>;
  if (qtype == (kquant::kQ4K | kX16)) return gemv_x16_ref<kquant::kQ4K>;
#if defined(__AVX2__) && defined(__FMA__)
  if (route == 2) return simd_rows_of(qtype);
#endif
  return rows_of<block_dot_scalar>(qtype);
}

}  // namespace

// Bytes of weights per parallel task at least: ~20 us of reading, so k and v (0.6 MB) split too.
constexpr int64_t kTaskBytes = 1 << 19;

// y [M, sum N_i] = x @ cat(W_i).T with x quantized once. The threads split the parts' bytes
// evenly (a Q6_K row costs more than a Q4_K one): row r of part i goes to the task holding its
// first byte.
at::Tensor kquant_gemv_q8k_fused(const at::Tensor& x, at::TensorList blocks,
                                 at::IntArrayRef qtypes, int64_t route) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(),
              "kquant_gemv_q8k: one qtype per blocks tensor");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "kquant_gemv_q8k: x must be contiguous float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t ldy = 0, total = 0;
  // per part: outputs per row of its blocks tensor (16 in the x16 layout), bytes per unit
  std::vector<int64_t> col(blocks.size()), start(blocks.size() + 1), gran(blocks.size()),
      unit(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const bool x16 = is_x16(qtypes[i]);
    gran[i] = x16 ? kX16Rows : 1;
    unit[i] = x16 ? x16_unit_bytes(qtypes[i]) : kquant::block_bytes(qtypes[i]);
    TORCH_CHECK(blocks[i].dim() == 2 && blocks[i].scalar_type() == at::kByte &&
                    blocks[i].is_contiguous() && blocks[i].size(1) % unit[i] == 0,
                "kquant_gemv_q8k: weight ", i, " is not contiguous uint8 [N / ", gran[i],
                ", K / 256 * ", unit[i], "]");
    const int64_t nb = blocks[i].size(1) / unit[i];
    TORCH_CHECK(K == nb * kQK, "kquant_gemv_q8k: x has ", K, " columns, weight ", i, " ", nb * kQK);
    col[i] = ldy;
    start[i] = total;
    ldy += blocks[i].size(0) * gran[i];
    total += blocks[i].numel();
  }
  start.back() = total;
  at::Tensor y = at::empty({M, ldy}, x.options());
  if (M == 0) return y;  // no rows: the routes' tile sizes would divide by zero
  if (total == 0) return y.zero_();  // K == 0: every output an empty sum (nothing writes y)
  const Q8K a = quantize_rows(x, M, K);
  // bf16 x: the sums go to float32 y_f, each task rounding its outputs into y as torch's
  // .to(torch.bfloat16) would (one op a call, not a float32 x and y and two conversions)
  at::Tensor y_f = bf16 ? at::empty({M, ldy}, x.options().dtype(at::kFloat)) : y;
  std::vector<GemvArgs> args;
  std::vector<Rows> rows;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t nb = K / kQK;
    float* y_i = y_f.data_ptr<float>() + col[i];
    args.push_back({blocks[i].data_ptr<uint8_t>(), nb, unit[i], M, ldy, &a, y_i});
    rows.push_back(rows_for(route, qtypes[i]));
  }
  const float* y_fp = y_f.data_ptr<float>();
  c10::BFloat16* y_b = bf16 ? y.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, total, kTaskBytes, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < args.size(); ++i) {
      const int64_t row_bytes = args[i].nb * args[i].bytes, n = blocks[i].size(0);
      const auto first_row = [&](int64_t b) {  // the first row starting at or after byte b
        const int64_t off = std::clamp(b, start[i], start[i + 1]) - start[i];
        return std::min(n, (off + row_bytes - 1) / row_bytes);
      };
      const int64_t n0 = first_row(b0), n1 = first_row(b1);
      if (n0 >= n1) continue;
      rows[i](args[i], n0 * gran[i], n1 * gran[i]);
      for (int64_t m = 0; y_b && m < M; ++m) {
        const int64_t at = m * ldy + col[i] + n0 * gran[i];
        store_row(y_fp + at, y_b + at, (n1 - n0) * gran[i]);
      }
    }
  });
  return y;
}

at::Tensor kquant_gemv_q8k(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                           int64_t route) {
  return kquant_gemv_q8k_fused(x, {blocks}, {qtype}, route);
}

std::vector<int64_t> kquant_q8k_routes() { return kquant::built_routes(kWide); }

// blocks uint8 [N, K / 256 * bytes] (Q4_K, Q5_K or Q6_K, N a multiple of 16) -> the x16 layout
// [N / 16, K / 256 * unit bytes] (kquant_q8k_x16.h); the GEMV takes it as qtype | 256.
// `kquant_repack_x16_` writes the units of blocks' rows into out's rows (out: uint8
// [N / 16, K / 256 * unit bytes], e.g. a slice of a bigger x16 tensor: a weight repacked in
// chunks allocates no chunk-sized temporaries, which left the heap fragmented at load).
void kquant_repack_x16_(const at::Tensor& blocks, int64_t qtype, at::Tensor& out) {
  const int64_t nb = kquant::check_blocks(blocks, qtype), n = blocks.size(0);
  const int64_t unit = x16_unit_bytes(qtype | kX16), bytes = kquant::block_bytes(qtype);
  TORCH_CHECK(n % kX16Rows == 0, "kquant_repack_x16: ", n, " rows is not a multiple of 16");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.size(0) == n / kX16Rows && out.size(1) == nb * unit,
              "kquant_repack_x16_: out must be contiguous uint8 [", n / kX16Rows, ", ", nb * unit,
              "]");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kX16Rows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rows[kX16Rows];
        for (int r = 0; r < kX16Rows; ++r) rows[r] = src + ((grp * kX16Rows + r) * nb + b) * bytes;
        uint8_t* u = dst + (grp * nb + b) * unit;
        if (qtype == kQ6K) {
          std::memset(u + kQ6D + 32, 0, kQ6Q - kQ6D - 32);  // the padding
          repack_unit<kQ6K>(rows, u);
        } else if (qtype == kQ5K) {
          repack_unit<kQ5K>(rows, u);
        } else {
          repack_unit<kquant::kQ4K>(rows, u);
        }
      }
    }
  });
}

at::Tensor kquant_repack_x16(const at::Tensor& blocks, int64_t qtype) {
  const int64_t nb = kquant::check_blocks(blocks, qtype);
  at::Tensor out = at::empty({blocks.size(0) / kX16Rows, nb * x16_unit_bytes(qtype | kX16)},
                             blocks.options());
  kquant_repack_x16_(blocks, qtype, out);
  return out;
}

// x16 blocks [N / 16, K / 256 * unit bytes] of `qtype` (no flag) -> the weight as float32 [N, K]
// (exact, as kquant_dequantize gives the file's blocks: d sc q - dmin m, Q6_K d sc (q - 32)).
at::Tensor kquant_dequantize_x16(const at::Tensor& packed, int64_t qtype) {
  TORCH_CHECK(!is_x16(qtype), "kquant_dequantize_x16: qtype is the type (12, 13, 14), no flag");
  const int64_t unit = x16_unit_bytes(qtype | kX16);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) % unit == 0,
              "kquant_dequantize_x16: blocks must be contiguous uint8 [N / 16, K / 256 * ", unit,
              "]");
  const int64_t nb = packed.size(1) / unit, n = packed.size(0) * kX16Rows;
  at::Tensor w = at::empty({n, nb * kQK}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    Unpacked u;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* at = src + (r / kX16Rows * nb + b) * unit;
        const int row = static_cast<int>(r % kX16Rows);
        if (qtype == kQ6K) {
          unpack_x16<kQ6K>(at, row, &u);
        } else if (qtype == kQ5K) {
          unpack_x16<kQ5K>(at, row, &u);
        } else {
          unpack_x16<kquant::kQ4K>(at, row, &u);
        }
        float* y = dst + r * nb * kQK + b * kQK;
        for (int g = 0; g < kGroups; ++g) {  // kquant_gemv.cpp's arithmetic, term for term
          const float dg = u.d * static_cast<float>(u.scale[g]);
          const float og = u.dmin * static_cast<float>(u.min[g]);
          for (int i = 16 * g; i < 16 * g + 16; ++i) {
            y[i] = qtype == kQ6K ? dg * static_cast<float>(u.q[i] - 32)
                                 : dg * static_cast<float>(u.q[i]) - og;
          }
        }
      }
    }
  });
  return w;
}

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("kquant_gemv_q8k(Tensor x, Tensor blocks, int qtype, int route) -> Tensor");
  m.def("kquant_gemv_q8k_fused(Tensor x, Tensor[] blocks, int[] qtypes, int route) -> Tensor");
  m.def("kquant_q8k_routes() -> int[]", &kquant_q8k_routes);
  m.def("kquant_repack_x16(Tensor blocks, int qtype) -> Tensor");
  m.def("kquant_repack_x16_(Tensor blocks, int qtype, Tensor(a!) out) -> ()");
  m.def("kquant_dequantize_x16(Tensor blocks, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("kquant_gemv_q8k", &kquant_gemv_q8k);
  m.impl("kquant_gemv_q8k_fused", &kquant_gemv_q8k_fused);
  m.impl("kquant_repack_x16", &kquant_repack_x16);
  m.impl("kquant_repack_x16_", &kquant_repack_x16_);
  m.impl("kquant_dequantize_x16", &kquant_dequantize_x16);
}

}  // namespace laneserve
