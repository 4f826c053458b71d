// hx_int4mm: y = x W^T on the host CPU with torch's int4 kernel, as an XLA FFI custom call
// (host_compute/int4_kernel.py builds, registers and calls it).
//
//   x  (M, K)        bfloat16 activations
//   w  (N, K / 2)    uint8, torch's int4pack layout of the running CPU
//                    (aten::_convert_weight_to_int4pack_for_cpu)
//   sz (K / g, N, 2) bfloat16: per group of g inputs and output row, scale and zero, so that
//                    W[n, k] = (q[n, k] - 8) * scale + zero
//   -> y (M, N)      bfloat16; attributes: group g, threads (torch's intra-op threads; 0 keeps
//                    the thread's setting, which is per thread).
//
// XLA's buffers are wrapped as ATen tensors without copies (at::from_blob); the public op
// at::_weight_int4pack_mm_for_cpu allocates its result, copied into XLA's output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>

#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

at::Tensor wrap(const ffi::AnyBuffer& b, at::ScalarType t) {
  auto d = b.dimensions();
  return at::from_blob(b.untyped_data(), at::IntArrayRef(d.begin(), d.size()),
                       at::TensorOptions().dtype(t));
}

ffi::Error Int4mm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer sz,
                  ffi::Result<ffi::AnyBuffer> y, int64_t group, int64_t threads) {
  if (x.element_type() != ffi::DataType::BF16 || sz.element_type() != ffi::DataType::BF16 ||
      y->element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("hx_int4mm: x, sz and y bfloat16, w uint8");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != wd[0] || wd[1] * 2 != xd[1])
    return ffi::Error::InvalidArgument("hx_int4mm: shapes x (M, K), w (N, K/2), y (M, N)");
  if (threads > 0 && at::get_num_threads() != threads) at::set_num_threads(int(threads));
  try {
    at::Tensor c = at::_weight_int4pack_mm_for_cpu(wrap(x, at::kBFloat16), wrap(w, at::kByte),
                                                   group, wrap(sz, at::kBFloat16));
    std::memcpy(y->untyped_data(), c.data_ptr(), y->size_bytes());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("hx_int4mm: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_int4mm, Int4mm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("threads"));
