// One row of x times a Q4_0 matrix held in ggml's repacked CPU layout (block_q4_0x8: 8 output
// rows' blocks interleaved), with AVX-512 VNNI: the product ggml_pool.h's Product and
// RoutedExperts use at one row (a decode step's) in place of ggml's own kernel.
//
// ggml's repacked GEMV (ggml_gemv_q4_0_8x8_q8_0, llama.cpp's decode kernel on x86) is written
// for AVX2: each of its VNNI dot products multiplies signed bytes by signed bytes through two
// sign instructions, after a table lookup that widens each signed nibble. Here the nibbles are
// read unsigned (q in 0..15; ggml stores them as q ^ 8), so each 64 bytes of weights take one
// dpbusd against x's bytes broadcast across the 8 rows, and the -8 of every q comes off once a
// block as 8 sum(x's block) (Q4_0: w = d (q - 8)). x is quantized to Q8_0 as ggml quantizes it
// (d = max |x| / 127 in float16, q = x / d rounded to nearest even), so the integer sums are
// ggml's exactly; the float sums run in another order. The blocks of the next rows are
// prefetched 2 KiB ahead: one thread reads 20-27 GB/s where ggml's kernel reads 18-21, two
// threads 38-44 against 30-39 (the development VM, cold matrices of 0.2-22 MiB; its memory
// tops out near 44). docs/measurements/log.md, "An AVX-512 GEMV".
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HX_GEMV_Q4_0 1
#else
#define HX_GEMV_Q4_0 0
#endif

namespace hx_ggml {

// x quantized to Q8_0 for the GEMV: per block of 32, its bytes, its scale (the float16 value,
// widened) and 8 times the sum of its bytes.
struct RowQ8 {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum8;
};

#if HX_GEMV_Q4_0

// Quantizes the K floats at x (K a multiple of 32) into `row`.
inline void QuantizeRow(const float* x, int64_t K, RowQ8& row) {
  const int64_t blocks = K / 32;
  row.q.resize(K);
  row.d.resize(blocks);
  row.sum8.resize(blocks);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign),
                                                          _mm512_and_ps(v1, sign)));
    const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q.data() + 32 * b), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q.data() + 32 * b + 16),
                     _mm512_cvtepi32_epi8(q1));
    row.d[b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
    row.sum8[b] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// out[n] for the 8 g rows of each group g in [g0, g1) of w (groups of 8 rows, K / 32 blocks of
// 144 bytes each: 8 float16 scales, then 128 bytes of nibbles, byte 64 k + 8 r + i holding
// row r's element 8 k + i in its low nibble and 8 k + i + 16 in its high one).
inline void GemvQ4_0x8(const uint8_t* w, const RowQ8& x, int64_t K, int64_t g0, int64_t g1,
                       float* out) {
  constexpr int64_t kBlock = 144, kAhead = 2048;
  const int64_t blocks = K / 32;
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x88));
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const uint8_t* end = w + g1 * blocks * kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* rows = w + g * blocks * kBlock;
    __m512 acc = _mm512_setzero_ps();  // lanes 2r, 2r + 1: halves of row r's sum
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = rows + b * kBlock;
      if (block + kAhead < end) {
        _mm_prefetch(reinterpret_cast<const char*>(block + kAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(block + kAhead + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(block + kAhead + 128), _MM_HINT_T0);
      }
      const int8_t* q = x.q.data() + 32 * b;
      const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(block + 16), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(block + 80), flip);
      __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(w0, m4),
                                       _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(q)));
      __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(w1, m4),
                                       _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(q + 8)));
      i0 = _mm512_dpbusd_epi32(i0, _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4),
                               _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(q + 16)));
      i1 = _mm512_dpbusd_epi32(i1, _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4),
                               _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(q + 24)));
      // the -8 of the block's 32 q, once a row (its even lane)
      const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(i0, i1),
                                            _mm512_set1_epi64(int64_t(uint32_t(x.sum8[b]))));
      const __m512 d = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)))));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(x.d[b])),
                            acc);
    }
    const __m512 row = _mm512_add_ps(_mm512_permutex2var_ps(acc, even, acc),
                                     _mm512_permutex2var_ps(acc, odd, acc));
    _mm256_storeu_ps(out + 8 * g, _mm512_castps512_ps256(row));
  }
}

#endif

}  // namespace hx_ggml
