// Paged attention over the KV cache: one-token decode rows and multi-token (prefill) rows.
// See kernels/cpu_ext.py for the design and the measurements behind it.
#include "vec.h"

namespace laneserve {
namespace {

constexpr int64_t kRows = 4;  // query rows (of one KV head) sharing each K / V row load

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

}  // namespace
}  // namespace laneserve

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor seq_lens, Tensor block_tables, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("paged_decode_attention", &laneserve::paged_decode_attention);
  m.impl("paged_prefill_attention", &laneserve::paged_prefill_attention);
}
