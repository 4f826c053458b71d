// hx_ggml_layers: consecutive Llama-style decoder layers on the host CPU as one ggml graph, as an
// XLA FFI custom call (host_compute/ggml_layer.py builds its arguments and calls it).
//
// The graph llama.cpp builds for a layer (llm_build_llama), over hx's arrays, layer after layer:
//   h = RMSNorm(x) * attn_norm
//   q = RoPE([q_norm](h Wq [+ bq])), k = RoPE([k_norm](h Wk [+ bk])), v = h Wv [+ bv]
//   k, v written into the layer's KV cache at `slots` (ggml_set_rows, in place: XLA aliases
//   the caches)
//   o = softmax(q k^T * scale + mask) v over the first `used` slots (ggml_flash_attn_ext)
//   x1 = x + o Wo;  x' = x1 + (SiLU(n Wgate) * (n Wup)) Wdown,  n = RMSNorm(x1) * ffn_norm
//   or, an MoE layer (experts > 0; llama.cpp's build_moe_ffn): p = softmax(n Wrouter), each
//   row's top_k experts e and their p_e (renormalised where norm_top_k),
//   x' = x1 + sum_e p_e (SiLU(n Wgate_e) * (n Wup_e)) Wdown_e by ggml_mul_mat_id
//   [+ sigmoid(n g) (SiLU(n Wgate_s) * (n Wup_s)) Wdown_s, a shared expert (Qwen2-MoE)]
// RoPE is the rotate-half layout (GGML_ROPE_TYPE_NEOX: hx holds Q and K rows as Hugging Face
// does) with frequencies freq_base^(-2i/E) / freq_factors[i]. One graph for the run: one
// hand-off to the thread pool, as llama.cpp computes a whole model.
//
// Arguments (B sequences of T new tokens, N = B T; R cache slots of K heads of E; the run's
// layers share one spec, so one mask):
//   x (N, D) f32; positions (B, T) i32; slots (T,) i32 cache index of each new token (the same
//   for every sequence); mask (B, T, R) f16, 0 where a query sees a slot and -inf elsewhere;
//   used () i32, the slots any query may see (0 .. used - 1); freq_factors (E/2,) f32; then
//   per layer: its k, v caches (B, R, K, E) f32, f16 or bf16 (aliased to its results),
//   attn_norm (D,), wq, wk, wv, wo, ffn_norm (D,), w_gate, w_up, w_down, [bq (H E), bk, bv
//   (K E)], [q_norm, k_norm (E,)], norms and biases f32, then the centres (in / 32, out) f32 of
//   its centred matrices in that order, then an MoE layer's router (X, D) f32 and, with a
//   shared expert, its w_gate, w_up, w_down (shared_types[3 l + i]) and sigmoid gate (D,) f32;
//   an MoE layer's w_gate, w_up (X F, in) and w_down (X D, F) are its experts' stacked (no
//   MoE matrix centred). A matrix is held as its (out, in) rows: uint8 blocks
//   of ggml type types[7 l + i] (a GGUF's; with hx_ggml::kRepacked in ggml's repacked CPU
//   layout; with hx_ggml::kCentred Q4_1 as Q4_0 blocks and centres, hx_ggml::Product), or f32
//   rows where that is -1.
// Results: y (N, D) f32, then each layer's k and v caches.
// Attributes: types (7 a layer: wq wk wv wo w_gate w_up w_down), heads, eps, scale,
//   freq_base, qkv_bias, qk_norm (1: per head, E; 2: over the whole projection, H E and K E:
//   OLMoE), experts (0: dense), top_k, norm_top_k, shared_types (3 a layer, or none), threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ggml_type CacheType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return GGML_TYPE_F32;
    case ffi::DataType::F16: return GGML_TYPE_F16;
    case ffi::DataType::BF16: return GGML_TYPE_BF16;
    default: return GGML_TYPE_COUNT;
  }
}

// A leaf over an XLA buffer, checked to hold exactly its bytes.
ggml_tensor* Leaf(ggml_context* ctx, void* data, size_t bytes, ggml_type type, int64_t ne0,
                  int64_t ne1, int64_t ne2, std::string* error, const char* name) {
  ggml_tensor* t = ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2);
  if (ggml_nbytes(t) != bytes) *error += std::string(" ") + name;
  t->data = data;
  return t;
}

