// x times a held GGUF matrix with AVX-512 VNNI: Q4_0 in ggml's repacked CPU layout
// (block_q4_0x8: 8 output rows' blocks interleaved) and Q8_0 in the file's layout, each a GEMV
// at one row and a GEMM past it: the products ggml_pool.h's MulMat and MulMatId run in place
// of ggml's own kernels for these matrices.
//
// ggml's kernels (ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0, ggml_vec_dot_q8_0_q8_0:
// llama.cpp's on x86) multiply signed bytes by signed bytes: each VNNI dot product costs two
// sign instructions (or an absolute value and a masked negation), after a table lookup that
// widens each signed nibble of Q4_0. Here the weights are read unsigned (Q4_0's nibbles q in
// 0..15, which ggml stores as q ^ 8; Q8_0's bytes plus 128), so each 64 bytes of weights take
// one dpbusd against x's signed bytes (broadcast across Q4_0's 8 rows), and the offset comes
// off once a block from x's block sum (Q4_0: w = d (q - 8), 8 sum(x); Q8_0: 128 sum(x)). x is
// quantized to Q8_0 as ggml quantizes it (d = max |x| / 127 in float16, q = x / d rounded to
// nearest even), so the integer sums are ggml's exactly; the float sums run in another order.
// The GEMVs prefetch 2 KiB ahead and reach the memory's rate where ggml's GEMV is bound by
// its instructions; the GEMM's tiles (4 rows, 2 groups of 8 outputs) reuse each unpacked block
// 4 times and each broadcast of x twice. On the development VM, cold matrices of 0.5-25 MB
// (scripts/avx512_kernels/run.py): 1.1-1.45x ggml's GEMV, 1.4-2.1x its GEMM at 32-512 rows.
// docs/measurements/log.md, "hx's own Q4_0 and Q8_0 kernels". The Q8_0 GEMM, whose dpbusd
// covers one row of w (the file's layout interleaves none), converts and scales every pair
// of blocks per tile cell: 1.04-1.17x ggml's (Llama-2-7B's 11008 x 4096 at 64 and 512 rows).
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define HX_AVX512_PRODUCTS 1
#else
#define HX_AVX512_PRODUCTS 0
#endif

namespace hx_ggml {

// The bytes of one row of x quantized to Q8_0 (K a multiple of 32): its K bytes, then per
// block of 32 its scale (the float16 value, widened: float32) and 8 times the sum of its bytes
// (int32).
inline int64_t RowQ8Bytes(int64_t K) { return K + K / 32 * 8; }

#if HX_AVX512_PRODUCTS

// Quantizes the K floats at x into the RowQ8Bytes(K) bytes at row.
inline void QuantizeRow(const float* x, int64_t K, uint8_t* row) {
  const int64_t blocks = K / 32;
  int8_t* q = reinterpret_cast<int8_t*>(row);
  float* d = reinterpret_cast<float*>(row + K);
  int32_t* sum8 = reinterpret_cast<int32_t*>(row + K + 4 * blocks);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign),
                                                          _mm512_and_ps(v1, sign)));
    const float scale = amax != 0.f ? 127.f / amax : 0.f;
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(scale)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(scale)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
    d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
    sum8[b] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

constexpr int64_t kBlockBytes = 144;  // block_q4_0x8: 8 float16 scales, 128 bytes of nibbles

// One block of 8 rows (block_q4_0x8 at `block`) unpacked for dpbusd: the nibbles unsigned (q;
// ggml stores q ^ 8), lo0/hi0 elements 0-7/16-23 and lo1/hi1 8-15/24-31 of each row (byte
// 64 k + 8 r + i holds row r's element 8 k + i low and 8 k + i + 16 high); scales: row r's
// float16 scale widened, in lanes 2r and 2r + 1.
struct Unpacked {
  __m512i lo0, hi0, lo1, hi1;
  __m512 scales;
};

inline Unpacked Unpack(const uint8_t* block) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x88));
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(block + 16), flip);
  const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(block + 80), flip);
  return {_mm512_and_si512(w0, m4), _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4),
          _mm512_and_si512(w1, m4), _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4),
          _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)))))};
}

