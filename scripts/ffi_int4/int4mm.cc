// Probe: torch's CPU int4 matmul (_weight_int4pack_mm_for_cpu) as an XLA FFI custom call.
// XLA's buffers are wrapped as ATen tensors without copies (at::from_blob). Built by bench.py
// (g++, torch + jaxlib headers) into /tmp; nothing here is part of hx.
//
// Handlers (all on the CPU platform):
//   hx_int4mm_stub(x (M,K) bf16|f32, w (N,K/2) u8 packed, sz (K/g,N,2) same dtype as x)
//       -> y (M,N) same dtype as x; attrs group (i64), threads (i64).  Calls ATen's
//       int4pack_mm_stub, writing straight into XLA's output buffer.
//   hx_int4mm_op: the same through the public op at::_weight_int4pack_mm_for_cpu (allocates
//       its result, which is then copied into XLA's buffer).
//   hx_int8mm(x (M,K) bf16|f32, w (N,K) s8, scales (N,) same dtype as x) -> y (M,N):
//       at::_weight_int8pack_mm (per-output-row int8, no groups) plus a copy; attr threads.
//   hx_noop(x) -> y: copies nothing, returns; the FFI call's own cost.
//   hx_spin(x s32 (1,)) -> t s32 (4,): busy-waits attr us microseconds and records
//       [start_us, end_us (since the library loaded), tid, x[0]], to see whether XLA overlaps
//       independent custom calls (32-bit: JAX's default has no 64-bit integers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// libtorch_cpu exports the stub (symbol at::native::int4pack_mm_stub) but ships no header for it;
// its type is the one ATen/native/cpu/int4mm_kernel.h declares.
namespace at::native {
using int4pack_mm_fn = void (*)(const Tensor&, const Tensor&, const Tensor&, int, const Tensor&);
DECLARE_DISPATCH(int4pack_mm_fn, int4pack_mm_stub)
}  // namespace at::native

namespace {

bool scalar_type(ffi::DataType t, at::ScalarType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = at::kBFloat16; return true;
    case ffi::DataType::F32: *out = at::kFloat; return true;
    case ffi::DataType::F16: *out = at::kHalf; return true;
    default: return false;
  }
}

at::Tensor wrap(const ffi::AnyBuffer& b, at::ScalarType t) {
  auto d = b.dimensions();
  return at::from_blob(b.untyped_data(), at::IntArrayRef(d.begin(), d.size()),
                       at::TensorOptions().dtype(t));
}

template <bool kStub>
ffi::Error Int4mm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer sz,
                  ffi::Result<ffi::AnyBuffer> y, int64_t group, int64_t threads) {
  at::ScalarType t;
  if (!scalar_type(x.element_type(), &t) || sz.element_type() != x.element_type() ||
      y->element_type() != x.element_type() || w.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("int4mm: x, sz, y of one float type; w uint8");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != wd[0] || wd[1] * 2 != xd[1])
    return ffi::Error::InvalidArgument("int4mm: shapes x (M,K), w (N,K/2), y (M,N)");
  if (threads > 0 && at::get_num_threads() != threads) at::set_num_threads(int(threads));
  try {
    at::Tensor A = wrap(x, t), B = wrap(w, at::kByte), S = wrap(sz, t);
    if constexpr (kStub) {
      at::Tensor C = wrap(*y, t);
      at::native::int4pack_mm_stub(at::kCPU, C, A, B, int(group), S);
    } else {
      at::Tensor C = at::_weight_int4pack_mm_for_cpu(A, B, group, S);
      std::memcpy(y->untyped_data(), C.data_ptr(), y->size_bytes());
    }
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("int4mm: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Int8mm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s,
                  ffi::Result<ffi::AnyBuffer> y, int64_t threads) {
  at::ScalarType t;
  if (!scalar_type(x.element_type(), &t) || s.element_type() != x.element_type() ||
      y->element_type() != x.element_type() || w.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("int8mm: x, scales, y of one float type; w int8");
  if (threads > 0 && at::get_num_threads() != threads) at::set_num_threads(int(threads));
  try {
    at::Tensor C = at::_weight_int8pack_mm(wrap(x, t), wrap(w, at::kChar), wrap(s, t));
    if (size_t(C.nbytes()) != y->size_bytes())
      return ffi::Error::InvalidArgument("int8mm: shapes x (M,K), w (N,K), y (M,N)");
    std::memcpy(y->untyped_data(), C.data_ptr(), y->size_bytes());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("int8mm: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Noop(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

const auto kLoaded = std::chrono::steady_clock::now();

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - kLoaded).count();
}

ffi::Error Spin(ffi::Buffer<ffi::S32> x, ffi::ResultBuffer<ffi::S32> t, int64_t us) {
  int64_t t0 = now_ns();
  while (now_ns() - t0 < us * 1000) {
  }
  int32_t* o = t->typed_data();
  o[0] = int32_t(t0 / 1000);
  o[1] = int32_t(now_ns() / 1000);
  o[2] = int32_t(syscall(SYS_gettid));
  o[3] = x.typed_data()[0];
  return ffi::Error::Success();
}

}  // namespace

#define INT4MM_BINDING                                                                        \
  ffi::Ffi::Bind()                                                                            \
      .Arg<ffi::AnyBuffer>()                                                                  \
      .Arg<ffi::AnyBuffer>()                                                                  \
      .Arg<ffi::AnyBuffer>()                                                                  \
      .Ret<ffi::AnyBuffer>()                                                                  \
      .Attr<int64_t>("group")                                                                 \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_int4mm_stub, Int4mm<true>, INT4MM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_int4mm_op, Int4mm<false>, INT4MM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_int8mm, Int8mm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("threads"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_noop, Noop,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(hx_spin, Spin,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("us"));
