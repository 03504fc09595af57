// The row-interleaved ("x16") layout of K-quant weights and its int8 GEMV on the AVX-512
// VNNI route. A one-row call on the file's layout spends ~60 instructions per super-block of one
// output (the scales unpacked, the nibbles cut, a float sum per output), too many to keep up with
// two cores' bandwidth. `kquant_repack_x16` rewrites each 16 outputs' super-blocks (the same
// quants, scales and fp16 d) so that one register holds 4 consecutive quants of each of 16
// outputs: one `vpdpbusd` against a broadcast of 4 activations adds to 16 outputs' dot products,
// the scales of 16 outputs are one widening load, and the float sums are 16 outputs' lanes (no
// horizontal sum). ~15 instructions per output's Q4_K super-block, ~25 per Q5_K one, ~30 per
// Q6_K one (counted from the code).
//
// A unit is 16 outputs x one super-block (offsets in bytes; units start on cache lines):
//   Q4_K (2368): sc 0-127, mins 128-255, d 256-287, dmin 288-319, quants 320-2367
//     sc[s][r] (uint8) of sub-block s (0-7) and output r; mins [j][r][e] = m[2 j + e] of
//     output r (uint8); d, dmin [r] (fp16); quants of sub-block s, u (0-3): 64 bytes at
//     320 + 64 (4 s + u), byte 4 r + i of output r holding quant 32 s + 4 u + i in its low
//     nibble and 32 s + 16 + 4 u + i in its high one.
//   Q5_K (2880): Q4_K's sc, mins, d, dmin, then per sub-block s 320 bytes at 320 + 320 s: its
//     nibbles (4 x 64, as Q4_K's) and 64 bytes of fifth bits, bit k of byte 4 r + i that of
//     quant 32 s + 16 (k / 4) + 4 (k % 4) + i.
//   Q6_K (3392: the file's 16 x 210 and 32 bytes of padding): sc 0-255, d 256-287, then per
//     group g (0-15) 192 bytes at 320 + 192 g: ql, 2 x 64 bytes (p = 0, 1), byte 4 r + i the
//     low 4 bits of quant 16 g + 4 p + i in its low nibble and of 16 g + 8 + 4 p + i in its high
//     one; qh, 64 bytes, byte 4 r + i holding the top 2 bits of quant 16 g + 4 t + i in its bits
//     2 t, 2 t + 1. sc[g][r] (int8); d [r] (fp16).
// Included by kquant_q8k.cpp inside its namespace (it uses `Unpacked`, `unpack`, `Q8K`,
// `GemvArgs`, `block_dot_scalar`, `kPrefetchBytes`, `kRowTileBytes`); the fast GEMV needs
// LANESERVE_KQUANT_VNNI, the other routes run the reference one (`gemv_x16_ref`).
#pragma once

constexpr int64_t kX16 = 256;  // qtype flag: the blocks tensor is in the x16 layout
constexpr int kX16Rows = 16;
constexpr int kQ4Sc = 0, kQ4Min = 128, kQ4D = 256, kQ4Dmin = 288, kQ4Q = 320, kQ4Unit = 2368;
constexpr int kQ5Unit = 2880;  // Q4_K's fields, each sub-block's nibbles followed by its fifth bits
// Q6_K's unit is padded to 3392 bytes: units start on cache lines
constexpr int kQ6Sc = 0, kQ6D = 256, kQ6Q = 320, kQ6Unit = 3392;
inline int q6_ql(int g) { return kQ6Q + 192 * g; }
inline int q6_qh(int g) { return kQ6Q + 192 * g + 128; }

// Q4_K / Q5_K: the 64 bytes of nibbles u (0-3) of sub-block s, and Q5_K's fifth bits of it
inline int q45_nibbles(bool five, int s, int u) {
  return kQ4Q + (five ? 320 * s + 64 * u : 64 * (4 * s + u));
}
inline int q5_qh(int s) { return kQ4Q + 320 * s + 256; }

inline bool is_x16(int64_t qtype) { return (qtype & kX16) != 0; }

inline int64_t x16_unit_bytes(int64_t qtype) {
  switch (qtype & ~kX16) {
    case kquant::kQ4K: return kQ4Unit;
    case kQ5K: return kQ5Unit;
    case kQ6K: return kQ6Unit;
    default: TORCH_CHECK(false, "kquant: qtype ", qtype & ~kX16, " is not Q4_K, Q5_K or Q6_K");
  }
  return 0;
}

