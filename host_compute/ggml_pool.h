// What hx's ggml handlers share (ggml_mm.cc, ggml_layer.cc; built into one library): one thread
// pool per size, whose threads poll a while for the next graph before they sleep, one turn at a
// time, ggml's CPU layouts of repacked matrices, and the product of a centred matrix.
//
// Within a decode step the next graph comes tens of microseconds after the last, and a woken
// thread costs more than that. SmolLM2 Q4_1 all-host decode, 2 threads, 2-core VM (hx.generate,
// median of 3, one product a call): poll 0 with one thread for small products 41.5 tokens/s,
// poll 0 two threads 40.2; two threads polling at level 2 51.3, 10 54.9, 50 54.8-55.7, 100 55.8.
// A level polls 128 Ki pause rounds (ggml-cpu.c), so level 10 spins about a millisecond or two
// after a graph, then sleeps: the lowest level that gains all, to leave the cores to XLA and
// other processes between steps.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "avx512_products.h"

namespace hx_ggml {

constexpr uint32_t kPoll = 10;  // ggml's polling level, 0 (none) to 100

// XLA:CPU runs independent custom calls at once (a layer's Q, K and V products), and a ggml
// pool runs one graph at a time: graphs take turns (each already uses every core).
inline std::mutex& Turn() {
  static std::mutex turn;
  return turn;
}

inline ggml_threadpool* Pool(int threads) {
  static std::map<int, ggml_threadpool*> pools;
  auto& pool = pools[threads];
  if (pool == nullptr) {
    ggml_threadpool_params params = ggml_threadpool_params_default(threads);
    params.poll = kPoll;
    pool = ggml_threadpool_new(&params);
  }
  return pool;
}

// Runs `graph` on the pool of `threads` (the caller holds Turn()); a work buffer kept per
// calling thread. False where ggml fails.
inline bool Compute(ggml_cgraph* graph, int threads) {
  thread_local std::vector<uint8_t> work;
  ggml_cplan plan = ggml_graph_plan(graph, threads, Pool(threads));
  if (work.size() < plan.work_size) work.resize(plan.work_size);
  plan.work_data = work.data();
  return ggml_graph_compute(graph, &plan) == GGML_STATUS_SUCCESS;
}

// A matrix's type with this bit: its rows are held in ggml's repacked CPU layout (Repack).
constexpr int64_t kRepacked = int64_t(1) << 16;

// ggml's CPU_REPACK buffer type: its matrices are held interleaved for the CPU's kernels
// (Q4_0 on AVX2: 8 rows' blocks at a time, llama.cpp's default), multiplied by their own
// kernels; null where ggml was built without it.
inline ggml_backend_buffer_type_t RepackType() {
  static ggml_backend_buffer_type_t found = [] {
    // ggml logs every repacked matrix at its default level: keep its warnings and errors
    ggml_log_set(
        [](ggml_log_level level, const char* text, void*) {
          if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
        },
        nullptr);
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    auto extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
        reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t buft = nullptr;
    for (auto* b = extra ? extra(ggml_backend_reg_dev_get(reg, 0)) : nullptr; b && *b; ++b)
      if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) buft = *b;
    return buft;
  }();
  return found;
}

// A (cols, rows) tensor of `type` in a new CPU_REPACK buffer: its `extra` names the repacked
// layout ggml chose for it (null: none for this type and shape on this CPU). Free `*buffer`.
inline ggml_tensor* InRepackBuffer(ggml_context* ctx, ggml_type type, int64_t cols, int64_t rows,
                                   ggml_backend_buffer_t* buffer) {
  *buffer = nullptr;
  if (RepackType() == nullptr) return nullptr;
  ggml_tensor* t = ggml_new_tensor_2d(ctx, type, cols, rows);
  *buffer = ggml_backend_buft_alloc_buffer(RepackType(), ggml_nbytes(t) + 64);
  if (*buffer == nullptr) return nullptr;
  if (ggml_backend_tensor_alloc(*buffer, t, ggml_backend_buffer_get_base(*buffer)) !=
      GGML_STATUS_SUCCESS)
    return nullptr;
  return t;
}