// acc + one block's product of 8 rows `w` with block b of x's quantized row (QuantizeRow's, K
// values): lanes 2r and 2r + 1 hold halves of row r's sum; the -8 of the 32 q comes off in
// the even lane.
inline __m512 Dot(const Unpacked& w, const uint8_t* row, int64_t K, int64_t b, __m512 acc) {
  const uint8_t* q = row + 32 * b;
  const float d = reinterpret_cast<const float*>(row + K)[b];
  const int32_t sum8 = reinterpret_cast<const int32_t*>(row + K + K / 8)[b];
  auto bytes = [q](int at) { return _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(q + at)); };
  __m512i i0 = _mm512_dpbusd_epi32(_mm512_set1_epi64(int64_t(uint32_t(-sum8))), w.lo0, bytes(0));
  __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.lo1, bytes(8));
  i0 = _mm512_dpbusd_epi32(i0, w.hi0, bytes(16));
  i1 = _mm512_dpbusd_epi32(i1, w.hi1, bytes(24));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)),
                         _mm512_mul_ps(w.scales, _mm512_set1_ps(d)), acc);
}

// The 8 rows' sums of `acc` (Dot's lanes, added pairwise) at out.
inline void Store8(__m512 acc, float* out) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_add_ps(
      _mm512_permutex2var_ps(acc, even, acc), _mm512_permutex2var_ps(acc, odd, acc))));
}

// Prefetches `lines` cache lines 2 KiB past `at`, where that is before `end`: the GEMVs read
// their matrix at the memory's rate only so.
inline void PrefetchAhead(const uint8_t* at, const uint8_t* end, int lines) {
  constexpr int64_t kAhead = 2048;
  if (at + kAhead >= end) return;
  for (int i = 0; i < lines; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(at + kAhead + 64 * i), _MM_HINT_T0);
}

// out[n] for the 8 rows n of each group g in [g0, g1) of w (groups of 8 rows of K / 32 blocks
// each), x one quantized row. The blocks 2 KiB ahead are prefetched.
inline void GemvQ4_0x8(const uint8_t* w, const uint8_t* x, int64_t K, int64_t g0, int64_t g1,
                       float* out) {
  const int64_t blocks = K / 32;
  const uint8_t* end = w + g1 * blocks * kBlockBytes;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* rows = w + g * blocks * kBlockBytes;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = rows + b * kBlockBytes;
      PrefetchAhead(block, end, 3);
      acc = Dot(Unpack(block), x, K, b, acc);
    }
    Store8(acc, out + 8 * g);
  }
}

// out[n] for rows n in [n0, n1) of a Q8_0 matrix w in the file's layout (each row K / 32
// blocks of 34 bytes: a float16 scale, 32 signed bytes) times x's quantized row: each block's
// bytes read unsigned (w + 128) against x's signed ones in one dpbusd, the 128 sum(x) off
// (16 times RowQ8's 8 sum), two blocks a step on separate sums; the row 2 KiB ahead
// prefetched. A decode step's Q8_0 products (SmolLM2's LM head) read their matrix at the
// memory's rate.
inline void GemvQ8_0(const uint8_t* w, const uint8_t* x, int64_t K, int64_t n0, int64_t n1,
                     float* out) {
  constexpr int64_t kBlock = 34;
  const int64_t blocks = K / 32, row_bytes = blocks * kBlock;
  const float* xd = reinterpret_cast<const float*>(x + K);
  const int32_t* sum8 = reinterpret_cast<const int32_t*>(x + K + K / 8);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  const uint8_t* end = w + n1 * row_bytes;
  auto block = [&](const uint8_t* at, int64_t b, __m256 acc) {
    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 2)),
                                       flip);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, -16 * sum8[b]),
                                             q, _mm256_loadu_si256(
                                                 reinterpret_cast<const __m256i*>(x + 32 * b)));
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(at)) * xd[b];
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), acc);
  };
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      const uint8_t* at = row + b * kBlock;
      PrefetchAhead(at, end, 2);
      even = block(at, b, even);
      odd = block(at + kBlock, b + 1, odd);
    }
    if (b < blocks) even = block(row + b * kBlock, b, even);
    const __m256 sum = _mm256_add_ps(even, odd);
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    out[n] = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
  }
}

// R rows of x (quantized rows x[0..R), K values each) times the 8 G rows of groups g, g + 1,
// ... of w, into out[i] + 8 (g + j): a tile whose unpacked blocks serve R rows and whose x
// bytes serve G groups.
template <int R, int G>
inline void Tile(const uint8_t* w, const uint8_t* const* x, int64_t K, int64_t g,
                 float* const* out) {
  const int64_t blocks = K / 32;
  __m512 acc[R][G];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    Unpacked u[G];
    for (int j = 0; j < G; ++j) u[j] = Unpack(w + ((g + j) * blocks + b) * kBlockBytes);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < G; ++j) acc[i][j] = Dot(u[j], x[i], K, b, acc[i][j]);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) Store8(acc[i][j], out[i] + 8 * (g + j));
}

