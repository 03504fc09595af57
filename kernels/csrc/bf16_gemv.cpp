// C++ source of the dense bf16 GEMV for decode-sized calls, compiled into :mod:`laneserve.kernels.cpu_ext`.
//
// ``torch.ops.laneserve.bf16_gemv(x, w, route)`` computes ``y = x @ w.T`` for a dense bfloat16
// weight ``w`` [N, K] (contiguous, row-major: the checkpoint's own layout) and a few rows of
// activations ``x`` [M, K] (bfloat16 or float32); the result is in x's dtype, summed in float32
// and rounded once (to nearest even for bf16). torch's ``F.linear`` on such a call (oneDNN's bf16
// GEMM at M = 1-4) read the weights at about a quarter of the memory bandwidth on a 2-core Xeon;
// decode is nothing but this read.
//
// Work is split over N only (``at::parallel_for``, contiguous chunks of whole output rows, at
// least 32 KiB of weights each); within a chunk 4 weight rows go together (a short last tile
// repeats its last row) against up to 4 rows of x, so a call of 2-4 rows reads each weight once
// and more rows reread a tile from L1. Every output's sum runs in one fixed order over K (lanes,
// then the lanes in a fixed order), so a row's result depends neither on M nor on the thread
// split. Routes (``route``: -1 picks the best one the build has for x's dtype; ``bf16_gemv_routes()``
// lists the ones it has; the build uses ``-march=native``, so a route exists where the CPU has it):
//
//   3 AVX512-BF16 (bf16 x only): 32 weights per ``vdpbf16ps`` against x as it is (products exact
//     in float32, float32 sums; the instruction treats denormal inputs as zero);
//   2 AVX-512F: the weights widened to float32 by a 16-bit shift, 16 per FMA, x in float32;
//   1 AVX2 + FMA: the same, 8 per FMA (2 weight rows per pass from 3 rows of x: 16 registers);
//   0 scalar float32 loops (any CPU; also the reference for the others' arithmetic).
//
// A float32 x takes route 2 or 1 (route 3 would round it to bf16); bf16 rows for routes 0-2 are
// widened once per call to a float32 copy (exact).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kOutTile = 4;          // weight rows per pass
constexpr int64_t kRowTile = 4;          // rows of x per pass
constexpr int64_t kChunkBytes = 32768;   // least weight bytes per parallel_for task
constexpr int64_t kPrefetch = 512;       // elements (1 KiB) ahead in each weight row

enum Route : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

#if defined(__AVX2__) && defined(__FMA__)
#define LANESERVE_BF16_AVX2 1
#endif
#if defined(__AVX512F__)
#define LANESERVE_BF16_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LANESERVE_BF16_DP 1
#endif

std::vector<int64_t> bf16_gemv_routes() {
  std::vector<int64_t> routes{kScalar};
#ifdef LANESERVE_BF16_AVX2
  routes.push_back(kAvx2);
#endif
#ifdef LANESERVE_BF16_AVX512
  routes.push_back(kAvx512);
#endif
#ifdef LANESERVE_BF16_DP
  routes.push_back(kAvx512Bf16);
#endif
  return routes;
}

// Where a tile's outputs go: y[r * ldy + o] for the tile's first `no` outputs, rounded to T.
template <typename T>
inline void store_tile(const float (*out)[kOutTile], int R, int64_t no, T* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t o = 0; o < no; ++o) y[r * ldy + o] = static_cast<T>(out[r][o]);
}

// --- route 0: scalar ---------------------------------------------------------------------------

template <int R, int NT>
inline void tile_scalar(const float* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                        float (*out)[kOutTile]) {
  for (int o = 0; o < NT; ++o) {
    float acc[R] = {};
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t bits = static_cast<uint32_t>(w[o][k]) << 16;
      float wf;
      std::memcpy(&wf, &bits, sizeof wf);
      for (int r = 0; r < R; ++r) acc[r] += wf * x[r * ldx + k];
    }
    for (int r = 0; r < R; ++r) out[r][o] = acc[r];
  }
}

// --- route 1: AVX2 -------------------------------------------------------------------------------

#ifdef LANESERVE_BF16_AVX2
inline float hsum8(__m256 v) {  // fixed order: halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <int R, int NT>
inline void tile_avx2(const float* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                      float (*out)[kOutTile]) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int o = 0; o < NT; ++o) {
      if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[o] + k + kPrefetch), _MM_HINT_T0);
      const __m256 wv = widen8(w[o] + k);
      for (int r = 0; r < R; ++r)
        acc[r][o] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ldx + k), acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) {
      float s = hsum8(acc[r][o]);
      for (int64_t kk = k; kk < K; ++kk) {  // the tail, in order
        const uint32_t bits = static_cast<uint32_t>(w[o][kk]) << 16;
        float wf;
        std::memcpy(&wf, &bits, sizeof wf);
        s += wf * x[r * ldx + kk];
      }
      out[r][o] = s;
    }
}
#endif

// --- route 2: AVX-512F ---------------------------------------------------------------------------