// Marks `t` (data held in the repacked layout, rows a multiple of 8) as ggml's repacked
// matrix: the buffer and layout of a marker tensor of its type, made once. False where ggml
// has no repacked layout for its type.
inline bool MarkRepacked(ggml_tensor* t) {
  static std::mutex made;
  static std::map<int, ggml_tensor*> markers;
  std::lock_guard<std::mutex> hold(made);
  auto& marker = markers[t->type];
  if (marker == nullptr) {
    static ggml_context* ctx = ggml_init({64 * ggml_tensor_overhead(), nullptr, true});
    ggml_backend_buffer_t buffer;
    marker = InRepackBuffer(ctx, t->type, 256, 8, &buffer);
  }
  if (marker == nullptr || marker->extra == nullptr || t->ne[1] % 8 != 0) return false;
  t->buffer = marker->buffer;
  t->extra = marker->extra;
  return true;
}

// A matrix's type with this bit: it holds Q4_1 rows (w = d q + m) as Q4_0 blocks of the same d
// and q (w = d (q - 8)) with each block's centre c = m + 8 d beside them (Product).
constexpr int64_t kCentred = int64_t(1) << 17;

// The sum of the 32 floats at x, as a tree of vector adds (a reduction the compiler keeps in
// order otherwise: 32 dependent scalar adds).
inline float BlockSum(const float* x) {
  float part[16];
  for (int j = 0; j < 16; ++j) part[j] = x[j] + x[j + 16];
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  return part[0];
}

// dst = y (N, M) plus the centres' part of a centred product, as a ggml custom op over every
// thread: each takes a share of the N outputs (whole chunks of 8) and adds sum_b c[b, n] s_rb
// to y[n, r], s_rb the sum of row r of x (K, M) over block b (32 values). Chunk by chunk of
// 128 outputs, block after block: each block's centres are read as one run of 512 bytes (a
// Llama-2-7B matrix's 128 blocks per output, read 8 outputs at a time, touched 128 pages per
// 8 outputs: 5.6 ms at one row where ggml's Q4_1 product takes 2.6).
inline void AddCentres(ggml_tensor* dst, const ggml_tensor* y, const ggml_tensor* x,
                       const ggml_tensor* c, int ith, int nth, void*) {
  constexpr int64_t kLanes = 8, kChunk = 128;
  const int64_t N = y->ne[0], M = y->ne[1], G = x->ne[0] / 32;
  const int64_t share = ((N + nth - 1) / nth + kLanes - 1) / kLanes * kLanes;
  const int64_t n0 = std::min(N, ith * share), n1 = std::min(N, n0 + share);
  if (n0 >= n1) return;
  const float* centres = static_cast<const float*>(c->data);
  thread_local std::vector<float> sums;  // (M, G)
  sums.resize(M * G);
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = reinterpret_cast<const float*>(static_cast<const char*>(x->data) +
                                                     r * x->nb[1]);
    for (int64_t b = 0; b < G; ++b) sums[r * G + b] = BlockSum(xr + 32 * b);
  }
  for (int64_t start = n0; start < n1; start += kChunk) {
    const int64_t width = std::min(kChunk, n1 - start);
    for (int64_t r = 0; r < M; ++r) {
      float acc[kChunk];
      const float* yr = reinterpret_cast<const float*>(static_cast<const char*>(y->data) +
                                                       r * y->nb[1]) + start;
      for (int64_t j = 0; j < width; ++j) acc[j] = yr[j];
      for (int64_t b = 0; b < G; ++b) {
        const float* cb = centres + b * N + start;
        const float s = sums[r * G + b];
        for (int64_t j = 0; j < width; ++j) acc[j] += cb[j] * s;
      }
      float* out = reinterpret_cast<float*>(static_cast<char*>(dst->data) + r * dst->nb[1]);
      std::copy(acc, acc + width, out + start);
    }
  }
}

// Whether hx's Q4_0 kernels (avx512_products.h) multiply w (K, N, [X]): a Q4_0 matrix (or stack
// of them) in ggml's repacked layout (8 rows interleaved on x86), on a CPU with AVX-512 VNNI.
inline bool OwnGemv(const ggml_tensor* w) {
  return HX_AVX512_PRODUCTS && w->type == GGML_TYPE_Q4_0 && w->extra != nullptr && w->ne[1] % 8 == 0;
}

#if HX_AVX512_PRODUCTS
// [g0, g1) of `groups` split evenly over nth threads: thread ith's.
inline std::pair<int64_t, int64_t> Share(int64_t groups, int ith, int nth) {
  const int64_t share = (groups + nth - 1) / nth;
  const int64_t g0 = std::min(groups, ith * share);
  return {g0, std::min(groups, g0 + share)};
}

