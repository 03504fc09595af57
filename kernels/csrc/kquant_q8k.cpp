// The int8 route of the K-quant GEMV: integer dot products of the weights' own quants with the
// activations quantized once per call, as llama.cpp's ggml-cpu does (`quantize_row_q8_K`,
// `ggml_vec_dot_q4_K_q8_K` and its Q5_K / Q6_K siblings; the same arithmetic, our own code).
//
// ``torch.ops.laneserve.kquant_gemv_q8k(x, blocks, qtype, route)`` computes ``y = x @ W.T`` for
// float32 x [M, K] and blocks uint8 [N, K / 256 * bytes] (kquant_gemv.cpp has the layouts). Each
// row of x is first quantized per 256 values to Q8_K: a float scale xd = max|x| / 127, int8
// xq = round(x / xd) (ties to even) and the sums of xq per 16 (bsums). Each task then takes a
// range of outputs; per super-block it unpacks the weight's quants once into 256 unsigned bytes
// in the activations' order (q: 0..15 Q4_K, 0..31 Q5_K, 0..63 Q6_K), an int16 scale per 16
// weights and an int16 "min" per 16, and for each row of x adds
//   xd * (d * sum_g scale_g * sum_{i in g} q_i xq_i  -  dmin * sum_g min_g * bsums_g)
// where for Q4_K / Q5_K (w = d sc q - dmin m) scale_g, min_g are the sub-block's sc and m, and for
// Q6_K (w = d sc (q - 32)) scale_g = sc, min_g = 32 sc, dmin = d. The integer sums are exact
// (|q xq| <= 63 * 127; no int16 or int32 sum can overflow), so the result is the float64 dot
// product of the dequantized weights with the Q8_K-rounded activations up to float32 rounding of
// the per-super-block terms: the only approximation is the activations' int8 rounding (~0.4 %
// of a 256-block's largest value per element).
//
// Routes (``route``): 0 the widest this build has, 1 AVX-512 VNNI (``vpdpbusd`` over 64 bytes, a
// per-16 int32 scale by ``vpmulld``), 2 AVX2 (``vpmaddubsw`` then ``vpmaddwd`` with the int16
// scales), 3 scalar; ``kquant_q8k_routes()`` lists the ones built (-march=native decides). All
// give the same integer sums; they differ in the float32 summation order over super-blocks only.
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

Q8K quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kQK;
  Q8K a{std::vector<int8_t>(M * K), std::vector<float>(M * nb),
        std::vector<int16_t>(M * nb * kGroups)};
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      quantize_block(x + i * kQK, a.q.data() + i * kQK, a.d.data() + i,
                     a.bsums.data() + i * kGroups);
    }
  });
  return a;
}

// Q4_K and Q5_K: sub-blocks 2j, 2j + 1 are the low and high nibbles of qs[32 j .. 32 j + 31]
// (Q5_K's fifth bit: bits 2j, 2j + 1 of qh[l]).
void unpack_q45_k(const uint8_t* b, bool five, Unpacked* u) {
  u->d = kquant::fp16(b);
  u->dmin = kquant::fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five ? b + 48 : b + 16;
  // the 12 packed bytes -> scales sc[0..7] (bytes of t[0..1]) and mins m[0..7] (t[2..3]), as
  // kquant::scale_min_k4 gives them one at a time
  uint32_t t[4];
  std::memcpy(t, scales, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  t[3] = ((t[2] >> 4) & kLow4) | (((t[1] >> 6) & kLow2) << 4);
  const uint32_t mins_low = t[1] & kLow6;
  t[1] = (t[2] & kLow4) | (((t[0] >> 6) & kLow2) << 4);
  t[2] = mins_low;
  t[0] &= kLow6;
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

#if defined(__AVX2__) && defined(__FMA__)
void block_dot_avx2(const Unpacked& u, const int8_t* xq, const int16_t* bs, float xd,
                    float* acc) {
  __m256i isum = _mm256_setzero_si256();
  for (int c = 0; c < kGroups / 2; ++c) {  // 32 bytes: groups 2c (lanes 0-7), 2c + 1 (8-15)
    const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + 32 * c));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * c));
    const __m256i pairs = _mm256_maddubs_epi16(q, x);  // |.| <= 2 * 63 * 127: no saturation
    const __m256i sc =
        _mm256_set_m128i(_mm_set1_epi16(u.scale[2 * c + 1]), _mm_set1_epi16(u.scale[2 * c]));
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, sc));
  }
  const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.min));
  const __m256i msum =
      _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  __m256 a = _mm256_loadu_ps(acc);
  a = _mm256_fmadd_ps(_mm256_set1_ps(xd * u.d), _mm256_cvtepi32_ps(isum), a);
  a = _mm256_fnmadd_ps(_mm256_set1_ps(xd * u.dmin), _mm256_cvtepi32_ps(msum), a);
  _mm256_storeu_ps(acc, a);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LANESERVE_KQUANT_VNNI 1
