// The AVX-512 VNNI route of the int8 K-quant GEMV (kquant_q8k.cpp, route 1) in 512-bit
// registers: 64 weights a register where the AVX2 route holds 32, so a row of x takes 4
// `vpmaddubsw` (byte pairs -> int16) and 4 `vpdpwssd` (the int16 scale multiply-adds) per
// super-block where 256-bit registers took 8 and 8. The integer sums are those of the scalar
// route. Past one row of x, four outputs share each row's activations, and the rows are taken
// in tiles of about 256 KiB of activations (at least 16 rows). Included by kquant_q8k.cpp inside
// its namespace, after the AVX2 route (it uses `scales_mins_k4_regs`, `Q8K`, `GemvArgs`,
// `prefetch_block`). No intrinsic here needs more than GCC 9.
#pragma once

// One super-block in 512-bit registers: q[c] the quants of weights 64c .. 64c + 63 (unsigned
// bytes, the activations' order), scale[c] the int16 scale of each of their byte pairs, min the
// per-16 mins (Q6_K: 32 x scale) as int16 [16], d and dmin its float scales.
struct Regs512 {
  __m512i q[4], scale[4];
  __m256i min;
  float d, dmin;
};

// Byte pair i of register c (weights 64c + 2i, + 1) lies in 16-weight group 4c + i / 8, and in
// Q4_K / Q5_K's 32-weight sub-block 2c + i / 16: int16 indices for `vpermw`.
struct PairIndex {
  alignas(64) int16_t group[4][32];
  alignas(64) int16_t sub[4][32];
  constexpr PairIndex() : group{}, sub{} {
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 32; ++i) {
        group[c][i] = static_cast<int16_t>(4 * c + i / 8);
        sub[c][i] = static_cast<int16_t>(2 * c + i / 16);
      }
    }
  }
};
inline constexpr PairIndex kPairIndex{};

inline __m512i load_index(const int16_t* idx) { return _mm512_load_si512(idx); }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// int16 shift counts: `lo` in the low 256 bits' lanes, `hi` in the high 256 bits'
inline __m512i half_counts(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)),
                            _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

// Q4_K / Q5_K: qs[32c + l]'s low nibble is weight 64c + l, its high nibble 64c + 32 + l, so the
// 32 bytes broadcast to both halves and shifted right by 0 / 4 are weights 64c .. 64c + 63;
// Q5_K's fifth bits are bits 2c / 2c + 1 of qh[l].
template <bool kFive>
inline void load_q45_k_512(const uint8_t* b, Regs512* r) {
  r->d = kquant::fp16(b);
  r->dmin = kquant::fp16(b + 2);
  const __m128i sm = scales_mins_k4_regs(b + 4);  // sc[0..7] (bytes 0-7), m[0..7] (bytes 8-15)
  // sc[0..7] in lanes 0-7 (`vpermw` reads no lane past them)
  const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
  const __m128i m = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
  r->min = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
  const __m512i low4 = _mm512_set1_epi8(0x0F), nibble = half_counts(0, 4);
  const uint8_t* qs = kFive ? b + 48 : b + 16;
  __m512i qh = _mm512_setzero_si512();
  if constexpr (kFive) {
    qh = _mm512_broadcast_i64x4(load256(b + 16));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_broadcast_i64x4(load256(qs + 32 * c));
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, nibble), low4);
    if constexpr (kFive) {  // bit 2c (2c + 1) of each byte moved to bit 4
      const __m512i bit = _mm512_srlv_epi16(qh, half_counts(2 * c, 2 * c + 1));
      q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi16(bit, 4), _mm512_set1_epi8(0x10)));
    }
    r->q[c] = q;
    r->scale[c] = _mm512_permutexvar_epi16(load_index(kPairIndex.sub[c]), sc);
  }
}

// Q6_K: per half h of 128, weights l, l + 32, l + 64, l + 96 are the low / high nibbles of
// ql[64h + l] and ql[64h + 32 + l] with bit pairs 0-1, 2-3, 4-5, 6-7 of qh[32h + l]: the 64
// bytes of ql's half hold weights 128h .. 128h + 63 in their low nibbles and the next 64 in
// their high ones.
inline void load_q6_k_512(const uint8_t* b, Regs512* r) {
  r->d = r->dmin = kquant::fp16(b + 208);
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256i groups = _mm256_cvtepi8_epi16(sc8);
  r->min = _mm256_slli_epi16(groups, 5);  // 32 x scale
  const __m512i sc = _mm512_castsi256_si512(groups);  // lanes 0-15, all `vpermw` reads
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  const __m512i up_lo = half_counts(4, 2), down_hi = half_counts(0, 2);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h);
    const __m512i hb = _mm512_broadcast_i64x4(load256(b + 128 + 32 * h));
    r->q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low4),
                                  _mm512_and_si512(_mm512_sllv_epi16(hb, up_lo), high2));
    r->q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                      _mm512_and_si512(_mm512_srlv_epi16(hb, down_hi), high2));
  }
  for (int c = 0; c < 4; ++c) {
    r->scale[c] = _mm512_permutexvar_epi16(load_index(kPairIndex.group[c]), sc);
  }
}

