// hx_ggml_layer: one Llama-style decoder layer on the host CPU as one ggml graph, as an XLA FFI
// custom call (host_compute/ggml_layer.py builds its arguments and calls it).
//
// The graph llama.cpp builds for a layer (llm_build_llama), over hx's arrays:
//   h = RMSNorm(x) * attn_norm
//   q = RoPE([q_norm](h Wq [+ bq])), k = RoPE([k_norm](h Wk [+ bk])), v = h Wv [+ bv]
//   k, v written into the KV cache at `slots` (ggml_set_rows, in place: XLA aliases the caches)
//   o = softmax(q k^T * scale + mask) v over the first `used` slots (ggml_flash_attn_ext)
//   x1 = x + o Wo;  y = x1 + (SiLU(n Wgate) * (n Wup)) Wdown,  n = RMSNorm(x1) * ffn_norm
// RoPE is the rotate-half layout (GGML_ROPE_TYPE_NEOX: hx holds Q and K rows as Hugging Face
// does) with frequencies freq_base^(-2i/E) / freq_factors[i].
//
// Arguments (B sequences of T new tokens, N = B T; R cache slots of K heads of E):
//   x (N, D) f32; positions (B, T) i32; slots (T,) i32 cache index of each new token (the same
//   for every sequence); mask (B, T, R) f16, 0 where a query sees a slot and -inf elsewhere;
//   used () i32, the slots any query may see (0 .. used - 1); k, v caches (B, R, K, E) f32, f16
//   or bf16 (aliased to the results); then the layer's tensors: attn_norm (D,), wq, wk, wv, wo,
//   ffn_norm (D,), w_gate, w_up, w_down, freq_factors (E/2,) f32, [bq (H E), bk, bv (K E)],
//   [q_norm, k_norm (E,)], norms and biases f32. A matrix is held as its (out, in) rows: uint8
//   blocks of ggml type types[i] (a GGUF's), or f32 rows where types[i] is -1.
// Results: y (N, D) f32, the k and v caches.
// Attributes: types (7: wq wk wv wo w_gate w_up w_down), heads, eps, scale, freq_base,
//   qkv_bias, qk_norm, threads.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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
ggml_tensor* Leaf(ggml_context* ctx, ffi::AnyBuffer b, ggml_type type, int64_t ne0,
                  int64_t ne1, int64_t ne2, int64_t ne3, std::string* error, const char* name) {
  ggml_tensor* t = ggml_new_tensor_4d(ctx, type, ne0, ne1, ne2, ne3);
  if (ggml_nbytes(t) != b.size_bytes()) *error += std::string(" ") + name;
  t->data = b.untyped_data();
  return t;
}