// One unit from the 16 outputs' super-blocks `rows[r]` (file layout).
template <int64_t kType>
void repack_unit(const uint8_t* const* rows, uint8_t* out) {
  Unpacked u;
  for (int r = 0; r < kX16Rows; ++r) {
    unpack<kType>(rows[r], &u);  // quants in the activations' order, scales per 16
    if constexpr (kType == kQ6K) {
      for (int g = 0; g < 16; ++g) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t* q = u.q + 16 * g;
          for (int p = 0; p < 2; ++p) {
            out[q6_ql(g) + 64 * p + 4 * r + i] =
                static_cast<uint8_t>((q[4 * p + i] & 0xF) | (q[8 + 4 * p + i] & 0xF) << 4);
          }
          uint8_t h = 0;
          for (int t = 0; t < 4; ++t) h |= static_cast<uint8_t>((q[4 * t + i] >> 4) << (2 * t));
          out[q6_qh(g) + 4 * r + i] = h;
        }
        out[kQ6Sc + 16 * g + r] = static_cast<uint8_t>(u.scale[g]);
      }
      std::memcpy(out + kQ6D + 2 * r, rows[r] + 208, 2);
    } else {
      constexpr bool kFive = kType == kQ5K;
      for (int s = 0; s < 8; ++s) {
        for (int q = 0; q < 4; ++q) {
          for (int i = 0; i < 4; ++i) {
            const int w = 32 * s + 4 * q + i;
            out[q45_nibbles(kFive, s, q) + 4 * r + i] =
                static_cast<uint8_t>((u.q[w] & 0xF) | (u.q[w + 16] & 0xF) << 4);
          }
        }
        if constexpr (kFive) {  // bit k of byte 4 r + i: the fifth bit of register k's quant
          for (int i = 0; i < 4; ++i) {
            uint8_t h = 0;
            for (int k = 0; k < 8; ++k) {
              h |= static_cast<uint8_t>((u.q[32 * s + 16 * (k / 4) + 4 * (k % 4) + i] >> 4) << k);
            }
            out[q5_qh(s) + 4 * r + i] = h;
          }
        }
        out[kQ4Sc + 16 * s + r] = static_cast<uint8_t>(u.scale[2 * s]);
      }
      for (int j = 0; j < 4; ++j) {
        for (int e = 0; e < 2; ++e) {
          out[kQ4Min + 32 * j + 2 * r + e] = static_cast<uint8_t>(u.min[2 * (2 * j + e)]);
        }
      }
      std::memcpy(out + kQ4D + 2 * r, rows[r], 2);
      std::memcpy(out + kQ4Dmin + 2 * r, rows[r] + 2, 2);
    }
  }
}

// Output r of a unit back in the activations' order (`repack_unit`'s inverse): the reference
// route's view of the layout.
template <int64_t kType>
void unpack_x16(const uint8_t* unit, int r, Unpacked* u) {
  if constexpr (kType == kQ6K) {
    for (int g = 0; g < 16; ++g) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t h = unit[q6_qh(g) + 4 * r + i];
        for (int p = 0; p < 2; ++p) {
          const uint8_t l = unit[q6_ql(g) + 64 * p + 4 * r + i];
          u->q[16 * g + 4 * p + i] = static_cast<uint8_t>((l & 0xF) | ((h >> (2 * p)) & 3) << 4);
          u->q[16 * g + 8 + 4 * p + i] =
              static_cast<uint8_t>((l >> 4) | ((h >> (2 * p + 4)) & 3) << 4);
        }
      }
      u->scale[g] = static_cast<int8_t>(unit[kQ6Sc + 16 * g + r]);
      u->min[g] = static_cast<int16_t>(32 * u->scale[g]);
    }
    u->d = u->dmin = kquant::fp16(unit + kQ6D + 2 * r);
  } else {
    constexpr bool kFive = kType == kQ5K;
    for (int s = 0; s < 8; ++s) {
      for (int q = 0; q < 4; ++q) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t b = unit[q45_nibbles(kFive, s, q) + 4 * r + i];
          const int h = kFive ? unit[q5_qh(s) + 4 * r + i] : 0;
          u->q[32 * s + 4 * q + i] = static_cast<uint8_t>((b & 0xF) | ((h >> q) & 1) << 4);
          u->q[32 * s + 16 + 4 * q + i] =
              static_cast<uint8_t>((b >> 4) | ((h >> (q + 4)) & 1) << 4);
        }
      }
      const int16_t m = unit[kQ4Min + 32 * (s / 2) + 2 * r + s % 2];
      u->scale[2 * s] = u->scale[2 * s + 1] = unit[kQ4Sc + 16 * s + r];
      u->min[2 * s] = u->min[2 * s + 1] = m;
    }
    u->d = kquant::fp16(unit + kQ4D + 2 * r);
    u->dmin = kquant::fp16(unit + kQ4Dmin + 2 * r);
  }
}

