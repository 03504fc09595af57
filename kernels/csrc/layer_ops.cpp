// Fused layer ops: RMSNorm (with its residual add), SiLU-mul, RoPE with the KV-cache write,
// with the numerics of kernels/reference.py (transformers' Llama modules).
#include "vec.h"

namespace laneserve {
namespace {

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

// Grammar bitmask (structured outputs): in float32 `logits` [B, V], set -inf at every token row
// `rows[r]` may not take: bit t % 32 of bitmask[r][t / 32] clear, or t beyond the bitmask's
// 32 * W ids. In place; rows in parallel. The torch version unpacked every bit into a bool tensor
// ([64, 49152]: ~8 ms a step at batch 64 on a 2-core EPYC).
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous float32 [B, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask: contiguous int32 [R, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows: int64 [R], one per bitmask row");
  const int64_t B = logits.size(0), V = logits.size(1), R = bitmask.size(0), W = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < B, "row ", row_ids[r], " outside [0, ", B, ")");
  const int64_t words = std::min(W, (V + 31) / 32);
  const float neg = -std::numeric_limits<float>::infinity();
  float* base = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* out = base + row_ids[r] * V;
      const uint32_t* word = reinterpret_cast<const uint32_t*>(bits + r * W);
      for (int64_t w = 0; w < words; ++w) {
        const int64_t t0 = w * 32;
        uint32_t forbidden = ~word[w];
        if (V - t0 < 32) forbidden &= (1u << (V - t0)) - 1u;  // the last word's ids past V
        while (forbidden) {
          out[t0 + __builtin_ctz(forbidden)] = neg;
          forbidden &= forbidden - 1;
        }
      }
      for (int64_t t = words * 32; t < V; ++t) out[t] = neg;
    }
  });
}

}  // namespace
}  // namespace laneserve

TORCH_LIBRARY_FRAGMENT(laneserve, m) {
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_and_cache(Tensor qkv, Tensor positions, Tensor cos_sin_cache, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_q_heads, int num_kv_heads) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("fused_add_rms_norm", &laneserve::fused_add_rms_norm);
  m.impl("rms_norm", &laneserve::rms_norm);
  m.impl("silu_and_mul", &laneserve::silu_and_mul);
  m.impl("rope_and_cache", &laneserve::rope_and_cache);
  m.impl("apply_token_bitmask_", &laneserve::apply_token_bitmask_);
}