inline const float* Row(const ggml_tensor* x, int64_t r) {  // row r of x (K, rows, ...)
  return reinterpret_cast<const float*>(static_cast<const char*>(x->data) + r * x->nb[1]);
}

// dst (N) = x (K) W^T of one row by `Kernel` (GemvQ4_0x8: w OwnGemv's, in groups of 8 rows;
// GemvQ8_0: Q8_0 in the file's layout, row by row: `Rows` outputs a unit), as a ggml custom op
// over every thread: each quantizes x itself (no barrier inside the node) and computes its
// share of the N / Rows units.
template <void (*Kernel)(const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, float*),
          int64_t Rows>
inline void OneRow(ggml_tensor* dst, int ith, int nth, void*) {
  const ggml_tensor *w = dst->src[0], *x = dst->src[1];
  thread_local std::vector<uint8_t> row;
  row.resize(RowQ8Bytes(w->ne[0]));
  QuantizeRow(Row(x, 0), w->ne[0], row.data());
  const auto [u0, u1] = Share(w->ne[1] / Rows, ith, nth);
  Kernel(static_cast<const uint8_t*>(w->data), row.data(), w->ne[0], u0, u1,
         static_cast<float*>(dst->data));
}

// dst (RowQ8Bytes(K), rows) i8: the rows of x (K, rows) quantized (QuantizeRow), a share of
// them on each thread.
inline void QuantizeRows(ggml_tensor* dst, int ith, int nth, void*) {
  const ggml_tensor* x = dst->src[0];
  const auto [r0, r1] = Share(x->ne[1], ith, nth);
  for (int64_t r = r0; r < r1; ++r)
    QuantizeRow(Row(x, r), x->ne[0], static_cast<uint8_t*>(dst->data) + r * dst->nb[1]);
}

// dst (N, M) = x W^T, x's M rows quantized (QuantizeRows' xq), w (K, N) OwnGemv's (each thread
// its share of the N / 8 groups over every row) or Q8_0 in the file's layout (of the N rows).
inline void Gemm(ggml_tensor* dst, int ith, int nth, void*) {
  const ggml_tensor *w = dst->src[0], *xq = dst->src[1];
  const int64_t M = xq->ne[1];
  thread_local std::vector<const uint8_t*> rows;
  thread_local std::vector<float*> outs;
  rows.resize(M);
  outs.resize(M);
  for (int64_t r = 0; r < M; ++r) {
    rows[r] = static_cast<const uint8_t*>(xq->data) + r * xq->nb[1];
    outs[r] = reinterpret_cast<float*>(static_cast<char*>(dst->data) + r * dst->nb[1]);
  }
  const uint8_t* data = static_cast<const uint8_t*>(w->data);
  if (w->type == GGML_TYPE_Q8_0) {
    const auto [n0, n1] = Share(w->ne[1], ith, nth);
    return GemmQ8_0(data, rows.data(), outs.data(), M, w->ne[0], n0, n1);
  }
  const auto [g0, g1] = Share(w->ne[1] / 8, ith, nth);
  GemmQ4_0x8(data, rows.data(), outs.data(), M, w->ne[0], g0, g1);
}

