// hx_ggml_moe: a Mixture-of-Experts layer's routed experts on the host CPU as one ggml graph,
// as an XLA FFI custom call (host_compute/ggml_kernel.py: experts). The graph llama.cpp builds
// for them (llm_graph_context::build_moe_ffn, SwiGLU experts, the routing given): each row's
// k experts' gate and up products (ggml_mul_mat_id: ggml groups the rows by expert and
// multiplies each expert's rows with its own matrix, never the others'), SwiGLU, the down
// products, each scaled by its routing weight, summed over the k. A slot weighted 0 (a part of
// a layer's experts, hx.plan.ExpertHomes, gets each row's k largest weights of its own experts,
// fewer than k of them routed to) reads no matrix of its own: it is pointed at an expert its
// row, else the step, reads anyway, so ggml reads only the experts some row is routed to; a
// step that routes no row here writes zeros and computes nothing.
//
//   x        (M, D) f32   the rows' normed input
//   ids      (M, k) i32   each row's experts (0 <= id < X)
//   weights  (M, k) f32   their routing weights
//   gate, up (X F, ggml_row_size(type, D)) u8   the experts' matrices stacked, GGUF blocks
//   down     (X D, ggml_row_size(type, F)) u8   (types[i]: with hx_ggml::kRepacked, in
//                                              ggml's repacked CPU layout)
//   gate_bias, up_bias (X, F), down_bias (X, D) f32, or each empty: none (gpt-oss's biases)
//   -> y     (M, D) f32   sum_j weights[m, j] down_e(SiLU(gate_e x_m) * up_e x_m), e = ids[m, j]
// Attributes: types (gate, up, down), experts X, threads; alpha, limit: limit > 0 runs the
// clamped SwiGLU (hx_ggml::ExpertGlu) in place of SiLU(g) u.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error GgmlMoe(ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                   ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                   ffi::AnyBuffer gate_bias, ffi::AnyBuffer up_bias, ffi::AnyBuffer down_bias,
                   ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> types,
                   int64_t experts, int64_t threads, float alpha, float limit) {
  auto xd = x.dimensions(), id = ids.dimensions();
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32 ||
      ids.element_type() != ffi::DataType::S32 ||
      weights.element_type() != ffi::DataType::F32 || xd.size() != 2 || id.size() != 2 ||
      id[0] != xd[0] || weights.size_bytes() != ids.size_bytes() ||
      y->size_bytes() != x.size_bytes() || types.size() != 3 || experts < 1 || threads < 1)
    return ffi::Error::InvalidArgument(
        "hx_ggml_moe: x (M, D) f32, ids (M, k) i32, weights (M, k) f32, y (M, D) f32, "
        "three types");
  const int64_t M = xd[0], D = xd[1], k = id[1], X = experts;
  ggml_type type[3];
  bool repacked[3];
  for (int i = 0; i < 3; ++i) {
    repacked[i] = (types[i] & hx_ggml::kRepacked) != 0;
    const int64_t t = types[i] & ~hx_ggml::kRepacked;
    if (t < 0 || t >= GGML_TYPE_COUNT)
      return ffi::Error::InvalidArgument("hx_ggml_moe: unknown ggml type");
    type[i] = ggml_type(t);
  }
  const size_t gate_row = ggml_row_size(type[0], D);
  const int64_t F = int64_t(gate.size_bytes() / gate_row) / X;
  if (F < 1 || gate.size_bytes() != size_t(X * F) * gate_row ||
      up.size_bytes() != size_t(X * F) * ggml_row_size(type[1], D) ||
      down.size_bytes() != size_t(X * D) * ggml_row_size(type[2], F))
    return ffi::Error::InvalidArgument(
        "hx_ggml_moe: gate and up (X F, row_size(D)), down (X D, row_size(F))");
  const ffi::AnyBuffer* biases[3] = {&gate_bias, &up_bias, &down_bias};
  const int64_t bias_rows[3] = {F, F, D};
  for (int i = 0; i < 3; ++i)
    if (biases[i]->size_bytes() != 0 &&
        (biases[i]->element_type() != ffi::DataType::F32 ||
         biases[i]->size_bytes() != size_t(X * bias_rows[i]) * sizeof(float)))
      return ffi::Error::InvalidArgument(
          "hx_ggml_moe: biases (X, F), (X, F), (X, D) f32, or empty");

  // the routed slots' experts; each slot weighted 0 pointed at one ggml reads anyway
  thread_local std::vector<int32_t> routed;
  const int32_t* given = static_cast<const int32_t*>(ids.untyped_data());
  const float* weight = static_cast<const float*>(weights.untyped_data());
  routed.assign(given, given + M * k);
  int32_t read = -1;  // an expert some row of the step is routed to
  for (int64_t i = 0; i < M * k && read < 0; ++i)
    if (weight[i] != 0.0f) read = routed[i];
  if (read < 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  for (int64_t m = 0; m < M; ++m) {
    int32_t own = read;  // the row's first routed expert, else the step's
    for (int64_t j = 0; j < k; ++j)
      if (weight[m * k + j] != 0.0f) {
        own = routed[m * k + j];
        break;
      }
    for (int64_t j = 0; j < k; ++j)
      if (weight[m * k + j] == 0.0f) routed[m * k + j] = own;
  }

  std::lock_guard<std::mutex> hold(hx_ggml::Turn());
  thread_local std::vector<uint8_t> meta(64 * ggml_tensor_overhead() +
                                         ggml_graph_overhead_custom(64, false));
  thread_local ggml_gallocr_t placer = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  ggml_context* ctx = ggml_init({meta.size(), meta.data(), /*no_alloc=*/true});
  auto leaf = [&](void* data, ggml_type t, int64_t ne0, int64_t ne1, int64_t ne2) {
    ggml_tensor* l = ggml_new_tensor_3d(ctx, t, ne0, ne1, ne2);
    l->data = data;
    return l;
  };
  ggml_tensor* xt = leaf(x.untyped_data(), GGML_TYPE_F32, D, 1, M);
  ggml_tensor* it = leaf(routed.data(), GGML_TYPE_I32, k, M, 1);
  ggml_tensor* wt = leaf(weights.untyped_data(), GGML_TYPE_F32, 1, k, M);
  ggml_tensor* gt = leaf(gate.untyped_data(), type[0], D, F, X);
  ggml_tensor* ut = leaf(up.untyped_data(), type[1], D, F, X);
  ggml_tensor* dt = leaf(down.untyped_data(), type[2], F, D, X);
  ggml_tensor* mats[3] = {gt, ut, dt};
  for (int i = 0; i < 3; ++i)
    if (repacked[i] && !hx_ggml::MarkRepacked(mats[i])) {
      ggml_free(ctx);
      return ffi::Error::InvalidArgument("hx_ggml_moe: ggml has no repacked layout of a type");
    }
  hx_ggml::ExpertGlu glu{nullptr, nullptr, nullptr, alpha, limit};
  ggml_tensor** bias_of[3] = {&glu.gate_bias, &glu.up_bias, &glu.down_bias};
  for (int i = 0; i < 3; ++i)
    if (biases[i]->size_bytes() != 0)
      *bias_of[i] = leaf(biases[i]->untyped_data(), GGML_TYPE_F32, bias_rows[i], X, 1);
  ggml_tensor* out = hx_ggml::RoutedExperts(ctx, gt, ut, dt, xt, it, wt, nullptr, glu);  // (D, M)
  out->data = y->untyped_data();
  ggml_cgraph* graph = ggml_new_graph_custom(ctx, 64, false);
  ggml_build_forward_expand(graph, out);
  bool done = ggml_gallocr_alloc_graph(placer, graph) && hx_ggml::Compute(graph, int(threads));
  ggml_free(ctx);
  if (!done) return ffi::Error(ffi::ErrorCode::kInternal, "hx_ggml_moe: ggml failed");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_ggml_moe, GgmlMoe,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("types")
                                  .Attr<int64_t>("experts")
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