// tile(rows, r) over rows [r, r1) of x: tiles of 4 rows, the last 1-3 in one tile of their own
// (rows a std::integral_constant), so that each tile's weights are read and unpacked once.
template <typename TileAt>
inline void Tiles(int64_t r, int64_t r1, TileAt tile) {
  for (; r + 4 <= r1; r += 4) tile(std::integral_constant<int, 4>{}, r);
  switch (r1 - r) {
    case 3: return tile(std::integral_constant<int, 3>{}, r);
    case 2: return tile(std::integral_constant<int, 2>{}, r);
    case 1: return tile(std::integral_constant<int, 1>{}, r);
  }
}

// out[r] = x[r] W^T over groups [g0, g1) of w, for the M quantized rows x[r] (K values each;
// out[r] the row's N outputs): tiles of up to 4 rows and 2 groups (``Tiles``); rows in chunks
// of 64 so that a chunk's x bytes stay in cache across the groups; one row by the GEMV.
inline void GemmQ4_0x8(const uint8_t* w, const uint8_t* const* x, float* const* out, int64_t M,
                       int64_t K, int64_t g0, int64_t g1) {
  constexpr int64_t kChunk = 64;
  if (M == 1) return GemvQ4_0x8(w, x[0], K, g0, g1, out[0]);
  for (int64_t c = 0; c < M; c += kChunk) {
    const int64_t c1 = std::min(M, c + kChunk);
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2)
      Tiles(c, c1, [&](auto rows, int64_t r) { Tile<rows.value, 2>(w, x + r, K, g, out + r); });
    if (g < g1)
      Tiles(c, c1, [&](auto rows, int64_t r) { Tile<rows.value, 1>(w, x + r, K, g, out + r); });
  }
}

// R rows of x (quantized rows) times rows [n, n + C) of a Q8_0 matrix w in the file's layout
// (rows of K / 32 blocks of 34 bytes: a float16 scale, 32 signed bytes), into out[i][n + j]:
// two blocks a step, each w row's pair read unsigned (w + 128) against x's 64 bytes in one
// dpbusd, lanes 0-7 the first block's and 8-15 the second's, the 128 sum(x) of each off in
// its first lane, scaled by d_w d_x; an odd last block with the upper half zero.
template <int R, int C>
inline void TileQ8_0(const uint8_t* w, const uint8_t* const* x, int64_t K, int64_t n,
                     float* const* out) {
  constexpr int64_t kBlock = 34;
  const int64_t blocks = K / 32, row_bytes = blocks * kBlock;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  auto step = [&](int64_t b, bool pair) {
    __m512i wq[C];
    __m512 dw[C];
    for (int j = 0; j < C; ++j) {
      const uint8_t* at = w + (n + j) * row_bytes + b * kBlock;
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 2));
      const __m256i hi = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                    at + kBlock + 2)) : _mm256_setzero_si256();
      wq[j] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
      const float d1 = pair ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(at + kBlock)) : 0.f;
      dw[j] = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(at))),
                                 _mm256_set1_ps(d1), 1);
    }
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = x[i];
      const float* xd = reinterpret_cast<const float*>(row + K);
      const int32_t* sum8 = reinterpret_cast<const int32_t*>(row + K + K / 8);
      const __m512i xq = pair ? _mm512_loadu_si512(row + 32 * b)
                              : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + 32 * b);
      const __m512i corr = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, pair ? -16 * sum8[b + 1] : 0,
                                            0, 0, 0, 0, 0, 0, 0, -16 * sum8[b]);
      const __m512 dx = _mm512_insertf32x8(_mm512_set1_ps(xd[b]),
                                           _mm256_set1_ps(pair ? xd[b + 1] : 0.f), 1);
      for (int j = 0; j < C; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, wq[j], xq)),
                                    _mm512_mul_ps(dw[j], dx), acc[i][j]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) step(b, true);
  if (b < blocks) step(b, false);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) out[i][n + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// out[r][n] = x[r] W^T for rows [n0, n1) of a Q8_0 matrix w in the file's layout and the M
// quantized rows x[r]: tiles of up to 4 x rows and 4 w rows (TileQ8_0), x's rows in chunks of
// 64 so that a chunk's bytes stay in cache across w's rows.
inline void GemmQ8_0(const uint8_t* w, const uint8_t* const* x, float* const* out, int64_t M,
                     int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kChunk = 64;
  for (int64_t c = 0; c < M; c += kChunk) {
    const int64_t c1 = std::min(M, c + kChunk);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4)
      Tiles(c, c1, [&](auto rows, int64_t r) { TileQ8_0<rows.value, 4>(w, x + r, K, n, out + r); });
    for (; n < n1; ++n)
      Tiles(c, c1, [&](auto rows, int64_t r) { TileQ8_0<rows.value, 1>(w, x + r, K, n, out + r); });
  }
}

#endif

}  // namespace hx_ggml
