// C++ source of the AMX matmuls over 4- and 8-bit weights, compiled into :mod:`laneserve.kernels.cpu_ext`.
//
// ``torch.ops.laneserve.int4_amx(x, qa, sa)`` and ``torch.ops.laneserve.q8_0_amx(x, qa, sa)``
// compute ``y = x @ W.T`` for bfloat16 activations on a CPU with AMX-BF16 (Sapphire Rapids and
// later), reading the weights in their 4- or 8-bit form. Each weight tile (16 outputs x one
// 32-element group) is dequantized once per call to bf16 (``w = q * scale + offset`` by one float32
// FMA, rounded to nearest even: a dense bf16 copy's values but for a rare last bit, and subnormals
// flushed to zero as oneDNN's AMX GEMMs do) in the VNNI pair layout the tile unit reads, and one
// ``tdpbf16ps`` multiplies it with 16 rows of x at a time (products exact in float32, float32 sums).
// Up to 16 rows, a tile is dequantized just before its product; with more, a pass's tiles (4 blocks
// of 16 outputs x all of K, up to 1 MiB: K <= 8,192) are dequantized into a per-thread buffer and
// every 16-row chunk reads them back; where there are fewer passes than threads the 16-row chunks are
// split among threads too. The dequantization is the work; the rows are nearly free: on a 2-core Xeon
// with AMX the SmolLM2 linears took the same time at 1 and 16 rows (qkv ~23 us, gate_up ~62 us in a
// loop), against 1.2x / 4-6x for torch's int4 kernel from 1 to 16 rows. So a batch-1 speculative
// verification or a small decode batch costs about what one row through the GEMVs does, and a decode
// batch of 64 about 0.8x what the dense bf16 copy's GEMMs cost (whole steps).
//
// Layouts (N outputs, a multiple of 16; K inputs; G = K / 32; NB = N / 16 blocks of 16 outputs),
// built by :func:`laneserve.gpu_worker.gemv_blocks.amx_order`:
//
//     int4:  qa uint8 [NB, G, 16, 16]  tile row r (k = 32 g + 2 r and 2 r + 1) of block b: byte j
//                                      holds q[16 b + j // 2, k + j % 2] in its low nibble and
//                                      q[16 b + 8 + j // 2, k + j % 2] in its high one
//            sa float32 [NB, G, 32]    the 16 outputs' scale, then their offset
//     q8_0:  qa int8 [NB, G, 16, 32]   tile row r: bytes 0..15 as the int4 low nibbles, 16..31 as
//                                      the high ones
//            sa float32 [NB, G, 16]    the 16 outputs' d
//
// A row's result depends on its own activations only (each 16-row chunk is a tile of its own, the
// sums over K run in one order): not on M or the thread split. Linux grants a process the AMX
// register state on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); ``amx_usable()`` asks once and is
// false where the kernel or the build lacks AMX, and then the ops raise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define LANESERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

bool amx_usable() {
#ifdef LANESERVE_AMX
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

#ifdef LANESERVE_AMX
constexpr int kAmxBlocks = 4;  // blocks of 16 outputs per pass: C tiles 0..3, A 4, B 5..7

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// GCC's tile intrinsics are asm statements that name no memory: without this, the compiler may
// drop the stores a tile load or the config load reads, or read cbuf before the tile store (seen
// at -O3: dequantized tiles never written in a copy of one pass; the tile config's rows and
// column bytes dropped, leaving stack garbage for ldtilecfg to fault on).
inline void memory_barrier() { asm volatile("" ::: "memory"); }

void configure_tiles(int rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t <= 4; ++t) {  // C tiles and A: `rows` activation rows of 64 bytes
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {  // B: 16 pairs of k x 16 outputs
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  memory_barrier();  // the config load reads cfg: without it GCC dropped the rows/colsb stores
  _tile_loadconfig(&cfg);
}

// One B tile (see the module docstring) as bf16 pairs: out[r * 32 + 2 n + i] = W[n, 2 r + i].
// Lane j of a row's low half is output j / 2, of its high half output 8 + j / 2.
template <bool Q4>
inline void dequant_tile(const uint8_t* q, const float* sa, uint16_t* out) {
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi =
      _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const __m512 s = _mm512_loadu_ps(sa);
  const __m512 slo = _mm512_permutexvar_ps(dup_lo, s), shi = _mm512_permutexvar_ps(dup_hi, s);
  if (Q4) {
    const __m512 o = _mm512_loadu_ps(sa + 16);
    const __m512 olo = _mm512_permutexvar_ps(dup_lo, o), ohi = _mm512_permutexvar_ps(dup_hi, o);
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    for (int r = 0; r < 16; ++r) {
      const __m512i v = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 16)));
      const __m512 lo =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, nibble)), slo, olo);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), shi, ohi);
      _mm512_store_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {
    for (int r = 0; r < 16; ++r) {
      const __m128i* row = reinterpret_cast<const __m128i*>(q + r * 32);
      const __m512 lo =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), slo);
      const __m512 hi =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), shi);
      _mm512_store_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// C[0..nb) += x[m0 .. m0 + 16) @ the pass's tiles, then y = bf16(C) for those rows and blocks.