// The reference GEMV of an x16 part (the scalar route, and the AVX2 one, which has no x16
// code): each output's super-block unpacked, then the scalar block dot per row of x.
template <int64_t kType>
void gemv_x16_ref(const GemvArgs& g, int64_t n0, int64_t n1) {
  Unpacked u;
  std::vector<float> acc(g.M * 16);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* units = g.blocks + n / kX16Rows * g.nb * g.bytes;
    for (int64_t b = 0; b < g.nb; ++b) {
      unpack_x16<kType>(units + b * g.bytes, static_cast<int>(n % kX16Rows), &u);
      for (int64_t m = 0; m < g.M; ++m) {
        const int64_t i = m * g.nb + b;
        block_dot_scalar(u, g.a->q.data() + i * kQK, g.a->bsums.data() + i * kGroups, g.a->d[i],
                         acc.data() + m * 16);
      }
    }
    for (int64_t m = 0; m < g.M; ++m) g.y[m * g.ldy + n] = acc[m * 16];
  }
}

#ifdef LANESERVE_KQUANT_VNNI
// The x16 GEMV prefetches each line kPrefetchBytes ahead as it loads it, and a unit's lines lie
// in the order they are loaded (scales first): a burst of a whole unit's prefetches, or Q6_K's
// low and high bits in separate halves of a unit, left a DRAM-resident Q6_K matrix at ~0.55x
// the file layout's rate on a Zen 4.
inline void prefetch_line(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
}

inline __m512i bcast4(const int8_t* p) {  // 4 activations in each of 16 lanes
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

// The 8 registers of Q4_K / Q5_K sub-block s (4 quants of 16 outputs each): w[u] quants
// 32 s + 4 u .., w[4 + u] quants 32 s + 16 + 4 u ..; Q5_K's fifth bits (bit k of each byte for
// w[k]) shifted to bit 4.
template <bool kFive>
inline void q45_x16_regs(const uint8_t* unit, int s, __m512i w[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < 4; ++u) {
    prefetch_line(unit + q45_nibbles(kFive, s, u));
    const __m512i p = load512(unit + q45_nibbles(kFive, s, u));
    w[u] = _mm512_and_si512(p, low4);
    w[4 + u] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
  }
  if constexpr (kFive) {
    prefetch_line(unit + q5_qh(s));
    const __m512i h = load512(unit + q5_qh(s)), bit4 = _mm512_set1_epi8(0x10);
    for (int k = 0; k < 8; ++k) {
      const __m512i at4 = k <= 4 ? _mm512_slli_epi16(h, 4 - k) : _mm512_srli_epi16(h, k - 4);
      w[k] = _mm512_or_si512(w[k], _mm512_and_si512(at4, bit4));
    }
  }
}

// The 4 registers of Q6_K group g: w[t] quants 16 g + 4 t .. (0..63)
inline void q6_x16_regs(const uint8_t* unit, int g, __m512i w[4]) {
  for (const int o : {q6_ql(g), q6_ql(g) + 64, q6_qh(g)}) prefetch_line(unit + o);
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  const __m512i l0 = load512(unit + q6_ql(g)), l1 = load512(unit + q6_ql(g) + 64);
  const __m512i h = load512(unit + q6_qh(g));
  w[0] = _mm512_or_si512(_mm512_and_si512(l0, low4),
                         _mm512_and_si512(_mm512_slli_epi16(h, 4), high2));
  w[1] = _mm512_or_si512(_mm512_and_si512(l1, low4),
                         _mm512_and_si512(_mm512_slli_epi16(h, 2), high2));
  w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                         _mm512_and_si512(h, high2));
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                         _mm512_and_si512(_mm512_srli_epi16(h, 2), high2));
}

// sum_i w[k][i] x[i] over the k registers of one scale group, for 16 outputs (two chains)
template <int kRegs>
inline __m512i group_dot(const __m512i* w, const int8_t* const* x) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (int k = 0; k < kRegs; k += 2) {
    a = _mm512_dpbusd_epi32(a, w[k], bcast4(x[k]));
    b = _mm512_dpbusd_epi32(b, w[k + 1], bcast4(x[k + 1]));
  }
  return _mm512_add_epi32(a, b);
}

// acc (16 outputs) += xd * d * isum - xd * dmin * msum for one row of x and one unit
inline __m512 x16_add(__m512 acc, __m512i isum, __m512i msum, const uint8_t* d,
                      const uint8_t* dmin, float xd) {
  const __m512 x = _mm512_set1_ps(xd);
  const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(load256(d)), x);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, acc);
  if (dmin == nullptr) return acc;
  const __m512 dm = _mm512_mul_ps(_mm512_cvtph_ps(load256(dmin)), x);
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), dm, acc);
}

