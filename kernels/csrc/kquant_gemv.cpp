// GEMV over GGUF's K-quant super-blocks (ggml `block_q4_K`, `block_q5_K`, `block_q6_K`; 256
// weights each), read as the file ships them: no dequantized copy of the weight is kept.
//
// ``torch.ops.laneserve.kquant_gemv(x, blocks, qtype, route)`` computes ``y = x @ W.T`` for float32
// x [M, K] and blocks uint8 [N, K / 256 * bytes] (row n: the super-blocks of output n); qtype is
// 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), ggml's type numbers. Each task takes a range of outputs; per
// super-block it unpacks the 256 weights once into fp32 (exact: fp16 scales times small
// integers) and runs one fp32 dot product per row of x, so M rows read each weight byte once.
// ``kquant_dequantize(blocks, qtype)`` gives the weight as float32 [N, K] (the GEMM route
// dequantizes tiles of outputs with it and runs the dense GEMM).
//
// Super-block layouts (ggml-common.h; d, dmin fp16):
//   Q4_K (144 bytes): d | dmin | scales[12] | qs[128]
//     8 sub-blocks of 32 weights, each with a 6-bit scale sc and 6-bit min m packed in scales;
//     weight = d * sc * q - dmin * m, q a nibble (sub-blocks 2i, 2i+1: low, high nibbles of
//     qs[32 i .. 32 i + 31]).
//   Q5_K (176 bytes): d | dmin | scales[12] | qh[32] | qs[128]   as Q4_K, q gaining a fifth bit
//     from qh (bit 2i of qh[l] for sub-block 2i, bit 2i+1 for 2i+1).
//   Q6_K (210 bytes): ql[128] | qh[64] | scales[16] int8 | d
//     16 sub-blocks of 16 weights; weight = d * scales[s] * (q - 32), q 6 bits: 4 from ql, 2 from
//     qh.
//
// Routes (``route``): 0 the widest this build has, 1 AVX-512F (16 lanes), 2 AVX2 + FMA (8 lanes),
// 3 scalar; ``kquant_routes()`` lists the ones built (-march=native decides). They differ in the
// dot product's summation order only.
#include "kquant.h"

namespace laneserve {
namespace {

using kquant::check_blocks;
using kquant::fp16;
using kquant::kQ4K;
using kquant::kQ5K;
using kquant::kQ6K;
using kquant::kQK;
using kquant::scale_min_k4;
const auto kquant_block_bytes = kquant::block_bytes;

// Q4_K and Q5_K (qh null for Q4_K): one super-block -> 256 floats.
void unpack_q45_k(const uint8_t* b, bool five, float* y) {
  const float d = fp16(b), dmin = fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = five ? b + 16 : nullptr;
  const uint8_t* qs = five ? b + 48 : b + 16;
  for (int j = 0; j < 4; ++j) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * j, scales, &sc0, &m0);
    scale_min_k4(2 * j + 1, scales, &sc1, &m1);
    const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
    const uint8_t* q = qs + 32 * j;
    float* y0 = y + 64 * j;
    if (five) {
      const int s0 = 2 * j, s1 = 2 * j + 1;
#pragma omp simd
      for (int l = 0; l < 32; ++l) {
        y0[l] = d0 * static_cast<float>((q[l] & 0xF) | (((qh[l] >> s0) & 1) << 4)) - o0;
        y0[32 + l] = d1 * static_cast<float>((q[l] >> 4) | (((qh[l] >> s1) & 1) << 4)) - o1;
      }
    } else {
#pragma omp simd
      for (int l = 0; l < 32; ++l) {
        y0[l] = d0 * static_cast<float>(q[l] & 0xF) - o0;
        y0[32 + l] = d1 * static_cast<float>(q[l] >> 4) - o1;
      }
    }
  }
}

void unpack_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l0 = ql + 64 * half;
    const uint8_t* h0 = qh + 32 * half;
    const int8_t* s = sc + 8 * half;
    float* y0 = y + 128 * half;
    // weights l, l + 32, l + 64, l + 96 of this half: the low / high nibbles of ql[l] and
    // ql[l + 32] with bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l]; sub-block scale s[l / 16 + 2 i]
    for (int g = 0; g < 2; ++g) {
      const float s0 = d * s[g], s1 = d * s[g + 2], s2 = d * s[g + 4], s3 = d * s[g + 6];
#pragma omp simd
      for (int l = 16 * g; l < 16 * g + 16; ++l) {
        const int h = h0[l];
        y0[l] = s0 * static_cast<float>(((l0[l] & 0xF) | ((h & 3) << 4)) - 32);
        y0[l + 32] = s1 * static_cast<float>(((l0[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
        y0[l + 64] = s2 * static_cast<float>(((l0[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
        y0[l + 96] = s3 * static_cast<float>(((l0[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

inline void unpack(int64_t qtype, const uint8_t* b, float* y) {
  if (qtype == kQ6K) {
    unpack_q6_k(b, y);
  } else {
    unpack_q45_k(b, qtype == kQ5K, y);
  }
}

float dot256_scalar(const float* w, const float* x) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < kQK; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += w[i + j] * x[i + j];
  }
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
float dot256_avx2(const float* w, const float* x) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int i = 0; i < kQK; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

#if defined(__AVX512F__)
float dot256_avx512(const float* w, const float* x) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int i = 0; i < kQK; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

using Dot = float (*)(const float*, const float*);

#if defined(__AVX512F__)
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

Dot dot_for(int64_t route) {
  route = kquant::pick_route(kquant::built_routes(kWide), route, "kquant");
#if defined(__AVX512F__)
  if (route == 1) return dot256_avx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (route == 2) return dot256_avx2;
#endif
  return dot256_scalar;
}

}  // namespace

at::Tensor kquant_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                       int64_t route) {
  const int64_t nb = check_blocks(blocks, qtype);
  const int64_t bytes = kquant_block_bytes(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kquant_gemv: x must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == nb * kQK, "kquant_gemv: x has ", x.size(1), " columns, the weight ",
              nb * kQK);
  const Dot dot = dot_for(route);
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = kquant::row_grain(nb);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    alignas(64) float w[kQK];
    std::vector<float> acc(M);
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* row = bp + n * nb * bytes;
      for (int64_t b = 0; b < nb; ++b) {
        unpack(qtype, row + b * bytes, w);
        for (int64_t m = 0; m < M; ++m) acc[m] += dot(w, xp + m * K + b * kQK);
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = acc[m];
    }
  });
  return y;
}

at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t qtype) {
  const int64_t nb = check_blocks(blocks, qtype);
  const int64_t bytes = kquant_block_bytes(qtype);
  const int64_t N = blocks.size(0);
  at::Tensor w = at::empty({N, nb * kQK}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) unpack(qtype, bp + i * bytes, wp + i * kQK);
  });
  return w;
}

std::vector<int64_t> kquant_routes() { return kquant::built_routes(kWide); }

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("kquant_gemv(Tensor x, Tensor blocks, int qtype, int route) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int qtype) -> Tensor");
  m.def("kquant_routes() -> int[]", &kquant_routes);
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("kquant_gemv", &kquant_gemv);
  m.impl("kquant_dequantize", &kquant_dequantize);
}

}  // namespace laneserve