void block_dot_vnni(const Unpacked& u, const int8_t* xq, const int16_t* bs, float xd,
                    float* acc) {
  // lane i of a 64-byte chunk c's vpdpbusd holds 4 products of group 4c + i / 4
  const __m512i scale32 =
      _mm512_cvtepi16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(u.scale)));
  const __m512i quarter = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i q = _mm512_load_si512(u.q + 64 * c);
    const __m512i x = _mm512_loadu_si512(xq + 64 * c);
    const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
    const __m512i idx = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * c));
    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(dots, _mm512_permutexvar_epi32(idx, scale32)));
  }
  const __m256i mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.min));
  const __m256i msum =
      _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  __m512 a = _mm512_loadu_ps(acc);
  a = _mm512_fmadd_ps(_mm512_set1_ps(xd * u.d), _mm512_cvtepi32_ps(isum), a);
  a = _mm512_fnmadd_ps(_mm512_set1_ps(xd * u.dmin),
                       _mm512_cvtepi32_ps(_mm512_zextsi256_si512(msum)), a);
  _mm512_storeu_ps(acc, a);
}
#endif

#ifdef LANESERVE_KQUANT_VNNI
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

struct GemvArgs {
  const uint8_t* blocks;
  int64_t nb, bytes, M, N;
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
      g.y[m * g.N + n] = t;
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

Rows rows_for(int64_t route, int64_t qtype) {
  route = kquant::pick_route(kquant::built_routes(kWide), route, "kquant_gemv_q8k");
#ifdef LANESERVE_KQUANT_VNNI
  if (route == 1) return rows_of<block_dot_vnni>(qtype);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (route == 2) return rows_of<block_dot_avx2>(qtype);
#endif
  return rows_of<block_dot_scalar>(qtype);
}

}  // namespace

at::Tensor kquant_gemv_q8k(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                           int64_t route) {
  const int64_t nb = kquant::check_blocks(blocks, qtype);
  const int64_t bytes = kquant::block_bytes(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kquant_gemv_q8k: x must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == nb * kQK, "kquant_gemv_q8k: x has ", x.size(1), " columns, the weight ",
              nb * kQK);
  const Rows rows = rows_for(route, qtype);
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1);
  const Q8K a = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const GemvArgs g{blocks.data_ptr<uint8_t>(), nb, bytes, M, N, &a, y.data_ptr<float>()};
  at::parallel_for(0, N, kquant::row_grain(nb), [&](int64_t n0, int64_t n1) { rows(g, n0, n1); });
  return y;
}

std::vector<int64_t> kquant_q8k_routes() { return kquant::built_routes(kWide); }

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("kquant_gemv_q8k(Tensor x, Tensor blocks, int qtype, int route) -> Tensor");
  m.def("kquant_q8k_routes() -> int[]", &kquant_q8k_routes);
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) { m.impl("kquant_gemv_q8k", &kquant_gemv_q8k); }

}  // namespace laneserve