// The integer sums of one super-block of one output with one row of x: weights x activations
// scaled per 16 weights, in two chains of multiply-adds (s), and the mins x bsums (m).
struct Sums {
  __m512i s;
  __m256i m;
};

inline Sums block_sums(const Regs512& r, const __m512i* x, const int16_t* bs) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  s0 = _mm512_dpwssd_epi32(s0, _mm512_maddubs_epi16(r.q[0], x[0]), r.scale[0]);
  s1 = _mm512_dpwssd_epi32(s1, _mm512_maddubs_epi16(r.q[1], x[1]), r.scale[1]);
  s0 = _mm512_dpwssd_epi32(s0, _mm512_maddubs_epi16(r.q[2], x[2]), r.scale[2]);
  s1 = _mm512_dpwssd_epi32(s1, _mm512_maddubs_epi16(r.q[3], x[3]), r.scale[3]);
  return {_mm512_add_epi32(s0, s1), _mm256_madd_epi16(r.min, load256(bs))};
}

// acc[0..15] += xd * (d * sum_g scale_g qxq_g - dmin * sum_g min_g bsums_g)
inline __m512 add_block(const Regs512& r, const Sums& t, float xd, __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_set1_ps(xd * r.d), _mm512_cvtepi32_ps(t.s), acc);
  return _mm512_fnmadd_ps(_mm512_set1_ps(xd * r.dmin),
                          _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_setzero_si512(), t.m, 0)),
                          acc);
}

template <int64_t kType>
inline void load_512(const uint8_t* b, Regs512* r) {
  if constexpr (kType == kQ6K) {
    load_q6_k_512(b, r);
  } else {
    load_q45_k_512<kType == kQ5K>(b, r);
  }
}

// Activation bytes (rows x K) a pass over the outputs keeps in L2: past it the rows are taken
// in tiles, each super-block loaded again per tile (a 2048-row Q6_K down at K = 8192, 16 MB of
// activations, ran 6.4x as long as 1024 rows before).
constexpr int64_t kRowTileBytes = 1 << 18;

// Outputs n0..n1 on the 512-bit route: each super-block loaded into registers once for all rows
// of x in a tile, kOut outputs at a time (each row's activations are then read once for all of
// them).
template <int64_t kType, int kOut>
void gemv_rows_512(const GemvArgs& g, int64_t n0, int64_t n1) {
  // tiles of equal rows (a last tile of one row would load every super-block again for it)
  const int64_t most = std::max<int64_t>(16, kRowTileBytes / (g.nb * kQK));
  const int64_t tiles = (g.M + most - 1) / most, tile = (g.M + tiles - 1) / tiles;
  std::vector<__m512> acc(kOut * tile);
  const int8_t* xq = g.a->q.data();
  const int16_t* bsums = g.a->bsums.data();
  const float* xd = g.a->d.data();
  const int64_t row_bytes = g.nb * g.bytes;
  Regs512 r[kOut];
  for (int64_t m0 = 0; m0 < g.M; m0 += tile) {
    const int64_t m1 = std::min(g.M, m0 + tile);
    for (int64_t n = n0; n < n1; n += kOut) {
      const int outs = static_cast<int>(std::min<int64_t>(kOut, n1 - n));
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t b = 0; b < g.nb; ++b) {
        for (int o = 0; o < outs; ++o) {
          const uint8_t* block = g.blocks + (n + o) * row_bytes + b * g.bytes;
          prefetch_block(block, g.bytes);
          load_512<kType>(block, &r[o]);
        }
        for (int64_t m = m0; m < m1; ++m) {
          const int64_t i = m * g.nb + b;
          const int8_t* xi = xq + i * kQK;
          const __m512i x[4] = {_mm512_loadu_si512(xi), _mm512_loadu_si512(xi + 64),
                                _mm512_loadu_si512(xi + 128), _mm512_loadu_si512(xi + 192)};
          __m512* a = acc.data() + kOut * (m - m0);
          for (int o = 0; o < outs; ++o) {
            a[o] = add_block(r[o], block_sums(r[o], x, bsums + i * kGroups), xd[i], a[o]);
          }
        }
      }
      for (int64_t m = m0; m < m1; ++m) {
        for (int o = 0; o < outs; ++o) {
          g.y[m * g.ldy + n + o] = _mm512_reduce_add_ps(acc[kOut * (m - m0) + o]);
        }
      }
    }
  }
}

// Four outputs at a time past one row (Llama-3.2-1B's shapes on a 2-core Zen 4 at 256 rows:
// 0.70x (Q4_K) and 0.73x (Q6_K) the time of one output at a time; two outputs 0.70x and 0.85x).
template <int64_t kType>
void gemv_rows_512(const GemvArgs& g, int64_t n0, int64_t n1) {
  if (g.M == 1) return gemv_rows_512<kType, 1>(g, n0, n1);
  return gemv_rows_512<kType, 4>(g, n0, n1);
}
