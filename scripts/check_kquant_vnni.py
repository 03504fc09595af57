"""Run the int8 K-quant GEMV's AVX-512 VNNI block dot on a CPU without AVX-512, under SIMDe.

kernels/csrc/kquant_q8k.cpp's AVX-512 VNNI route is the default on AVX-512 CPUs, but the project's
CI machines are AVX2-only. This script cuts `Unpacked`, `block_dot_scalar`, `block_dot_avx2` and
`block_dot_vnni` verbatim from that file, compiles them with SIMDe (SIMD Everywhere, header-only:
portable implementations of the AVX-512 intrinsics, https://github.com/simd-everywhere/simde) on
this CPU, and compares the VNNI and AVX2 dots with the scalar one and with an exact int64 / float64
sum over random unpacked super-blocks of each K type (Q4_K quants 0..15, Q5_K 0..31, Q6_K 0..63
with signed scales and mins = 32 x scale), extremes included, each accumulated twice into the
same 16 lanes. Pass: every result within 1e-6 of the sum of its terms' magnitudes (float32
summation order is the only difference). The unpacking and the Q8_K quantization are shared by
all routes and covered by tests/kernels/test_kernels_kquant.py.

    python scripts/check_kquant_vnni.py --simde SIMDE_INCLUDE_DIR [--cases 200000]

SIMDE_INCLUDE_DIR holds simde/x86/avx512.h (Debian: libsimde-dev, /usr/include; PyPI's simde-py
sdist ships it). Needs g++ and an AVX2 CPU. Prints one JSON line; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "kquant_q8k.cpp"
PIECES = {  # what is cut from SOURCE: a regex from its first line to the closing brace
    "unpacked": r"^struct Unpacked \{.*?^\};",
    "scalar": r"^void block_dot_scalar\(.*?^\}",
    "avx2": r"^void block_dot_avx2\(.*?^\}",
    "vnni": r"^void block_dot_vnni\(.*?^\}",
}

HARNESS = r"""
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#ifndef _mm512_zextsi256_si512  // SIMDe 0.8 lacks it: the upper 256 bits zero
static inline simde__m512i zext256(simde__m256i a) {
  return simde_mm512_inserti64x4(simde_mm512_setzero_si512(), a, 0);
}
#define _mm512_zextsi256_si512(a) zext256(a)
#endif
constexpr int kQK = 256, kGroups = 16;
@UNPACKED@
@SCALAR@
@AVX2@
@VNNI@
int main(int argc, char** argv) {
  const long cases = std::atol(argv[1]);
  std::mt19937 rng(1);
  double worst[3] = {0, 0, 0};  // vnni, avx2, scalar: |sum - exact| / sum of |terms|
  long fails = 0;
  for (long t = 0; t < cases; ++t) {
    const int kind = t % 3, qmax = kind == 0 ? 15 : kind == 1 ? 31 : 63;
    const bool extreme = t % 97 == 0;
    Unpacked u;
    for (int i = 0; i < kQK; ++i) u.q[i] = extreme ? qmax : rng() % (qmax + 1);
    for (int g = 0; g < kGroups; ++g) {
      if (kind == 2) {
        const int sc = extreme ? -128 : int(rng() % 256) - 128;
        u.scale[g] = sc;
        u.min[g] = 32 * sc;
      } else {
        u.scale[g] = extreme ? 63 : rng() % 64;
        u.min[g] = extreme ? 63 : rng() % 64;
      }
    }
    u.d = std::ldexp(float(rng() % 1000 + 1), -16);
    u.dmin = kind == 2 ? u.d : std::ldexp(float(rng() % 1000 + 1), -17);
    alignas(64) int8_t xq[kQK];
    alignas(32) int16_t bs[kGroups];
    for (int i = 0; i < kQK; ++i) xq[i] = extreme ? (t % 2 ? 127 : -127) : int(rng() % 255) - 127;
    for (int g = 0; g < kGroups; ++g) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += xq[16 * g + i];
      bs[g] = s;
    }
    const float xd = 0.01f * float(rng() % 100 + 1);
    float acc[3][16] = {};
    for (int rep = 0; rep < 2; ++rep) {
      block_dot_vnni(u, xq, bs, xd, acc[0]);
      block_dot_avx2(u, xq, bs, xd, acc[1]);
      block_dot_scalar(u, xq, bs, xd, acc[2]);
    }
    double exact = 0, mag = 1e-300;
    for (int g = 0; g < kGroups; ++g) {
      long long dot = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) dot += u.q[i] * xq[i];
      const double a = double(u.d) * u.scale[g] * dot, b = double(u.dmin) * u.min[g] * bs[g];
      exact += 2.0 * xd * (a - b);
      mag += 2.0 * xd * (std::fabs(a) + std::fabs(b));
    }
    bool bad = false;
    for (int r = 0; r < 3; ++r) {
      double s = 0;
      for (int l = 0; l < 16; ++l) s += acc[r][l];
      const double err = std::fabs(s - exact) / mag;
      worst[r] = std::max(worst[r], err);
      bad = bad || !(err <= 1e-6);
    }
    fails += bad;
  }
  std::printf("{\"cases\": %ld, \"fails\": %ld, \"worst_vnni\": %.3g, \"worst_avx2\": %.3g, "
              "\"worst_scalar\": %.3g}\n", cases, fails, worst[0], worst[1], worst[2]);
  return fails != 0;
}
"""


def harness_source() -> str:
    text = SOURCE.read_text()
    code = HARNESS
    for name, pattern in PIECES.items():
        match = re.search(pattern, text, re.S | re.M)
        if match is None:
            sys.exit(f"{name}: {pattern!r} not found in {SOURCE}")
        code = code.replace(f"@{name.upper()}@", match.group(0))
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simde", required=True, help="the folder holding simde/x86/avx512.h")
    parser.add_argument("--cases", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpp, exe = Path(tmp) / "harness.cpp", Path(tmp) / "harness"
        cpp.write_text(harness_source())
        flags = ["-std=c++17", "-O2", "-march=native", "-Wno-psabi", f"-I{args.simde}"]
        subprocess.run(["g++", *flags, str(cpp), "-o", str(exe)], check=True)
        return subprocess.run([str(exe), str(args.cases)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
