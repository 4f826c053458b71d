// What hx's ggml handlers share (ggml_mm.cc, ggml_layer.cc; built into one library): one thread
// pool per size, whose threads poll a while for the next graph before they sleep, one turn at a
// time, and ggml's CPU layouts of repacked matrices.
//
// Within a decode step the next graph comes tens of microseconds after the last, and a woken
// thread costs more than that. SmolLM2 Q4_1 all-host decode, 2 threads, 2-core VM (hx.generate,
// median of 3, one product a call): poll 0 with one thread for small products 41.5 tokens/s,
// poll 0 two threads 40.2; two threads polling at level 2 51.3, 10 54.9, 50 54.8-55.7, 100 55.8.
// A level polls 128 Ki pause rounds (ggml-cpu.c), so level 10 spins about a millisecond or two
// after a graph, then sleeps: the lowest level that gains all, to leave the cores to XLA and
// other processes between steps.
#pragma once

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

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

}  // namespace hx_ggml