// `tile(J, g)` gives block J's bf16 B tile for group g (dequantized on the spot or read back).
template <typename TileFn>
inline void amx_pass(const c10::BFloat16* xm, int64_t K, int64_t G, int64_t nb, int rows,
                     c10::BFloat16* ym, int64_t N, float* cbuf, TileFn&& tile) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(4, xm + g * 32, K * 2);
    // tile numbers must be constants: one line per block of the pass
#define LANESERVE_AMX_BLOCK(J, BT)                                                         \
  if (J < nb) {                                                                            \
    memory_barrier(); /* tile() may overwrite a ring buffer an earlier tile load read */   \
    const uint16_t* b = tile(J, g);                                                        \
    memory_barrier(); /* the tile load reads what tile() wrote */                          \
    _tile_loadd(BT, b, 64);                                                                \
    _tile_dpbf16ps(J, 4, BT);                                                              \
  }
    LANESERVE_AMX_BLOCK(0, 5)
    LANESERVE_AMX_BLOCK(1, 6)
    LANESERVE_AMX_BLOCK(2, 7)
    LANESERVE_AMX_BLOCK(3, 5)
#undef LANESERVE_AMX_BLOCK
  }
#define LANESERVE_AMX_STORE(J)                                                             \
  if (J < nb) {                                                                            \
    memory_barrier(); /* the previous block's reads of cbuf come before this store */      \
    _tile_stored(J, cbuf, 64);                                                             \
    memory_barrier(); /* the tile store wrote cbuf */                                      \
    for (int r = 0; r < rows; ++r)                                                         \
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ym + r * N + J * 16),                 \
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(cbuf + r * 16)));     \
  }
  LANESERVE_AMX_STORE(0)
  LANESERVE_AMX_STORE(1)
  LANESERVE_AMX_STORE(2)
  LANESERVE_AMX_STORE(3)
#undef LANESERVE_AMX_STORE
}

// Largest per-thread pass buffer (kAmxBlocks x G tiles of 1 KiB): 1 MiB, K <= 8,192, stays in a
// core's L2 on the CPUs with AMX; a pass of a longer K is dequantized again per 16 rows instead.
constexpr int64_t kMaxPassBufferTiles = 1024;

