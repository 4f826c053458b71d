// What hx's ggml handlers share (ggml_mm.cc, ggml_layer.cc; built into one library): one thread
// pool per size, whose threads poll a while for the next graph before they sleep, and one turn
// at a time.
//
// Within a decode step the next graph comes tens of microseconds after the last, and a woken
// thread costs more than that. SmolLM2 Q4_1 all-host decode, 2 threads, 2-core VM (hx.generate,
// median of 3, one product a call): poll 0 with one thread for small products 41.5 tokens/s,
// poll 0 two threads 40.2; two threads polling at level 2 51.3, 10 54.9, 50 54.8-55.7, 100 55.8.
// A level polls 128 Ki pause rounds (ggml-cpu.c), so level 10 spins about a millisecond or two
// after a graph, then sleeps: the lowest level that gains all, to leave the cores to XLA and
// other processes between steps.
#pragma once

#include <map>
#include <mutex>
#include <vector>

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

}  // namespace hx_ggml