ffi::Error GgmlLayer(ffi::AnyBuffer x, ffi::AnyBuffer positions, ffi::AnyBuffer slots,
                     ffi::AnyBuffer mask, ffi::AnyBuffer used, ffi::AnyBuffer k_in,
                     ffi::AnyBuffer v_in, ffi::RemainingArgs tensors,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> k_out,
                     ffi::Result<ffi::AnyBuffer> v_out, ffi::Span<const int64_t> types,
                     int64_t heads, float eps, float scale, float freq_base, int64_t qkv_bias,
                     int64_t qk_norm, int64_t threads) {
  auto cd = k_in.dimensions(), xd = x.dimensions();
  ggml_type cache_type = CacheType(k_in.element_type());
  size_t wanted = 10 + (qkv_bias ? 3 : 0) + (qk_norm ? 2 : 0);
  if (cd.size() != 4 || xd.size() != 2 || cache_type == GGML_TYPE_COUNT ||
      v_in.element_type() != k_in.element_type() || x.element_type() != ffi::DataType::F32 ||
      mask.element_type() != ffi::DataType::F16 || types.size() != 7 ||
      tensors.size() != wanted || threads < 1 || heads % cd[2] != 0)
    return ffi::Error::InvalidArgument(
        "hx_ggml_layer: x (N, D) f32, caches (B, R, K, E) f32/f16/bf16 alike, mask f16, 7 "
        "types, the layer's tensors as its switches say, heads a multiple of K");
  const int64_t B = cd[0], R = cd[1], K = cd[2], E = cd[3], H = heads, D = xd[1], N = xd[0];
  const int64_t T = N / B;
  const int64_t n_kv = *static_cast<const int32_t*>(used.untyped_data());
  if (N != B * T || n_kv < 1 || n_kv > R)
    return ffi::Error::InvalidArgument("hx_ggml_layer: N = B T rows, 1 <= used <= R");
  auto arg = [&](size_t i) { return tensors.get<ffi::AnyBuffer>(i).value(); };
  const int64_t F = arg(6).size_bytes() / (types[4] < 0 ? 4 * D
                                          : ggml_row_size(ggml_type(types[4]), D));

  std::lock_guard<std::mutex> hold(hx_ggml::Turn());
  // leaves: XLA's buffers, no copies; the rest in an arena sized for this layer's results
  thread_local std::vector<uint8_t> meta(64 * ggml_tensor_overhead());
  thread_local std::vector<uint8_t> arena;
  thread_local std::vector<ggml_fp16_t> mask_used;
  size_t results = 4 * N * (10 * D + 8 * H * E + 12 * K * E + 4 * F);
  size_t need = results + 96 * (ggml_tensor_overhead() + 64) + ggml_graph_overhead();
  if (arena.size() < need) arena.resize(need);
  ggml_context* leaves = ggml_init({meta.size(), meta.data(), /*no_alloc=*/true});
  ggml_context* ctx = ggml_init({arena.size(), arena.data(), /*no_alloc=*/false});

  std::string bad;
  auto matrix = [&](size_t i, int64_t type, int64_t in, int64_t out, const char* name) {
    ggml_type t = type < 0 ? GGML_TYPE_F32 : ggml_type(type);
    if (type >= GGML_TYPE_COUNT || (type >= 0 && arg(i).element_type() != ffi::DataType::U8)) {
      bad += std::string(" ") + name;
      t = GGML_TYPE_F32;
    }
    return Leaf(leaves, arg(i), t, in, out, 1, 1, &bad, name);
  };
  auto vec = [&](size_t i, int64_t n, const char* name) {
    return Leaf(leaves, arg(i), GGML_TYPE_F32, n, 1, 1, 1, &bad, name);
  };
  ggml_tensor* xt = Leaf(leaves, x, GGML_TYPE_F32, D, N, 1, 1, &bad, "x");
  ggml_tensor* pos = Leaf(leaves, positions, GGML_TYPE_I32, N, 1, 1, 1, &bad, "positions");
  ggml_tensor* idx = Leaf(leaves, slots, GGML_TYPE_I32, T, 1, 1, 1, &bad, "slots");
  ggml_tensor* kc = Leaf(leaves, k_in, cache_type, K * E, R, B, 1, &bad, "k cache");
  ggml_tensor* vc = Leaf(leaves, v_in, cache_type, K * E, R, B, 1, &bad, "v cache");
  ggml_tensor* attn_norm = vec(0, D, "attn_norm");
  ggml_tensor* wq = matrix(1, types[0], D, H * E, "wq");
  ggml_tensor* wk = matrix(2, types[1], D, K * E, "wk");
  ggml_tensor* wv = matrix(3, types[2], D, K * E, "wv");
  ggml_tensor* wo = matrix(4, types[3], H * E, D, "wo");
  ggml_tensor* ffn_norm = vec(5, D, "ffn_norm");
  ggml_tensor* w_gate = matrix(6, types[4], D, F, "w_gate");
  ggml_tensor* w_up = matrix(7, types[5], D, F, "w_up");
  ggml_tensor* w_down = matrix(8, types[6], F, D, "w_down");
  ggml_tensor* factors = vec(9, E / 2, "freq_factors");
  size_t next = 10;
  ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr, *qn = nullptr, *kn = nullptr;
  if (qkv_bias) {
    bq = vec(next++, H * E, "bq");
    bk = vec(next++, K * E, "bk");
    bv = vec(next++, K * E, "bv");
  }
  if (qk_norm) {
    qn = vec(next++, E, "q_norm");
    kn = vec(next++, E, "k_norm");
  }
  if (mask.size_bytes() != size_t(2 * B * T * R)) bad += " mask";
  if (y->size_bytes() != x.size_bytes() || k_out->untyped_data() != k_in.untyped_data() ||
      v_out->untyped_data() != v_in.untyped_data())
    bad += " results (y as x; the caches aliased)";
  if (!bad.empty()) {
    ggml_free(ctx);
    ggml_free(leaves);
    return ffi::Error::InvalidArgument("hx_ggml_layer: wrong size or type:" + bad);
  }
  // the mask of the slots read, contiguous as ggml_flash_attn_ext wants it
  const ggml_fp16_t* full = static_cast<const ggml_fp16_t*>(mask.untyped_data());
  ggml_tensor* mt = ggml_new_tensor_4d(leaves, GGML_TYPE_F16, n_kv, T, 1, B);
  if (n_kv == R) {
    mt->data = const_cast<ggml_fp16_t*>(full);
  } else {
    mask_used.resize(B * T * n_kv);
    for (int64_t r = 0; r < B * T; ++r)
      std::memcpy(&mask_used[r * n_kv], full + r * R, n_kv * sizeof(ggml_fp16_t));
    mt->data = mask_used.data();
  }

  auto heads_of = [&](ggml_tensor* w, ggml_tensor* b, ggml_tensor* norm, ggml_tensor* h,
                      int64_t n) {
    ggml_tensor* t = ggml_mul_mat(ctx, w, h);
    if (b) t = ggml_add(ctx, t, b);
    t = ggml_reshape_3d(ctx, t, E, n, N);
    if (norm) t = ggml_mul(ctx, ggml_rms_norm(ctx, t, eps), norm);
    return t;
  };
  auto rope = [&](ggml_tensor* t) {
    return ggml_rope_ext(ctx, t, pos, factors, int(E), GGML_ROPE_TYPE_NEOX, 0, freq_base, 1.0f,
                         0.0f, 1.0f, 0.0f, 0.0f);
  };
  ggml_tensor* h = ggml_mul(ctx, ggml_rms_norm(ctx, xt, eps), attn_norm);
  ggml_tensor* q = rope(heads_of(wq, bq, qn, h, H));
  ggml_tensor* k = rope(heads_of(wk, bk, kn, h, K));
  ggml_tensor* v = heads_of(wv, bv, nullptr, h, K);
  ggml_tensor* kw = ggml_set_rows(ctx, kc, ggml_reshape_3d(ctx, k, K * E, T, B), idx);
  ggml_tensor* vw = ggml_set_rows(ctx, vc, ggml_reshape_3d(ctx, v, K * E, T, B), idx);
  const size_t ts = ggml_type_size(cache_type);
  auto slots_read = [&](ggml_tensor* c) {  // (E, used, K, B) of the cache just written
    return ggml_view_4d(ctx, c, E, n_kv, K, B, K * E * ts, E * ts, R * K * E * ts, 0);
  };
  ggml_tensor* qp = ggml_permute(ctx, ggml_reshape_4d(ctx, q, E, H, T, B), 0, 2, 1, 3);
  ggml_tensor* o = ggml_flash_attn_ext(ctx, qp, slots_read(kw), slots_read(vw), mt, scale,
                                       0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
  ggml_tensor* x1 = ggml_add(ctx, xt, ggml_mul_mat(ctx, wo, ggml_reshape_2d(ctx, o, H * E, N)));
  ggml_tensor* n = ggml_mul(ctx, ggml_rms_norm(ctx, x1, eps), ffn_norm);
  ggml_tensor* a = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, w_gate, n),
                                     ggml_mul_mat(ctx, w_up, n));
  ggml_tensor* out = ggml_add(ctx, x1, ggml_mul_mat(ctx, w_down, a));
  out->data = y->untyped_data();

  ggml_cgraph* graph = ggml_new_graph_custom(ctx, 96, false);
  ggml_build_forward_expand(graph, out);
  bool done = hx_ggml::Compute(graph, int(threads));
  ggml_free(ctx);
  ggml_free(leaves);
  if (!done)
    return ffi::Error(ffi::ErrorCode::kInternal, "hx_ggml_layer: ggml_graph_compute failed");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_ggml_layer, GgmlLayer,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("types")
                                  .Attr<int64_t>("heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<float>("freq_base")
                                  .Attr<int64_t>("qkv_bias")
                                  .Attr<int64_t>("qk_norm")
                                  .Attr<int64_t>("threads"));