int64_t Address(const void* p) { return int64_t(reinterpret_cast<uintptr_t>(p)); }

int64_t Bits(float f) {
  int32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// The graph a calling thread built last, with what it was built over (every buffer's address,
// the shapes and attributes); its contexts live in the thread's metadata buffers until the
// next graph is built.
struct Built {
  std::vector<int64_t> key;
  ggml_cgraph* graph = nullptr;
  ggml_context* ctx = nullptr;
  ggml_context* leaves = nullptr;

  void Forget() {
    if (ctx != nullptr) ggml_free(ctx);
    if (leaves != nullptr) ggml_free(leaves);
    *this = Built();
  }
};

// The run's shapes and switches.
struct Shape {
  int64_t B, T, N, R, K, E, H, D, F, n_kv;
  int64_t X, top_k;  // MoE: routed experts (0: a dense FFN) and each row's k of them
  bool shared;       // MoE: a shared expert behind a sigmoid gate (Qwen2-MoE)
  ggml_type cache;
  float eps, scale, freq_base;
  bool qkv_bias, qk_norm, qk_whole, norm_top_k;  // qk_whole: q/k normed over all heads
};

// The index of a layer's first argument past its centres (an MoE router's).
size_t PastCentres(const Shape& s, const int64_t* types) {
  return 11 + (s.qkv_bias ? 3 : 0) + (s.qk_norm ? 2 : 0) +
         std::count_if(types, types + 7,
                       [](int64_t t) { return t >= 0 && (t & hx_ggml::kCentred) != 0; });
}

// Each layer's arguments: 11 tensors, the switches', one per centred matrix, an MoE router,
// a shared expert's three matrices and gate.
size_t LayerArgs(const Shape& s, const int64_t* types) {
  return PastCentres(s, types) + (s.X > 0 ? 1 : 0) + (s.shared ? 4 : 0);
}

// One layer's nodes in `ctx` over its leaves in `leaves`: x (D, N) in, x (D, N) out.
ggml_tensor* Layer(ggml_context* ctx, ggml_context* leaves, const Shape& s, ggml_tensor* x,
                   ggml_tensor* pos, ggml_tensor* idx, ggml_tensor* mask, ggml_tensor* factors,
                   const ffi::RemainingArgs& args, size_t first, const int64_t* types,
                   const int64_t* shared_types, ffi::AnyBuffer k_out, ffi::AnyBuffer v_out,
                   std::string* bad) {
  const int64_t B = s.B, T = s.T, N = s.N, R = s.R, K = s.K, E = s.E, H = s.H, D = s.D;
  auto arg = [&](size_t i) { return args.get<ffi::AnyBuffer>(first + i).value(); };
  size_t centre = 11 + (s.qkv_bias ? 3 : 0) + (s.qk_norm ? 2 : 0);  // the first centres' index
  struct Matrix {
    ggml_tensor* w;
    ggml_tensor* centres;  // null unless centred
  };
  auto matrix = [&](size_t i, int64_t type, int64_t in, int64_t out, const char* name,
                    int64_t stacked = 1) {
    const bool repacked = type >= 0 && (type & hx_ggml::kRepacked) != 0;
    const bool centred = type >= 0 && (type & hx_ggml::kCentred) != 0;
    if (type >= 0) type &= ~(hx_ggml::kRepacked | hx_ggml::kCentred);
    ggml_type t = type < 0 ? GGML_TYPE_F32 : ggml_type(type);
    if (type >= GGML_TYPE_COUNT || (type >= 0 && arg(i).element_type() != ffi::DataType::U8) ||
        (centred && t != GGML_TYPE_Q4_0)) {
      *bad += std::string(" ") + name;
      t = GGML_TYPE_F32;
    }
    ggml_tensor* w = Leaf(leaves, arg(i).untyped_data(), arg(i).size_bytes(), t, in, out,
                          stacked, bad, name);
    if (repacked && !hx_ggml::MarkRepacked(w)) *bad += std::string(" ") + name + " (repacked)";
    ggml_tensor* c = nullptr;
    if (centred) {
      if (arg(centre).element_type() != ffi::DataType::F32) *bad += std::string(" ") + name;
      c = Leaf(leaves, arg(centre).untyped_data(), arg(centre).size_bytes(), GGML_TYPE_F32, out,
               in / 32, 1, bad, name);
      ++centre;
    }
    return Matrix{w, c};
  };
  auto vec = [&](size_t i, int64_t n, const char* name) {
    return Leaf(leaves, arg(i).untyped_data(), arg(i).size_bytes(), GGML_TYPE_F32, n, 1, 1,
                bad, name);
  };
  auto cache = [&](size_t i, ffi::AnyBuffer out, const char* name) {
    if (arg(i).element_type() != arg(0).element_type() ||
        out.untyped_data() != arg(i).untyped_data())
      *bad += std::string(" ") + name + " (its type, or not aliased)";
    return Leaf(leaves, arg(i).untyped_data(), arg(i).size_bytes(), s.cache, K * E, R, B, bad,
                name);
  };
  ggml_tensor* kc = cache(0, k_out, "k cache");
  ggml_tensor* vc = cache(1, v_out, "v cache");
  ggml_tensor* attn_norm = vec(2, D, "attn_norm");
  Matrix wq = matrix(3, types[0], D, H * E, "wq");
  Matrix wk = matrix(4, types[1], D, K * E, "wk");
  Matrix wv = matrix(5, types[2], D, K * E, "wv");
  Matrix wo = matrix(6, types[3], H * E, D, "wo");
  ggml_tensor* ffn_norm = vec(7, D, "ffn_norm");
  const int64_t X = std::max<int64_t>(s.X, 1);  // an MoE layer's experts, stacked
  Matrix w_gate = matrix(8, types[4], D, s.F, "w_gate", X);
  Matrix w_up = matrix(9, types[5], D, s.F, "w_up", X);
  Matrix w_down = matrix(10, types[6], s.F, D, "w_down", X);
  size_t next = 11;
  ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr, *qn = nullptr, *kn = nullptr;
  if (s.qkv_bias) {
    bq = vec(next++, H * E, "bq");
    bk = vec(next++, K * E, "bk");
    bv = vec(next++, K * E, "bv");
  }
  if (s.qk_norm) {
    qn = vec(next++, s.qk_whole ? H * E : E, "q_norm");
    kn = vec(next++, s.qk_whole ? K * E : E, "k_norm");
  }
  ggml_tensor* router = nullptr;  // (D, X) f32: after the centres
  Matrix s_gate{}, s_up{}, s_down{};
  ggml_tensor* s_mix = nullptr;
  if (s.X > 0) {
    const size_t at = PastCentres(s, types);
    router = Leaf(leaves, arg(at).untyped_data(), arg(at).size_bytes(), GGML_TYPE_F32, D, s.X,
                  1, bad, "router");
    if (w_gate.centres || w_up.centres || w_down.centres) *bad += " experts (centred)";
    if (s.shared) {  // its matrices' sizes: the gate's rows of D
      const int64_t t = shared_types[0] & ~hx_ggml::kRepacked;
      const int64_t Fs = t < 0 || t >= GGML_TYPE_COUNT
                             ? arg(at + 1).size_bytes() / (4 * D)
                             : arg(at + 1).size_bytes() / ggml_row_size(ggml_type(t), D);
      s_gate = matrix(at + 1, shared_types[0], D, Fs, "shared_w_gate");
      s_up = matrix(at + 2, shared_types[1], D, Fs, "shared_w_up");
      s_down = matrix(at + 3, shared_types[2], Fs, D, "shared_w_down");
      s_mix = vec(at + 4, D, "shared_expert_gate");
      if (s_gate.centres || s_up.centres || s_down.centres) *bad += " shared expert (centred)";
    }
  }
  if (!bad->empty()) return x;

  auto product = [&](const Matrix& w, ggml_tensor* in) {
    return hx_ggml::Product(ctx, w.w, w.centres, in);
  };
  auto heads_of = [&](const Matrix& w, ggml_tensor* b, ggml_tensor* norm, ggml_tensor* h,
                      int64_t n) {
    ggml_tensor* t = product(w, h);
    if (b) t = ggml_add(ctx, t, b);
    if (norm && s.qk_whole) t = ggml_mul(ctx, ggml_rms_norm(ctx, t, s.eps), norm);
    t = ggml_reshape_3d(ctx, t, E, n, N);
    if (norm && !s.qk_whole) t = ggml_mul(ctx, ggml_rms_norm(ctx, t, s.eps), norm);
    return t;
  };
  auto rope = [&](ggml_tensor* t) {
    return ggml_rope_ext(ctx, t, pos, factors, int(E), GGML_ROPE_TYPE_NEOX, 0, s.freq_base,
                         1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
  };
  ggml_tensor* h = ggml_mul(ctx, ggml_rms_norm(ctx, x, s.eps), attn_norm);
  ggml_tensor* q = rope(heads_of(wq, bq, qn, h, H));
  ggml_tensor* k = rope(heads_of(wk, bk, kn, h, K));
  ggml_tensor* v = heads_of(wv, bv, nullptr, h, K);
  ggml_tensor* kw = ggml_set_rows(ctx, kc, ggml_reshape_3d(ctx, k, K * E, T, B), idx);
  ggml_tensor* vw = ggml_set_rows(ctx, vc, ggml_reshape_3d(ctx, v, K * E, T, B), idx);
  const size_t ts = ggml_type_size(s.cache);
  auto slots_read = [&](ggml_tensor* c) {  // (E, used, K, B) of the cache just written
    return ggml_view_4d(ctx, c, E, s.n_kv, K, B, K * E * ts, E * ts, R * K * E * ts, 0);
  };
  ggml_tensor* qp = ggml_permute(ctx, ggml_reshape_4d(ctx, q, E, H, T, B), 0, 2, 1, 3);
  ggml_tensor* o = ggml_flash_attn_ext(ctx, qp, slots_read(kw), slots_read(vw), mask, s.scale,
                                       0.0f, 0.0f);
  ggml_prec_set_acc(o, GGML_PREC_F32);
  ggml_tensor* x1 = ggml_add(ctx, x, product(wo, ggml_reshape_2d(ctx, o, H * E, N)));
  ggml_tensor* n = ggml_mul(ctx, ggml_rms_norm(ctx, x1, s.eps), ffn_norm);
  if (s.X == 0) {
    ggml_tensor* a = ggml_swiglu_split(ctx, product(w_gate, n), product(w_up, n));
    return ggml_add(ctx, x1, product(w_down, a));
  }
  // MoE (llama.cpp's build_moe_ffn): the router's softmax, each row's top k and their
  // probabilities (renormalised where norm_top_k), its k experts by mul_mat_id, weighted, summed
  ggml_tensor* probs = ggml_soft_max(ctx, ggml_mul_mat(ctx, router, n));  // (X, N)
  ggml_tensor* ids = ggml_top_k(ctx, probs, int(s.top_k));               // (k, N)
  ggml_tensor* w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, s.X, N), ids);
  if (s.norm_top_k) {
    ggml_tensor* w2 = ggml_reshape_2d(ctx, w, s.top_k, N);
    w = ggml_reshape_3d(ctx, ggml_div(ctx, w2, ggml_sum_rows(ctx, w2)), 1, s.top_k, N);
  }
  ggml_tensor* out = hx_ggml::RoutedExperts(ctx, w_gate.w, w_up.w, w_down.w,
                                            ggml_reshape_3d(ctx, n, D, 1, N), ids, w, x1);
  if (s.shared) {  // + sigmoid(n g) (SiLU(n Wgate_s) * (n Wup_s)) Wdown_s, every row
    ggml_tensor* sh = product(s_down, ggml_swiglu_split(ctx, product(s_gate, n),
                                                        product(s_up, n)));
    out = ggml_add(ctx, out, ggml_mul(ctx, sh, ggml_sigmoid(ctx, ggml_mul_mat(ctx, s_mix, n))));
  }
  return out;
}