// Up to 16 rows (or a K too long for the buffer): each tile is dequantized into a small ring
// (L1) just before its product. More rows: each pass's tiles (kAmxBlocks x G of them, 72-192 KiB
// for SmolLM2's K of 576-1,536) are dequantized once into a per-thread buffer and every 16-row
// chunk reads them back, so the dequantization, the work, is paid once per pass however many rows
// there are. Work items are (pass, group of 16-row chunks): one group per pass while there are
// at least as many passes as threads; with fewer (a narrow linear on many cores) the chunks are
// split into groups too, each dequantizing its pass again, so every thread has work. A row's
// result does not depend on the split: its sums run over K in one order whatever the item.
template <bool Q4>
void amx_mm(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), NB = qa.size(0), G = qa.size(1), N = NB * 16;
  const int64_t tile_bytes = Q4 ? 256 : 512, sa_floats = Q4 ? 32 : 16;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qa.data_ptr());
  const float* sp = sa.data_ptr<float>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t passes = (NB + kAmxBlocks - 1) / kAmxBlocks, chunks = (M + 15) / 16;
  const bool buffered = M > 16 && kAmxBlocks * G <= kMaxPassBufferTiles;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups =
      passes >= threads ? 1 : std::min<int64_t>(chunks, (threads + passes - 1) / passes);
  const int64_t group_chunks = (chunks + groups - 1) / groups;
  at::parallel_for(0, passes * groups, 1, [&](int64_t w0, int64_t w1) {
    alignas(64) float cbuf[16 * 16];
    alignas(64) uint16_t ring[3][16 * 32];
    uint16_t* buf = nullptr;
    if (buffered) {
      // [block J][group g] tiles of 16 x 32 bf16 (1 KiB each), 64-byte aligned; kept per
      // thread across calls (a fresh buffer per call would be mapped and faulted in anew)
      thread_local std::vector<uint16_t> storage;
      const size_t needed = static_cast<size_t>(kAmxBlocks * G * 16 * 32 + 32);
      if (storage.size() < needed) storage.resize(needed);
      buf = reinterpret_cast<uint16_t*>(
          (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    }
    int configured = -1;
    int64_t in_buffer = -1;  // the pass whose tiles buf holds
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t p = w / groups, c0 = (w % groups) * group_chunks;
      const int64_t b0 = p * kAmxBlocks, nb = std::min<int64_t>(kAmxBlocks, NB - b0);
      if (buffered && in_buffer != p) {
        for (int64_t J = 0; J < nb; ++J)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t t = (b0 + J) * G + g;
            dequant_tile<Q4>(qp + t * tile_bytes, sp + t * sa_floats, buf + (J * G + g) * 512);
          }
        in_buffer = p;
      }
      for (int64_t c = c0; c < std::min(chunks, c0 + group_chunks); ++c) {
        const int64_t m0 = c * 16;
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        if (rows != configured) {
          configure_tiles(rows);
          configured = rows;
        }
        const c10::BFloat16* xm = xp + m0 * K;
        c10::BFloat16* ym = yp + m0 * N + b0 * 16;
        if (buffered) {
          amx_pass(xm, K, G, nb, rows, ym, N, cbuf, [&](int J, int64_t g) {
            return static_cast<const uint16_t*>(buf + (J * G + g) * 512);
          });
        } else {
          amx_pass(xm, K, G, nb, rows, ym, N, cbuf, [&](int J, int64_t g) {
            uint16_t* out = ring[J == 3 ? 0 : J];
            const int64_t t = (b0 + J) * G + g;
            dequant_tile<Q4>(qp + t * tile_bytes, sp + t * sa_floats, out);
            return static_cast<const uint16_t*>(out);
          });
        }
      }
    }
    _tile_release();
  });
}
#endif

template <bool Q4>
at::Tensor amx_op(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa) {
  TORCH_CHECK(amx_usable(), "AMX matmuls need a CPU and kernel with AMX-BF16 (amx_usable())");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be bfloat16 [M, K], contiguous");
  const int64_t row_bytes = Q4 ? 16 : 32;
  TORCH_CHECK(qa.dim() == 4 && qa.size(2) == 16 && qa.size(3) == row_bytes &&
              qa.is_contiguous() && qa.scalar_type() == (Q4 ? at::kByte : at::kChar),
              "qa must be ", Q4 ? "uint8 [N/16, K/32, 16, 16]" : "int8 [N/16, K/32, 16, 32]",
              ", contiguous");
  TORCH_CHECK(x.size(1) == qa.size(1) * 32, "x has ", x.size(1), " columns, the weight ",
              qa.size(1) * 32);
  TORCH_CHECK(sa.dim() == 3 && sa.size(0) == qa.size(0) && sa.size(1) == qa.size(1) &&
              sa.size(2) == (Q4 ? 32 : 16) && sa.scalar_type() == at::kFloat &&
              sa.is_contiguous(), "sa must be float32 [N/16, K/32, ", Q4 ? 32 : 16, "]");
  auto y = at::empty({x.size(0), qa.size(0) * 16}, x.options());
#ifdef LANESERVE_AMX
  if (y.numel() > 0) amx_mm<Q4>(x, qa, sa, y);
#endif
  return y;
}

at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa) {
  return amx_op<true>(x, qa, sa);
}

at::Tensor q8_0_amx(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa) {
  return amx_op<false>(x, qa, sa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("amx_usable() -> bool", &amx_usable);
  m.def("int4_amx(Tensor x, Tensor qa, Tensor sa) -> Tensor");
  m.def("q8_0_amx(Tensor x, Tensor qa, Tensor sa) -> Tensor");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("int4_amx", &int4_amx);
  m.impl("q8_0_amx", &q8_0_amx);
}