#ifdef LANESERVE_BF16_AVX512
inline __m512 widen16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <int R, int NT>
inline void tile_avx512(const float* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                        float (*out)[kOutTile]) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int o = 0; o < NT; ++o) {
      if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[o] + k + kPrefetch), _MM_HINT_T0);
      const __m512 wv = widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[o] + k)));
      for (int r = 0; r < R; ++r) acc[r][o] = _mm512_fmadd_ps(wv, xv[r], acc[r][o]);
    }
  }
  if (k < K) {  // the tail: masked lanes are zeros, so every lane's sum keeps its order
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
    for (int o = 0; o < NT; ++o) {
      uint16_t tail[16] = {};  // a masked 16-bit load needs AVX-512BW/VL: copy instead
      std::memcpy(tail, w[o] + k, (K - k) * sizeof(uint16_t));
      const __m512 wv = widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
      for (int r = 0; r < R; ++r) acc[r][o] = _mm512_fmadd_ps(wv, xv[r], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) out[r][o] = _mm512_reduce_add_ps(acc[r][o]);
}
#endif

// --- route 3: AVX512-BF16 ------------------------------------------------------------------------

#ifdef LANESERVE_BF16_DP
template <int R, int NT>
inline void tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                    float (*out)[kOutTile]) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
    for (int o = 0; o < NT; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(w[o] + k + kPrefetch), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[o] + k);
      for (int r = 0; r < R; ++r) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv, xv[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
    for (int o = 0; o < NT; ++o) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[o] + k);
      for (int r = 0; r < R; ++r) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv, xv[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NT; ++o) out[r][o] = _mm512_reduce_add_ps(acc[r][o]);
}
#endif

// One tile of R rows (1..kRowTile) x NT weight rows, through the route kernel for that R.
template <int NT, typename X, void (*F1)(const X*, int64_t, const uint16_t* const*, int64_t, float (*)[kOutTile]),
          void (*F2)(const X*, int64_t, const uint16_t* const*, int64_t, float (*)[kOutTile]),
          void (*F3)(const X*, int64_t, const uint16_t* const*, int64_t, float (*)[kOutTile]),
          void (*F4)(const X*, int64_t, const uint16_t* const*, int64_t, float (*)[kOutTile])>
inline void run_tile(int R, const X* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                     float (*out)[kOutTile]) {
  switch (R) {
    case 1: F1(x, ldx, w, K, out); break;
    case 2: F2(x, ldx, w, K, out); break;
    case 3: F3(x, ldx, w, K, out); break;
    default: F4(x, ldx, w, K, out); break;
  }
}

// y[M, N] = x[M, K] @ w[N, K].T with `tile` computing up to `rows` rows x NT outputs per pass.
template <int NT, typename X, typename Y, typename Tile>
void gemv(const X* xp, const uint16_t* wp, Y* yp, int64_t M, int64_t K, int64_t N, int rows,
          Tile tile) {
  const int64_t grain = std::max<int64_t>(NT, kChunkBytes / std::max<int64_t>(1, 2 * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float out[kRowTile][kOutTile];
    const uint16_t* w[NT];
    for (int64_t n = n0; n < n1; n += NT) {
      const int64_t no = std::min<int64_t>(NT, n1 - n);
      for (int64_t o = 0; o < NT; ++o) w[o] = wp + (n + std::min(o, no - 1)) * K;
      for (int64_t m = 0; m < M; m += rows) {
        const int R = static_cast<int>(std::min<int64_t>(rows, M - m));
        tile(R, xp + m * K, K, w, K, out);
        store_tile<Y>(out, R, no, yp + m * N + n, N);
      }
    }
  });
}

template <typename Y>
void run_route(int64_t route, const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  Y* yp = y.data_ptr<Y>();
  if (route == kAvx512Bf16) {
#ifdef LANESERVE_BF16_DP
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    gemv<4>(xp, wp, yp, M, K, N, 4,
            run_tile<4, uint16_t, tile_dp<1, 4>, tile_dp<2, 4>, tile_dp<3, 4>, tile_dp<4, 4>>);
#endif
    return;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 rows widened once (exact)
  const float* xp = xf.data_ptr<float>();
  switch (route) {
#ifdef LANESERVE_BF16_AVX512
    case kAvx512:
      gemv<4>(xp, wp, yp, M, K, N, 4,
              run_tile<4, float, tile_avx512<1, 4>, tile_avx512<2, 4>, tile_avx512<3, 4>,
                       tile_avx512<4, 4>>);
      return;
#endif
#ifdef LANESERVE_BF16_AVX2
    case kAvx2:  // 16 ymm registers: 4 weight rows for 1 row of x, 2 for 2-3
      if (M == 1) {
        gemv<4>(xp, wp, yp, M, K, N, 1,
                run_tile<4, float, tile_avx2<1, 4>, tile_avx2<1, 4>, tile_avx2<1, 4>,
                         tile_avx2<1, 4>>);
      } else {
        gemv<2>(xp, wp, yp, M, K, N, 3,
                run_tile<2, float, tile_avx2<1, 2>, tile_avx2<2, 2>, tile_avx2<3, 2>,
                         tile_avx2<3, 2>>);
      }
      return;
#endif
    default:
      gemv<1>(xp, wp, yp, M, K, N, 4,
              run_tile<1, float, tile_scalar<1, 1>, tile_scalar<2, 1>, tile_scalar<3, 1>,
                       tile_scalar<4, 1>>);
  }
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w, int64_t route) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous(),
              "w must be a contiguous 2-D bfloat16 CPU tensor");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == w.size(1),
              "x must be a 2-D CPU tensor [M, ", w.size(1), "]; got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const std::vector<int64_t> routes = bf16_gemv_routes();
  const bool has = std::find(routes.begin(), routes.end(), route) != routes.end();
  TORCH_CHECK(route == -1 || has, "bf16_gemv: route ", route, " is not in this build");
  TORCH_CHECK(route != kAvx512Bf16 || bf16, "bf16_gemv: route 3 takes bfloat16 x only");
  if (route == -1) {
    route = routes.back();
    if (route == kAvx512Bf16 && !bf16) route = routes[routes.size() - 2];
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return y;
  if (bf16) {
    run_route<c10::BFloat16>(route, xc, w, y);
  } else {
    run_route<float>(route, xc, w, y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("bf16_gemv(Tensor x, Tensor w, int route=-1) -> Tensor");
  m.def("bf16_gemv_routes() -> int[]", &bf16_gemv_routes);
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