// dst (M, k, N) = for each row n and slot j, x's row (j, n) (x (K, 1 or k, N): one row for
// every slot, or one a slot) times expert ids[j, n]'s matrix of w (K, M, X) OwnGemv's:
// ggml_mul_mat_id. xq: x's rows quantized (QuantizeRows over x as (K, rows N)). Each thread
// gathers every expert's (slot, row) pairs and computes its share of the work, each expert's
// groups of 8 outputs over its rows, the shares even in rows x groups.
inline void GemmExperts(ggml_tensor* dst, int ith, int nth, void*) {
  const ggml_tensor *w = dst->src[0], *x = dst->src[1], *ids = dst->src[2], *xq = dst->src[3];
  const int64_t K = w->ne[0], groups = w->ne[1] / 8, X = w->ne[2], k = ids->ne[0];
  const int64_t N = ids->ne[1], per = x->ne[1];  // x's rows a token: 1, or k
  thread_local std::vector<std::vector<std::pair<int64_t, int64_t>>> pairs;  // e -> (j, n)
  pairs.assign(X, {});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = *reinterpret_cast<const int32_t*>(static_cast<const char*>(ids->data) +
                                                          j * ids->nb[0] + n * ids->nb[1]);
      pairs[e].push_back({j, n});
    }
  int64_t total = 0;
  for (const auto& p : pairs) total += int64_t(p.size()) * groups;
  const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;  // this thread's work
  thread_local std::vector<const uint8_t*> rows;
  thread_local std::vector<float*> outs;
  int64_t start = 0;  // the work before expert e
  for (int64_t e = 0; e < X && start < hi; ++e) {
    const int64_t m = pairs[e].size(), cost = m * groups;
    if (m > 0 && start + cost > lo) {  // groups whose first unit of work is in [lo, hi)
      const int64_t g0 = std::clamp((lo - start + m - 1) / m, int64_t(0), groups);
      const int64_t g1 = std::clamp((hi - start + m - 1) / m, int64_t(0), groups);
      rows.resize(m);
      outs.resize(m);
      for (int64_t i = 0; i < m; ++i) {
        const auto [j, n] = pairs[e][i];
        rows[i] = static_cast<const uint8_t*>(xq->data) +
                  (n * per + (per == 1 ? 0 : j)) * xq->nb[1];
        outs[i] = reinterpret_cast<float*>(static_cast<char*>(dst->data) + j * dst->nb[1] +
                                           n * dst->nb[2]);
      }
      if (g0 < g1)
        GemmQ4_0x8(static_cast<const uint8_t*>(w->data) + e * w->nb[2], rows.data(), outs.data(),
                   m, K, g0, g1);
    }
    start += cost;
  }
}

// x's rows quantized for Gemm (QuantizeRows), x (K, rows[, ...]) float32.
inline ggml_tensor* Quantized(ggml_context* ctx, ggml_tensor* x) {
  ggml_tensor* flat = ggml_is_contiguous(x) ? x : ggml_cont(ctx, x);
  ggml_tensor* args[] = {ggml_reshape_2d(ctx, flat, x->ne[0], ggml_nrows(x))};
  return ggml_custom_4d(ctx, GGML_TYPE_I8, RowQ8Bytes(x->ne[0]), ggml_nrows(x), 1, 1, args, 1,
                        QuantizeRows, GGML_N_TASKS_MAX, nullptr);
}
#endif

// ggml_mul_mat(w, x) (x (K, M) float32), w OwnGemv's or Q8_0 in the file's layout: at one row
// their GEMV (GemvQ4_0x8, GemvQ8_0), else Gemm after QuantizeRows, as custom nodes.
inline ggml_tensor* MulMat(ggml_context* ctx, ggml_tensor* w, ggml_tensor* x) {
#if HX_AVX512_PRODUCTS
  const bool matrix = w->ne[2] == 1 && w->ne[3] == 1 && x->ne[2] == 1 && x->ne[3] == 1;
  const bool q8_0 = w->type == GGML_TYPE_Q8_0 && w->extra == nullptr && ggml_is_contiguous(w);
  if ((OwnGemv(w) || q8_0) && matrix && x->type == GGML_TYPE_F32) {
    if (x->ne[1] == 1 && ggml_is_contiguous(x)) {
      ggml_tensor* args[] = {w, x};
      return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], 1, 1, 1, args, 2,
                            q8_0 ? OneRow<GemvQ8_0, 1> : OneRow<GemvQ4_0x8, 8>,
                            GGML_N_TASKS_MAX, nullptr);
    }
    ggml_tensor* args[] = {w, Quantized(ctx, x)};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, Gemm,
                          GGML_N_TASKS_MAX, nullptr);
  }
#endif
  return ggml_mul_mat(ctx, w, x);
}

// Whether MulMatId runs GemmExperts for w and x.
inline bool OwnExperts(const ggml_tensor* w, const ggml_tensor* x) {
  return OwnGemv(w) && x->type == GGML_TYPE_F32 && x->ne[3] == 1;
}

// ggml_mul_mat_id(w, x, ids) (x (K, 1 or k, N) float32, ids (k, N)), w OwnGemv's:
// GemmExperts after QuantizeRows (`xq`, x's rows quantized, where the caller made them).
inline ggml_tensor* MulMatId(ggml_context* ctx, ggml_tensor* w, ggml_tensor* x,
                             ggml_tensor* ids, ggml_tensor* xq = nullptr) {
#if HX_AVX512_PRODUCTS
  if (OwnExperts(w, x)) {
    ggml_tensor* args[] = {w, x, ids, xq != nullptr ? xq : Quantized(ctx, x)};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], ids->ne[1], 1, args, 4,
                          GemmExperts, GGML_N_TASKS_MAX, nullptr);
  }