// Rows m0..m1 of x against one Q4_K / Q5_K unit: acc[m - m0] += that row's 16 outputs' terms.
template <bool kFive>
inline void q45_x16_unit(const GemvArgs& g, const uint8_t* unit, int64_t b, int64_t m0, int64_t m1,
                        __m512i* isum, __m512* acc) {
  const int64_t rows = m1 - m0;
  for (int64_t m = 0; m < rows; ++m) isum[m] = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    __m512i w[8];
    if (s < 5) prefetch_line(unit + 64 * s);  // sc, mins, d, dmin
    q45_x16_regs<kFive>(unit, s, w);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(unit + kQ4Sc + 16 * s)));
    for (int64_t m = 0; m < rows; ++m) {
      const int8_t* xs = g.a->q.data() + ((m0 + m) * g.nb + b) * kQK + 32 * s;
      const int8_t* x[8] = {xs, xs + 4, xs + 8, xs + 12, xs + 16, xs + 20, xs + 24, xs + 28};
      const int8_t* xo[8] = {x[0], x[4], x[1], x[5], x[2], x[6], x[3], x[7]};
      const __m512i wo[8] = {w[0], w[4], w[1], w[5], w[2], w[6], w[3], w[7]};
      isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(group_dot<8>(wo, xo), sc));
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = (m0 + m) * g.nb + b;
    const int16_t* bs = g.a->bsums.data() + i * kGroups;
    __m512i msum = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {  // the bsums of sub-blocks 2 j and 2 j + 1 as an int16 pair
      const uint16_t lo = static_cast<uint16_t>(bs[4 * j] + bs[4 * j + 1]);
      const uint16_t hi = static_cast<uint16_t>(bs[4 * j + 2] + bs[4 * j + 3]);
      const int32_t pair = static_cast<int32_t>(static_cast<uint32_t>(hi) << 16 | lo);
      const __m512i mins = _mm512_cvtepu8_epi16(load256(unit + kQ4Min + 32 * j));
      msum = _mm512_dpwssd_epi32(msum, mins, _mm512_set1_epi32(pair));
    }
    acc[m] = x16_add(acc[m], isum[m], msum, unit + kQ4D, unit + kQ4Dmin, g.a->d[i]);
  }
}

// Rows m0..m1 of x against one Q6_K unit: sum_g sc_g (q . x - 32 bsum_g) per output.
inline void q6_x16_unit(const GemvArgs& g, const uint8_t* unit, int64_t b, int64_t m0, int64_t m1,
                        __m512i* isum, __m512* acc) {
  const int64_t rows = m1 - m0;
  for (int64_t m = 0; m < rows; ++m) isum[m] = _mm512_setzero_si512();
  for (int gr = 0; gr < 16; ++gr) {
    __m512i w[4];
    if (gr < 5) prefetch_line(unit + 64 * gr);  // sc, d
    q6_x16_regs(unit, gr, w);
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(unit + kQ6Sc + 16 * gr)));
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t i = (m0 + m) * g.nb + b;
      const int8_t* xs = g.a->q.data() + i * kQK + 16 * gr;
      const int8_t* x[4] = {xs, xs + 4, xs + 8, xs + 12};
      const __m512i off = _mm512_set1_epi32(32 * g.a->bsums[i * kGroups + gr]);
      const __m512i dot = _mm512_sub_epi32(group_dot<4>(w, x), off);
      isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(dot, sc));
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = (m0 + m) * g.nb + b;
    acc[m] = x16_add(acc[m], isum[m], isum[m], unit + kQ6D, nullptr, g.a->d[i]);
  }
}

// Outputs n0..n1 (multiples of 16) of an x16 part: each unit's registers cut once for all rows
// of x in a tile (kRowTileBytes of activations); the 16 outputs' sums stored as one vector.
template <int64_t kType>
void gemv_x16(const GemvArgs& g, int64_t n0, int64_t n1) {
  const int64_t most = std::max<int64_t>(16, kRowTileBytes / (g.nb * kQK));
  const int64_t tiles = (g.M + most - 1) / most, tile = (g.M + tiles - 1) / tiles;
  std::vector<__m512> acc(tile);
  std::vector<__m512i> isum(tile);
  for (int64_t m0 = 0; m0 < g.M; m0 += tile) {
    const int64_t m1 = std::min(g.M, m0 + tile);
    for (int64_t n = n0; n < n1; n += kX16Rows) {
      const uint8_t* units = g.blocks + n / kX16Rows * g.nb * g.bytes;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t b = 0; b < g.nb; ++b) {
        const uint8_t* unit = units + b * g.bytes;
        if constexpr (kType == kQ6K) {
          q6_x16_unit(g, unit, b, m0, m1, isum.data(), acc.data());
        } else {
          q45_x16_unit<kType == kQ5K>(g, unit, b, m0, m1, isum.data(), acc.data());
        }
      }
      for (int64_t m = m0; m < m1; ++m) _mm512_storeu_ps(g.y + m * g.ldy + n, acc[m - m0]);
    }
  }
}
#endif
