// hx_ggml_mm: y = x W^T on the host CPU with ggml's matrix product (the kernels llama.cpp runs),
// as an XLA FFI custom call (host_compute/ggml_kernel.py builds, registers and calls it).
//
//   x  (M, K)            float32 activations (ggml quantizes them to its dot type, as llama.cpp)
//   w  (N, row_bytes)    uint8: N rows of K weights in ggml type `type` as a GGUF file stores
//                        them (row_bytes = ggml_row_size(type, K): Q4_1, 20 bytes a block of 32)
//   [c (K / 32, N)]      float32, only with hx_ggml::kCentred: w holds Q4_1 rows as Q4_0 blocks
//                        (the same scales and codes) and c each block's centre m + 8 d, so
//                        y = x W_q4_0^T + (x's block sums) c (hx_ggml::Product)
//   -> y (M, N)          float32; attributes: type (ggml_type, with hx_ggml::kRepacked: w is in
//                        ggml's repacked CPU layout; with hx_ggml::kCentred: c follows),
//                        threads (ggml's pool size).
//
// XLA's buffers become ggml tensors' data without copies; each call builds its graph (one
// node, or two with centres) in a reused context and runs it on the shared polling pool
// (ggml_pool.h).
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml-alloc.h"
#include "ggml_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error GgmlMm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::RemainingArgs rest,
                  ffi::Result<ffi::AnyBuffer> y, int64_t type, int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32 ||
      w.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("hx_ggml_mm: x and y float32, w uint8");
  const bool repacked = (type & hx_ggml::kRepacked) != 0, centred = (type & hx_ggml::kCentred);
  type &= ~(hx_ggml::kRepacked | hx_ggml::kCentred);
  if (type < 0 || type >= GGML_TYPE_COUNT || threads < 1)
    return ffi::Error::InvalidArgument("hx_ggml_mm: unknown ggml type or no threads");
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] ||
      int64_t(ggml_row_size(ggml_type(type), xd[1])) != wd[1])
    return ffi::Error::InvalidArgument(
        "hx_ggml_mm: shapes x (M, K), w (N, ggml_row_size(type, K)), y (M, N)");
  ffi::AnyBuffer centres = centred && rest.size() == 1 ? rest.get<ffi::AnyBuffer>(0).value() : x;
  if (rest.size() != (centred ? 1u : 0u) ||
      (centred && (type != GGML_TYPE_Q4_0 || centres.element_type() != ffi::DataType::F32 ||
                   centres.size_bytes() != size_t(4 * wd[0] * (xd[1] / 32)))))
    return ffi::Error::InvalidArgument(
        "hx_ggml_mm: a centred matrix is Q4_0 blocks and its centres (K / 32, N) float32");
  std::lock_guard<std::mutex> hold(hx_ggml::Turn());
  thread_local std::vector<uint8_t> meta(16 * ggml_tensor_overhead() + ggml_graph_overhead());
  thread_local ggml_gallocr_t placer = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  ggml_init_params init = {meta.size(), meta.data(), /*no_alloc=*/true};
  ggml_context* ctx = ggml_init(init);
  ggml_tensor* wt = ggml_new_tensor_2d(ctx, ggml_type(type), xd[1], wd[0]);
  ggml_tensor* xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, xd[1], xd[0]);
  ggml_tensor* ct = nullptr;
  wt->data = w.untyped_data();
  xt->data = x.untyped_data();
  if (centred) {
    ct = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, wd[0], xd[1] / 32);
    ct->data = centres.untyped_data();
  }
  if (repacked && !hx_ggml::MarkRepacked(wt)) {
    ggml_free(ctx);
    return ffi::Error::InvalidArgument("hx_ggml_mm: ggml has no repacked layout of this type");
  }
  ggml_tensor* yt = hx_ggml::Product(ctx, wt, ct, xt);  // (ne0 N, ne1 M): y (M, N)
  yt->data = y->untyped_data();
  ggml_cgraph* graph = ggml_new_graph_custom(ctx, 8, false);
  ggml_build_forward_expand(graph, yt);
  bool done = ggml_gallocr_alloc_graph(placer, graph) && hx_ggml::Compute(graph, int(threads));
  ggml_free(ctx);
  if (!done)
    return ffi::Error(ffi::ErrorCode::kInternal, "hx_ggml_mm: ggml_graph_compute failed");
  return ffi::Error::Success();
}

}  // namespace

// The rows of w (rows, ggml_row_size(type, cols)) in ggml's repacked CPU layout, into dst (the
// same size): 1, or 0 where ggml has none for this type and shape on this CPU (dst untouched).
// hx calls it once per matrix at load (host_compute/ggml_kernel.py: repack).
extern "C" int hx_ggml_repack(int64_t type, int64_t rows, int64_t cols, const void* src,
                              void* dst) {
  if (rows % 8 != 0) return 0;  // ggml's layouts interleave 8 rows (it aborts on others)
  ggml_context* ctx = ggml_init({4 * ggml_tensor_overhead(), nullptr, true});
  ggml_backend_buffer_t buffer;
  ggml_tensor* t = hx_ggml::InRepackBuffer(ctx, ggml_type(type), cols, rows, &buffer);
  int done = 0;
  if (t != nullptr && t->extra != nullptr) {
    ggml_backend_tensor_set(t, src, 0, ggml_nbytes(t));
    std::memcpy(dst, t->data, ggml_nbytes(t));
    done = 1;
  }
  if (buffer != nullptr) ggml_backend_buffer_free(buffer);
  ggml_free(ctx);
  return done;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_ggml_mm, GgmlMm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("type")
                                  .Attr<int64_t>("threads"));