#endif
  return ggml_mul_mat_id(ctx, w, x, ids);
}

// x W^T, (N, M) in ggml's order, of w (K, N) and x (K, M) with contiguous rows: ggml_mul_mat,
// plus, where `centres` (N, K / 32 in ggml's order: numpy's (K / 32, N)) f32 is given, the
// centres' part (AddCentres, one node after the product). With w a centred matrix's Q4_0
// blocks (kCentred) this is the Q4_1 product over the same weights exactly; x's block sums in
// float32, where llama.cpp's Q8_1 holds them in float16. One fused node where ggml's own ops
// take four (sum_rows, on one thread; out_prod, on one thread at one row; add): SmolLM2 Q4_1
// all-host decode spent 4 % of its samples in out_prod and waited at their barriers.
inline ggml_tensor* Product(ggml_context* ctx, ggml_tensor* w, ggml_tensor* centres,
                            ggml_tensor* x) {
  ggml_tensor* y = MulMat(ctx, w, x);
  if (centres == nullptr) return y;
  return ggml_map_custom3(ctx, y, x, centres, AddCentres, GGML_N_TASKS_MAX, nullptr);
}

// The routed experts' biases and activation where they are not plain SwiGLU (gpt-oss's): each
// product's per-expert bias, f32 (F, X), (F, X), (D, X), or null; limit > 0: the clamped
// SwiGLU, ggml_swiglu_oai (min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, +-limit) + 1)).
struct ExpertGlu {
  ggml_tensor *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;
  float alpha = 0, limit = 0;
};

// y + the bias of each slot's expert (ggml_add_id), or y where there is none.
inline ggml_tensor* AddBias(ggml_context* ctx, ggml_tensor* y, ggml_tensor* bias,
                            ggml_tensor* ids) {
  return bias == nullptr ? y : ggml_add_id(ctx, y, bias, ids);
}

// An MoE layer's routed experts over x (D, 1, N) (llama.cpp's build_moe_ffn, the routing
// given): each row's k experts' gate and up products by ggml_mul_mat_id (ggml groups the rows
// by expert), SwiGLU (or `glu`'s), the down products, each scaled by its weight (1, k, N),
// summed over the k onto `base` (D, N) where given, else alone: (D, N). gate, up (D, F, X),
// down (F, D, X).
inline ggml_tensor* RoutedExperts(ggml_context* ctx, ggml_tensor* gate, ggml_tensor* up,
                                  ggml_tensor* down, ggml_tensor* x, ggml_tensor* ids,
                                  ggml_tensor* weights, ggml_tensor* base,
                                  const ExpertGlu& glu = {}) {
  ggml_tensor* xq = nullptr;  // gate and up read the same x: quantized once where both are hx's
#if HX_AVX512_PRODUCTS
  if (OwnExperts(gate, x) && OwnExperts(up, x)) xq = Quantized(ctx, x);
#endif
  ggml_tensor* g = AddBias(ctx, MulMatId(ctx, gate, x, ids, xq), glu.gate_bias, ids);
  ggml_tensor* u = AddBias(ctx, MulMatId(ctx, up, x, ids, xq), glu.up_bias, ids);
  ggml_tensor* a = glu.limit > 0 ? ggml_swiglu_oai(ctx, g, u, glu.alpha, glu.limit)
                                 : ggml_swiglu_split(ctx, g, u);  // (F, k, N)
  ggml_tensor* e = ggml_mul(ctx, AddBias(ctx, MulMatId(ctx, down, a, ids), glu.down_bias, ids),
                            weights);  // (D, k, N)
  const int64_t D = e->ne[0], k = e->ne[1], N = e->ne[2];
  ggml_tensor* out = base;
  for (int64_t j = 0; j < k; ++j) {
    ggml_tensor* each = ggml_view_2d(ctx, e, D, N, e->nb[2], j * e->nb[1]);
    out = out == nullptr ? each : ggml_add(ctx, out, each);
  }
  return base == nullptr && k == 1 ? ggml_cont(ctx, out) : out;
}

}  // namespace hx_ggml
