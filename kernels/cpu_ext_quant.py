"""C++ source of the quantized matmuls for few rows (GEMV), compiled into :mod:`kernels.cpu_ext`.

``torch.ops.laneserve.int4_gemv(x, qs, scale, offset)`` and ``torch.ops.laneserve.q8_0_gemv(x, qs,
d)`` compute ``y = x @ W.T`` with float32 activations, reading the GGUF blocks (ggml's
``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``) where they lie: no bf16 rounding of the
activations (torch's ``_weight_int4pack_mm_for_cpu`` takes bf16 ones, and on a CPU without native
bf16 it is 2-4x slower than these loops at M = 1).

Layouts (N outputs, K inputs, G = K / 32 groups):

    int4:  qs uint8 [N, K / 2]   byte 16 g + j of row n: q[n, 32 g + j] | q[n, 32 g + 16 + j] << 4
           scale, offset float32 [N, G]   W[n, 32 g + i] = q * scale[n, g] + offset[n, g]
           (Q4_1: scale = d, offset = m; Q4_0: scale = d, offset = -8 d: exact)
    q8_0:  qs int8 [N, K]; d float32 [N, G]          W[n, 32 g + i] = qs * d[n, g]  (exact)

Per output, a group's 32 products are summed in fp32 (8 lanes), scaled once, and the offset term
uses the group sum of x: ``y = sum_g scale * (q . x_g) + offset * sum(x_g)`` (both as 8-lane
accumulators: a scalar chain of offsets doubled the time of a row). Each output row's
arithmetic is the same whatever M or the thread split (work is split over N only), so a row's
result does not depend on the batch. AVX2+FMA intrinsics under ``#ifdef __AVX2__`` (the build
uses ``-march=native``), a scalar loop otherwise.
"""

from __future__ import annotations

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;  // rows of x per pass over one weight row (registers: 4 + 4)

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[r] += s * (w0..w3 . x_r[0..32))
template <int R>
inline void fma_group(const __m256 (&w)[4], __m256 s, const float* x, int64_t ldx, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), t);
    t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), t);
    acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
  }
}
#endif

// One weight row (G groups) against R rows of x: y[r * ldy] = W_n . x_r.
// xs [R, G, 8]: per group of x, the sums x[l] + x[8 + l] + x[16 + l] + x[24 + l] (l < 8), for
// the offset term (a vector FMA per group, beside the scale's); unused for q8_0.
template <int R, bool Q4>
inline void gemv_row(const uint8_t* qs, const float* sc, const float* off, int64_t G,
                     const float* x, int64_t ldx, const float* xs, float* y, int64_t ldy) {
#ifdef __AVX2__
  __m256 acc[R], acc_off[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_off[r] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m256 w[4];
    if (Q4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16));
      const __m128i lo = _mm_and_si128(b, low4);                     // elements 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);  // elements 16..31
      w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 32));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 32 + 16));
      w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
      w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
      w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
      w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
    }
    fma_group<R>(w, _mm256_set1_ps(sc[g]), x + g * kGroup, ldx, acc);
    if (Q4) {
      const __m256 o = _mm256_set1_ps(off[g]);
      for (int r = 0; r < R; ++r)
        acc_off[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + (r * G + g) * 8), acc_off[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum8(acc[r]) + (Q4 ? hsum8(acc_off[r]) : 0.f);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f, z = 0.f;
    for (int64_t g = 0; Q4 && g < G; ++g)
      for (int64_t l = 0; l < 8; ++l) z += off[g] * xs[(r * G + g) * 8 + l];
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * ldx + g * kGroup;
      float t = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        float q;
        if (Q4) {
          const uint8_t b = qs[g * 16 + (i & 15)];
          q = static_cast<float>(i < 16 ? (b & 15) : (b >> 4));
        } else {
          q = static_cast<float>(reinterpret_cast<const int8_t*>(qs)[g * kGroup + i]);
        }
        t += q * xg[i];
      }
      total += t * sc[g];
    }
    y[r * ldy] = total + z;
  }
#endif
}

template <bool Q4>
void gemv_rows(const uint8_t* qs, const float* sc, const float* off, int64_t N, int64_t K,
               int64_t row_bytes, const float* x, int64_t M, const float* xs, float* y,
               int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = qs + n * row_bytes;
    const float* sn = sc + n * G;
    const float* on = Q4 ? off + n * G : nullptr;
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile)
      gemv_row<kRowTile, Q4>(qn, sn, on, G, x + m * K, K, xs + m * G * 8, y + m * N + n, N);
    const float* xm = x + m * K;
    const float* xsm = xs + m * G * 8;
    switch (M - m) {
      case 3: gemv_row<3, Q4>(qn, sn, on, G, xm, K, xsm, y + m * N + n, N); break;
      case 2: gemv_row<2, Q4>(qn, sn, on, G, xm, K, xsm, y + m * N + n, N); break;
      case 1: gemv_row<1, Q4>(qn, sn, on, G, xm, K, xsm, y + m * N + n, N); break;
      default: break;
    }
  }
}

void check_gemv_args(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     int64_t row_bytes_per_group, at::ScalarType qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be float32 [M, K], contiguous");
  const int64_t K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % kGroup == 0, "K = ", K, " is not a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == qtype && qs.is_contiguous() &&
              qs.size(1) == K / kGroup * row_bytes_per_group, "qs must be [N, ",
              K / kGroup * row_bytes_per_group, "] ", qtype, ", contiguous; got ", qs.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == N && scale.size(1) == K / kGroup,
              "scales must be float32 [N, K / 32], contiguous");
}

template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                const at::Tensor* offset) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / kGroup;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xs(Q4 ? M * G * 8 : 0);  // [M, G, 8], see gemv_row
  for (int64_t i = 0; Q4 && i < M * G; ++i) {
    const float* xg = xp + i * kGroup;
    for (int64_t l = 0; l < 8; ++l) xs[i * 8 + l] = ((xg[l] + xg[8 + l]) + xg[16 + l]) + xg[24 + l];
  }
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offset ? offset->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = qs.size(1);
  // ~16 KB of weights per task at least, so a small matrix stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    gemv_rows<Q4>(qp, sp, op, N, K, row_bytes, xp, M, xs.data(), yp, n0, n1);
  });
  return y;
}

// x [M, K] f32; qs uint8 [N, K/2]; scale, offset f32 [N, K/32] -> [M, N] f32
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& offset) {
  check_gemv_args(x, qs, scale, 16, at::kByte);
  TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == at::kFloat &&
              offset.is_contiguous(), "offset must be float32 like scale");
  return gemv<true>(x, qs, scale, &offset);
}

// x [M, K] f32; qs int8 [N, K]; d f32 [N, K/32] -> [M, N] f32
at::Tensor q8_0_gemv(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_gemv_args(x, qs, d, 32, at::kChar);
  return gemv<false>(x, qs, d, nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("int4_gemv(Tensor x, Tensor qs, Tensor scale, Tensor offset) -> Tensor");
  m.def("q8_0_gemv(Tensor x, Tensor qs, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("q8_0_gemv", &q8_0_gemv);
}
"""
