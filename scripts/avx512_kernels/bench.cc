// hx's AVX-512 Q4_0 kernels (host_compute/avx512_products.h) against ggml's repacked ones
// (ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0, exported by the libggml-cpu hx builds) on
// the same random blocks: run.py compiles and runs it. Usage: bench K N ROWS THREADS REPS.
// Prints one line: K N ROWS THREADS, ggml's and hx's median microseconds and the largest
// difference of their outputs over the largest output. Each call reads a cold copy of the
// matrix (copies cycled through 256 MB); x quantized by each side's own quantizer, timed with
// hx's products and ggml's GEMV, not with ggml's GEMM (its 4-row interleaved Q8_0; ROWS a
// multiple of 4 there).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "avx512_products.h"

extern "C" void ggml_cpu_init(void);
extern "C" void ggml_gemv_q4_0_8x8_q8_0(int, float*, size_t, const void*, const void*, int, int);
extern "C" void ggml_gemm_q4_0_8x8_q8_0(int, float*, size_t, const void*, const void*, int, int);
extern "C" void ggml_quantize_mat_q8_0_4x8(const float*, void*, int64_t);
extern "C" void quantize_row_q8_0(const float*, void*, int64_t);

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int K = atoi(argv[1]), N = atoi(argv[2]), M = atoi(argv[3]), T = atoi(argv[4]);
  const int reps = atoi(argv[5]), blocks = K / 32;
  ggml_cpu_init();
  std::mt19937 rng(1);
  const size_t bytes = size_t(N) / 8 * blocks * hx_ggml::kBlockBytes;
  std::vector<uint8_t> w(bytes);
  for (size_t i = 0; i < bytes; i += hx_ggml::kBlockBytes) {
    for (int j = 0; j < 8; ++j) {
      const uint16_t d = _cvtss_sh(1e-4f * (1 + rng() % 100), 0);
      std::memcpy(&w[i + 2 * j], &d, 2);
    }
    for (size_t j = 16; j < hx_ggml::kBlockBytes; ++j) w[i + j] = uint8_t(rng());
  }
  const int copies = int(std::max<size_t>(2, size_t(256e6) / bytes));
  std::vector<std::vector<uint8_t>> cold(copies, w);
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(M) * K), ours(size_t(M) * N), theirs(size_t(M) * N);
  for (auto& v : x) v = normal(rng);
  const int64_t row_bytes = hx_ggml::RowQ8Bytes(K);
  std::vector<uint8_t> xq(size_t(M) * row_bytes), xg(size_t(M + 3) / 4 * blocks * 136 + 34 * blocks);
  std::vector<const uint8_t*> rows(M);
  std::vector<float*> outs(M);
  for (int r = 0; r < M; ++r) rows[r] = xq.data() + size_t(r) * row_bytes, outs[r] = &ours[size_t(r) * N];
  std::vector<double> tg, th;
  for (int rep = 0; rep < reps; ++rep) {
    const uint8_t* wg = cold[rep % copies].data();
    const uint8_t* wh = cold[(rep + copies / 2) % copies].data();
    auto t0 = std::chrono::steady_clock::now();
    // as ggml's repacked mul_mat: groups of 4 rows by the GEMM, the rest one by one (GEMV)
    const int M4 = M - M % 4;
    for (int r = 0; r < M4; r += 4) ggml_quantize_mat_q8_0_4x8(&x[size_t(r) * K], &xg[size_t(r) / 4 * blocks * 136], K);
    for (int r = M4; r < M; ++r)
      quantize_row_q8_0(&x[size_t(r) * K], &xg[size_t(M4) / 4 * blocks * 136 + size_t(r - M4) * 34 * blocks], K);
    auto t1 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num(), share = N / 8 / T * 8;
      const int n0 = t * share, n1 = t == T - 1 ? N : n0 + share;
      const uint8_t* part = wg + size_t(n0) / 8 * blocks * hx_ggml::kBlockBytes;
      if (M4) ggml_gemm_q4_0_8x8_q8_0(K, &theirs[n0], N, part, xg.data(), M4, n1 - n0);
      for (int r = M4; r < M; ++r)
        ggml_gemv_q4_0_8x8_q8_0(K, &theirs[size_t(r) * N + n0], N, part,
                                &xg[size_t(M4) / 4 * blocks * 136 + size_t(r - M4) * 34 * blocks], 1, n1 - n0);
    }
    auto t2 = std::chrono::steady_clock::now();
    for (int r = 0; r < M; ++r) hx_ggml::QuantizeRow(&x[size_t(r) * K], K, xq.data() + size_t(r) * row_bytes);
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num(), groups = N / 8, share = (groups + T - 1) / T;
      const int g0 = std::min(groups, t * share), g1 = std::min(groups, g0 + share);
      hx_ggml::GemmQ4_0x8(wh, rows.data(), outs.data(), M, K, g0, g1);
    }
    auto t3 = std::chrono::steady_clock::now();
    const double quantize = M == 1 ? std::chrono::duration<double, std::micro>(t1 - t0).count() : 0;  // as hx's GEMV
    tg.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count() + quantize);
    th.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
  }
  double diff = 0, largest = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    diff = std::max(diff, double(std::fabs(ours[i] - theirs[i])));
    largest = std::max(largest, double(std::fabs(theirs[i])));
  }
  std::sort(tg.begin(), tg.end());
  std::sort(th.begin(), th.end());
  std::printf("%d %d %d %d %.2f %.2f %.3g\n", K, N, M, T, tg[reps / 2], th[reps / 2], diff / largest);
  return 0;
}