ffi::Error GgmlLayers(ffi::AnyBuffer x, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                      ffi::AnyBuffer mask, ffi::AnyBuffer used, ffi::AnyBuffer freq_factors,
                      ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> y,
                      ffi::RemainingRets caches, ffi::Span<const int64_t> types, int64_t heads,
                      float eps, float scale, float freq_base, int64_t qkv_bias,
                      int64_t qk_norm, int64_t experts, int64_t top_k, int64_t norm_top_k,
                      ffi::Span<const int64_t> shared_types, int64_t threads) {
  Shape s;
  s.qkv_bias = qkv_bias != 0, s.qk_norm = qk_norm != 0, s.qk_whole = qk_norm == 2;
  s.X = experts, s.top_k = top_k, s.norm_top_k = norm_top_k != 0;
  s.shared = experts > 0 && shared_types.size() > 0;
  // each layer's first argument (LayerArgs)
  const size_t L = types.size() / 7;
  std::vector<size_t> firsts(L + 1, 0);
  for (size_t l = 0; l < L; ++l) firsts[l + 1] = firsts[l] + LayerArgs(s, &types[7 * l]);
  if (experts < 0 || (experts > 0 && (top_k < 1 || top_k > experts)) ||
      (s.shared && shared_types.size() != 3 * L))
    return ffi::Error::InvalidArgument(
        "hx_ggml_layers: 1 <= top_k <= experts; a shared expert's 3 types a layer");
  if (L < 1 || types.size() != 7 * L || args.size() != firsts[L] || caches.size() != 2 * L ||
      threads < 1)
    return ffi::Error::InvalidArgument(
        "hx_ggml_layers: each layer's caches and tensors as its switches and types say, 7 "
        "types a layer, its two caches among the results");
  ffi::AnyBuffer k0 = args.get<ffi::AnyBuffer>(0).value();
  auto cd = k0.dimensions(), xd = x.dimensions();
  s.cache = CacheType(k0.element_type());
  if (cd.size() != 4 || xd.size() != 2 || s.cache == GGML_TYPE_COUNT ||
      x.element_type() != ffi::DataType::F32 || mask.element_type() != ffi::DataType::F16 ||
      heads % cd[2] != 0)
    return ffi::Error::InvalidArgument(
        "hx_ggml_layers: x (N, D) f32, caches (B, R, K, E) f32/f16/bf16, mask f16, heads a "
        "multiple of K");
  s.B = cd[0], s.R = cd[1], s.K = cd[2], s.E = cd[3], s.H = heads, s.D = xd[1], s.N = xd[0];
  s.T = s.N / s.B;
  s.n_kv = *static_cast<const int32_t*>(used.untyped_data());
  s.eps = eps, s.scale = scale, s.freq_base = freq_base;
  ffi::AnyBuffer gate = args.get<ffi::AnyBuffer>(8).value();
  const int64_t gate_type =
      types[4] < 0 ? types[4] : types[4] & ~(hx_ggml::kRepacked | hx_ggml::kCentred);
  if (gate_type >= GGML_TYPE_COUNT)
    return ffi::Error::InvalidArgument("hx_ggml_layers: unknown ggml type");
  s.F = gate.size_bytes() / (gate_type < 0 ? 4 * s.D : ggml_row_size(ggml_type(gate_type), s.D)) /
        std::max<int64_t>(s.X, 1);
  if (s.N != s.B * s.T || s.n_kv < 1 || s.n_kv > s.R)
    return ffi::Error::InvalidArgument("hx_ggml_layers: N = B T rows, 1 <= used <= R");

  std::lock_guard<std::mutex> hold(hx_ggml::Turn());
  // leaves: XLA's buffers, no copies; the results placed by ggml's graph allocator, which
  // reuses a result's memory once its last reader ran (one buffer per calling thread, kept)
  const size_t nodes = (experts > 0 ? 96 + 8 * top_k : 96) * L + 16;
  thread_local std::vector<uint8_t> meta, graph_meta;
  thread_local std::vector<ggml_fp16_t> mask_used;
  thread_local ggml_gallocr_t placer = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  thread_local Built last;
  const int64_t B = s.B, T = s.T, N = s.N, R = s.R, K = s.K, E = s.E, H = s.H, D = s.D;
  if (mask.size_bytes() != size_t(2 * B * T * R))
    return ffi::Error::InvalidArgument("hx_ggml_layers: mask (B, T, R) f16");
  // the mask of the slots read, contiguous as ggml_flash_attn_ext wants it
  const ggml_fp16_t* full = static_cast<const ggml_fp16_t*>(mask.untyped_data());
  const ggml_fp16_t* mask_data = full;
  if (s.n_kv < R) {
    mask_used.resize(B * T * s.n_kv);
    for (int64_t r = 0; r < B * T; ++r)
      std::memcpy(&mask_used[r * s.n_kv], full + r * R, s.n_kv * sizeof(ggml_fp16_t));
    mask_data = mask_used.data();
  }
  // a decode loop calls step after step with the same buffers and, as llama.cpp pads the
  // slots read to 256 (ggml_layer.py), the same shapes: the graph built last is run again
  std::vector<int64_t> key = {B, T, R, K, E, H, D, s.n_kv, threads, qkv_bias, qk_norm,
                              experts, top_k, norm_top_k,
                              Bits(eps), Bits(scale), Bits(freq_base), Address(x.untyped_data()),
                              Address(positions.untyped_data()), Address(slots.untyped_data()),
                              Address(mask_data), Address(freq_factors.untyped_data()),
                              Address(y->untyped_data())};
  key.insert(key.end(), types.begin(), types.end());
  key.insert(key.end(), shared_types.begin(), shared_types.end());
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::AnyBuffer a = args.get<ffi::AnyBuffer>(i).value();
    key.insert(key.end(), {Address(a.untyped_data()), int64_t(a.size_bytes()),
                           int64_t(a.element_type())});
  }
  if (last.graph == nullptr || key != last.key) {
    last.Forget();
    meta.resize(std::max(meta.size(), (32 * L + 16) * ggml_tensor_overhead()));
    graph_meta.resize(std::max(graph_meta.size(), nodes * ggml_tensor_overhead() +
                                                      ggml_graph_overhead_custom(nodes, false)));
    ggml_context* leaves = ggml_init({meta.size(), meta.data(), /*no_alloc=*/true});
    ggml_context* ctx = ggml_init({graph_meta.size(), graph_meta.data(), /*no_alloc=*/true});

    std::string bad;
    ggml_tensor* xt = Leaf(leaves, x.untyped_data(), x.size_bytes(), GGML_TYPE_F32, D, N, 1,
                           &bad, "x");
    ggml_tensor* pos = Leaf(leaves, positions.untyped_data(), positions.size_bytes(),
                            GGML_TYPE_I32, N, 1, 1, &bad, "positions");
    ggml_tensor* idx = Leaf(leaves, slots.untyped_data(), slots.size_bytes(), GGML_TYPE_I32, T,
                            1, 1, &bad, "slots");
    ggml_tensor* factors = Leaf(leaves, freq_factors.untyped_data(), freq_factors.size_bytes(),
                                GGML_TYPE_F32, E / 2, 1, 1, &bad, "freq_factors");
    if (y->size_bytes() != x.size_bytes()) bad += " y (as x)";
    ggml_tensor* mt = ggml_new_tensor_4d(leaves, GGML_TYPE_F16, s.n_kv, T, 1, B);
    mt->data = const_cast<ggml_fp16_t*>(mask_data);
    ggml_tensor* out = xt;
    for (size_t l = 0; l < L && bad.empty(); ++l)
      out = Layer(ctx, leaves, s, out, pos, idx, mt, factors, args, firsts[l],
                  &types[7 * l], s.shared ? &shared_types[3 * l] : nullptr,
                  *caches.get<ffi::AnyBuffer>(2 * l).value(),
                  *caches.get<ffi::AnyBuffer>(2 * l + 1).value(), &bad);
    ggml_cgraph* graph = nullptr;
    if (bad.empty()) {
      out->data = y->untyped_data();
      graph = ggml_new_graph_custom(ctx, nodes, false);
      ggml_build_forward_expand(graph, out);
    }
    if (graph == nullptr || !ggml_gallocr_alloc_graph(placer, graph)) {
      ggml_free(ctx);
      ggml_free(leaves);
      return bad.empty() ? ffi::Error(ffi::ErrorCode::kInternal,
                                      "hx_ggml_layers: ggml_gallocr_alloc_graph failed")
                         : ffi::Error::InvalidArgument(
                               "hx_ggml_layers: wrong size, type or aliasing:" + bad);
    }
    last = {std::move(key), graph, ctx, leaves};
  }
  if (!hx_ggml::Compute(last.graph, int(threads)))
    return ffi::Error(ffi::ErrorCode::kInternal, "hx_ggml_layers: ggml_graph_compute failed");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_ggml_layers, GgmlLayers,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("types")
                                  .Attr<int64_t>("heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<float>("freq_base")
                                  .Attr<int64_t>("qkv_bias")
                                  .Attr<int64_t>("qk_norm")
                                  .Attr<int64_t>("experts")
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("norm_top_k")
                                  .Attr<ffi::Span<const int64_t>>("shared_types")
                                  .Attr<int64_t>("threads"));
