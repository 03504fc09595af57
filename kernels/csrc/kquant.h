// What the K-quant kernels share (kquant_gemv.cpp: the fp32 route and dequantization;
// kquant_q8k.cpp: the int8 route): ggml's type numbers, super-block sizes, the fp16 scales and
// the packed 6-bit scales of Q4_K / Q5_K, and the check of a blocks tensor.
#pragma once

#include "vec.h"

namespace laneserve {
namespace kquant {

constexpr int64_t kQK = 256;  // weights per super-block
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    default: TORCH_CHECK(false, "kquant: qtype ", qtype, " is not Q4_K (12), Q5_K (13) or Q6_K (14)");
  }
  return 0;
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Super-blocks per row of a contiguous uint8 [N, K / 256 * bytes] blocks tensor.
inline int64_t check_blocks(const at::Tensor& blocks, int64_t qtype) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "kquant: blocks must be contiguous uint8 [N, K / 256 * ", bytes, "]");
  TORCH_CHECK(blocks.size(1) % bytes == 0, "kquant: a row of ", blocks.size(1),
              " bytes is not a whole number of ", bytes, "-byte super-blocks");
  return blocks.size(1) / bytes;
}

// Output rows per parallel task: about 4096 super-blocks of work each.
inline int64_t row_grain(int64_t nb) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, nb)); }

// The routes a kernel has built, widest first: 1 where `wide` (its widest instruction set was
// compiled in), 2 AVX2 + FMA, 3 scalar (always).
inline std::vector<int64_t> built_routes(bool wide) {
  std::vector<int64_t> routes;
  if (wide) routes.push_back(1);
#if defined(__AVX2__) && defined(__FMA__)
  routes.push_back(2);
#endif
  routes.push_back(3);
  return routes;
}

// `route` (0: the widest built) checked against the built ones.
inline int64_t pick_route(const std::vector<int64_t>& routes, int64_t route, const char* op) {
  if (route == 0) route = routes.front();
  TORCH_CHECK(std::find(routes.begin(), routes.end(), route) != routes.end(), op, ": route ",
              route, " is not built here");
  return route;
}

}  // namespace kquant
}  // namespace laneserve
