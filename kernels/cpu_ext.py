"""A small C++ CPU kernel, built on first use: paged decode attention that reads K/V in place.

``torch.ops.laneserve.paged_decode_attention`` computes one query token per sequence against its
context, walking the block table and reading each block where it lies in the cache: no gather, no
padding to the longest sequence. One ``at::parallel_for`` task per (sequence, KV head) keeps the
``g = Hq / Hk`` query heads of the group together, so each K/V row is read once per group. Scores,
softmax and the weighted sum of V are in fp32 (two passes: K then V); the output is rounded once
to the output dtype. float32, bfloat16 and float16 caches; any cache strides with a contiguous
head dimension.

The source is compiled with ``torch.utils.cpp_extension.load_inline`` into torch's extension cache
(``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR``) the first time :func:`load` runs on a
machine (about a minute on 2 cores, then loaded in milliseconds). ``-march=native`` is used, so the
module name carries a hash of the CPU's flags. Without a C++ compiler, or with
``LANESERVE_CPU_KERNELS=0``, :func:`load` returns False and callers use the PyTorch reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from contracts import env

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);  // bf16 is the high half of an fp32
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint32_t>(raw[i]) << 16;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hk, D]; seq_lens int32 [B];
// block_tables int32 [B, max_blocks]; out [B, Hq, D]
// One task = one sequence and a range of its KV heads [h0, h1): all heads when the batch alone
// keeps the threads busy (each token's K/V row is then read whole, once), one head otherwise.
template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const at::Tensor& seq_lens, const at::Tensor& bt, double scale,
                 at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hk = kc.size(2), g = Hq / Hk;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const int64_t bts0 = bt.stride(0);
  const float fscale = static_cast<float>(scale);
  const int64_t per_task = B >= 4 * at::get_num_threads() ? Hk : 1;
  const int64_t tasks_per_seq = Hk / per_task;
  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), row(D), scores, inv_sum(Hq);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / tasks_per_seq;
      const int64_t h0 = (w % tasks_per_seq) * per_task, h1 = h0 + per_task;
      const int64_t r0 = h0 * g, r1 = h1 * g;  // query heads of this task
      const int64_t len = sl[b];
      for (int64_t r = r0; r < r1; ++r) {
        load_row(qp + b * qs0 + r * qs1, qf.data() + r * D, D);
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= fscale;
      }
      scores.resize(Hq * len);
      // pass 1: scores[r, t] = scale * q_r . k_t, read block by block where it lies
      for (int64_t t = 0; t < len; ++t) {
        const int64_t base = btp[b * bts0 + t / bs] * ks0 + (t % bs) * ks1;
        for (int64_t h = h0; h < h1; ++h) {
          load_row(kp + base + h * ks2, row.data(), D);
          for (int64_t r = h * g; r < (h + 1) * g; ++r)
            scores[r * len + t] = dot(qf.data() + r * D, row.data(), D);
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        float* s = scores.data() + r * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[r] = 1.f / sum;
      }
      // pass 2: acc[r] = sum_t p[r, t] * v_t
      std::fill(acc.begin() + r0 * D, acc.begin() + r1 * D, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t base = btp[b * bts0 + t / bs] * vs0 + (t % bs) * vs1;
        for (int64_t h = h0; h < h1; ++h) {
          load_row(vp + base + h * vs2, row.data(), D);
          for (int64_t r = h * g; r < (h + 1) * g; ++r) {
            const float p = scores[r * len + t];
            float* a = acc.data() + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        T* o = op + b * os0 + r * os1;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv_sum[r]);
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& seq_lens,
                            const at::Tensor& block_tables, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, Hq, D], k_cache [N, bs, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == q.scalar_type(), "q, caches and out share one dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
              block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "int32 metadata");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q, k_cache, v_cache, seq_lens, block_tables, scale, out);
  });
}

}  // namespace

TORCH_LIBRARY(laneserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, "
        "Tensor block_tables, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(laneserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
"""

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_flags_tag() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256((_SOURCE + flags + torch.__version__).encode()).hexdigest()
    return digest[:12]


def load() -> bool:
    """Build (first time on this machine) and load the extension; True when its ops are usable.

    Never raises: a failed build is logged once as a warning and the PyTorch path is used.
    """
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if not env.get("LANESERVE_CPU_KERNELS"):
            _state["ok"] = False
            return False
        try:
            from torch.utils.cpp_extension import load_inline

            load_inline(
                name=f"laneserve_cpu_{_cpu_flags_tag()}",
                cpp_sources=[_SOURCE],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _state["ok"] = hasattr(torch.ops.laneserve, "paged_decode_attention")
        except Exception as exc:  # no compiler, failed build: the reference path still works
            logger.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", exc)
            _state["ok"] = False
    return _state["ok"]
