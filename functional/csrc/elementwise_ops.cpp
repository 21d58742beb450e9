// Fused CPU kernels of the elementwise optimizers torch has no fused kernel for (Adadelta,
// Adamax, RMSprop, Rprop, NAdam, RAdam, ASGD) and of Adafactor's update: one pass over each
// parameter, its gradient and its state instead of one pass per foreach op (functional/*.py
// call them where functional/_native.py built this file; registered with TORCH_LIBRARY, so
// the TorchScript step calls them without the GIL).
//
// Each kernel computes what torch.optim computes, op for op, with the arithmetic of torch's
// own kernel for each op (its foreach path; its per-tensor loop for ASGD and Adafactor), so
// that the two agree to the bit where they can. What that takes (each point measured on torch
// 2.13, CPU):
//
// - Every op computes in the "opmath" type (float for float16 / bfloat16 / float32, double for
//   float64) and rounds its result to the parameter's dtype. The kernels keep the values in
//   opmath and round where torch stores a tensor (``Ctx::r``): a no-op for float32 and
//   float64, the same rounding as torch's for float16 and bfloat16.
// - A Python scalar reaches an op as torch converts it: to the parameter's dtype first for
//   add, in-place foreach mul, masked_fill and clamp (``Ctx::in_dtype``); to opmath for
//   Tensor.mul_, out-of-place foreach mul, div, addcmul, addcdiv and lerp.
// - torch's AVX2 kernels fuse a multiply and an add (add with alpha, addcmul, lerp: by
//   intrinsics or by the compiler's contraction, in their scalar tails too); the kernels use
//   one fused multiply-add there as well (``madd``) and are built with -ffp-contract=off, so
//   that nothing else is fused. On an AVX512 machine torch runs the AVX2 build of these
//   kernels, so this file is built for AVX2 there (functional/_native.py).
// - torch's float16 / bfloat16 add with alpha rounds ``alpha * other`` before adding in its
//   scalar tail (the elements after the last whole pair of vectors of a thread's range); the
//   kernels walk each range as torch does (``for_each``) and round the same elements so.
// - torch's float32 / float64 sqrt runs MKL's vector math where torch has MKL, and its results
//   are not always correctly rounded (1 in 6 float32 roots, 1 in 80 float64 ones, 1 ulp off).
//   The kernels call the same MKL functions on blocks of values in cache (``for_each_rooted``).
//
// What does not match: Adafactor's norms and means are reductions in another order.
// benchmarks/kernel_ulps.py measures it: a few units in the last place.
//
// Any memory layout: operands laid out element for element like the parameter (dense, the
// same strides) are stepped where they are; otherwise the kernel steps contiguous copies and
// writes the parameter and state back (``Staged``).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/SmallVector.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// torch's vectorised kernels of this capability fuse a multiply and an add.
constexpr bool kFusedMultiplyAdd = true;
#else
constexpr bool kFusedMultiplyAdd = false;
#endif

// ---------------------------------------------------------------------------------------
// Arithmetic, on a scalar (opmath_t) or a vector (Vectorized<opmath_t>) alike.

template <typename T>
inline T madd(T a, T b, T c) {
  if constexpr (kFusedMultiplyAdd) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;
  }
}
template <typename T>
inline Vectorized<T> madd(const Vectorized<T>& a, const Vectorized<T>& b, const Vectorized<T>& c) {
  return at::vec::fmadd(a, b, c);
}

template <typename T>
inline T vsqrt(T x) { return std::sqrt(x); }
template <typename T>
inline Vectorized<T> vsqrt(const Vectorized<T>& x) { return x.sqrt(); }

template <typename T>
inline T vabs(T x) { return std::abs(x); }
template <typename T>
inline Vectorized<T> vabs(const Vectorized<T>& x) { return x.abs(); }

template <typename T>
inline T vneg(T x) { return -x; }
template <typename T>
inline Vectorized<T> vneg(const Vectorized<T>& x) { return x.neg(); }

// torch.maximum: NaN if either is NaN.
template <typename T>
inline T vmax(T a, T b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::numeric_limits<T>::quiet_NaN();
  }
  return std::max(a, b);
}
template <typename T>
inline Vectorized<T> vmax(const Vectorized<T>& a, const Vectorized<T>& b) {
  return at::vec::maximum(a, b);
}

// torch.clamp with bounds lo <= hi: NaN stays NaN.
template <typename T>
inline T vclamp(T x, T lo, T hi) {
  if (std::isnan(x)) {
    return x;
  }
  return std::min(std::max(x, lo), hi);
}
template <typename T>
inline Vectorized<T> vclamp(const Vectorized<T>& x, T lo, T hi) {
  return at::vec::clamp(x, Vectorized<T>(lo), Vectorized<T>(hi));
}

// torch.sign of a real number: -1, 0 or 1 (0 for NaN).
template <typename T>
inline T vsign(T x) {
  return static_cast<T>((T(0) < x) - (x < T(0)));
}
template <typename T>
inline Vectorized<T> vsign(const Vectorized<T>& x) {
  const Vectorized<T> zero(0), one(1);
  return Vectorized<T>::blendv(zero, one, zero < x) - Vectorized<T>::blendv(zero, one, x < zero);
}

// ``cond ? a : b`` where ``cond`` is ``x == y``.
template <typename T>
inline T where_eq(T x, T y, T a, T b) { return x == y ? a : b; }
template <typename T>
inline Vectorized<T> where_eq(const Vectorized<T>& x, T y, const Vectorized<T>& a, const Vectorized<T>& b) {
  return Vectorized<T>::blendv(b, a, x == Vectorized<T>(y));
}

// Rprop's factor: etaplus where x > 0, etaminus where x < 0, 1 where x == 0 (x a sign).
template <typename T>
inline T sign_factor(T x, T etaminus, T etaplus) {
  return x > T(0) ? etaplus : (x < T(0) ? etaminus : T(1));
}
template <typename T>
inline Vectorized<T> sign_factor(const Vectorized<T>& x, T etaminus, T etaplus) {
  const Vectorized<T> zero(0);
  Vectorized<T> out = Vectorized<T>::blendv(Vectorized<T>(1), Vectorized<T>(etaplus), x > zero);
  return Vectorized<T>::blendv(out, Vectorized<T>(etaminus), x < zero);
}

template <typename T>
inline T splat(T value, T) { return value; }
template <typename T>
inline Vectorized<T> splat(T value, const Vectorized<T>&) { return Vectorized<T>(value); }

// A value (vector or scalar) stored to / loaded from memory of its own type.
template <typename T>
inline void store_at(const Vectorized<T>& x, T* dst) { x.store(dst); }
template <typename T>
inline void store_at(T x, T* dst) { *dst = x; }
template <typename T>
inline void load_at(Vectorized<T>* x, const T* src) { *x = Vectorized<T>::loadu(src); }
template <typename T>
inline void load_at(T* x, const T* src) { *x = *src; }

// The arithmetic of one dtype: rounding to it, and the ops whose rounding depends on it.
template <typename scalar_t>
struct Ctx {
  using opmath_t = at::opmath_type<scalar_t>;
  static constexpr bool reduced = !std::is_same_v<scalar_t, opmath_t>;

  // A value stored as scalar_t and read back.
  static opmath_t r(opmath_t x) {
    if constexpr (reduced) {
      return static_cast<opmath_t>(static_cast<scalar_t>(x));
    } else {
      return x;
    }
  }
  static Vectorized<opmath_t> r(const Vectorized<opmath_t>& x) {
    if constexpr (reduced) {
      return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(x, x)));
    } else {
      return x;
    }
  }
  // A scalar argument that torch converts to the tensor's dtype (add, masked_fill, clamp).
  static opmath_t in_dtype(double x) {
    return static_cast<opmath_t>(static_cast<scalar_t>(x));
  }
  // ``self + alpha * other`` as torch's add computes it (alpha already ``in_dtype``): fused in
  // its vector body (AVX2 / AVX512); in the scalar tail of a reduced dtype, and in the whole of
  // the portable build's, the product is rounded first.
  static opmath_t add(opmath_t self, opmath_t other, opmath_t alpha) {
    if constexpr (reduced) {
      return self + r(alpha * other);
    } else {
      return madd(other, alpha, self);
    }
  }
  static Vectorized<opmath_t> add(const Vectorized<opmath_t>& self, const Vectorized<opmath_t>& other, opmath_t alpha) {
    if constexpr (reduced && !kFusedMultiplyAdd) {
      // The portable build's scalar_t vectors multiply and add in scalar_t, one rounding each.
      return self + r(Vectorized<opmath_t>(alpha) * other);
    } else {
      return madd(other, Vectorized<opmath_t>(alpha), self);
    }
  }
  // ``self + value * t1 * t2`` (addcmul) and ``self + value * t1 / t2`` (addcdiv).
  template <typename V>
  static V addcmul(const V& self, const V& t1, const V& t2, opmath_t value) {
    return madd(splat(value, self) * t1, t2, self);
  }
  template <typename V>
  static V addcdiv(const V& self, const V& t1, const V& t2, opmath_t value) {
    return self + splat(value, self) * t1 / t2;
  }
  // The gradient as an update reads it: negated under ``maximize``, plus ``weight_decay * p``
  // with ``decay`` (coupled weight decay: torch's ``grad.add(param, alpha=weight_decay)``).
  template <typename V>
  static V grad(const V& g, const V& p, bool maximize, bool decay, opmath_t weight_decay) {
    const V s = maximize ? vneg(g) : g;
    return decay ? r(add(s, p, weight_decay)) : s;
  }
  // ``x.mul_(decay).addcmul_(t, t, value=one_minus_decay)``: an average of squares.
  template <typename V>
  static V square_average(const V& x, const V& t, opmath_t decay, opmath_t one_minus_decay) {
    return r(addcmul(r(x * splat(decay, x)), t, t, one_minus_decay));
  }
  // torch.lerp with a scalar weight (``small``: |weight| < 0.5; ``weight_m1``: weight - 1).
  template <typename V>
  static V lerp(const V& self, const V& end, opmath_t weight, opmath_t weight_m1, bool small) {
    const V diff = end - self;
    return small ? madd(splat(weight, self), diff, self) : madd(splat(weight_m1, self), diff, end);
  }
};

// A lerp weight as torch's kernel takes it.
template <typename opmath_t>
struct LerpWeight {
  opmath_t w, w_m1;
  bool small;
  explicit LerpWeight(double weight)
      : w(static_cast<opmath_t>(weight)), w_m1(w - opmath_t(1)), small(std::abs(w) < opmath_t(0.5)) {}
};

// ---------------------------------------------------------------------------------------
// The loop: ``op(v)`` on K operand arrays of n elements (v[k] the k-th operand's value, as a
// vector or a scalar of opmath_t), the operands marked in ``Written`` stored back.
//
// It walks the elements as torch's elementwise kernels do (at::parallel_for with torch's
// grain size; in each range, pairs of scalar_t vectors, then a scalar tail), so that the
// tail elements, where torch's reduced-dtype arithmetic differs, are the same ones.

template <typename scalar_t, int K, uint32_t Written, typename Op>
void for_each(int64_t n, const std::array<scalar_t*, K>& ptr, const Op& op) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vs = Vectorized<scalar_t>;
  using Vo = Vectorized<opmath_t>;
  constexpr bool reduced = Ctx<scalar_t>::reduced;
  constexpr int64_t kStep = 2 * Vs::size();
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kStep <= end; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vs::size()) {
        if constexpr (reduced) {
          Vo lo[K], hi[K];
          for (int k = 0; k < K; ++k) {
            std::tie(lo[k], hi[k]) = at::vec::convert_to_float<scalar_t>(Vs::loadu(ptr[k] + j));
          }
          op(lo);
          op(hi);
          for (int k = 0; k < K; ++k) {
            if (Written & (1u << k)) {
              at::vec::convert_from_float<scalar_t>(lo[k], hi[k]).store(ptr[k] + j);
            }
          }
        } else {
          Vo v[K];
          for (int k = 0; k < K; ++k) {
            v[k] = Vo::loadu(ptr[k] + j);
          }
          op(v);
          for (int k = 0; k < K; ++k) {
            if (Written & (1u << k)) {
              v[k].store(ptr[k] + j);
            }
          }
        }
      }
    }
    for (; i < end; ++i) {
      opmath_t s[K];
      for (int k = 0; k < K; ++k) {
        s[k] = static_cast<opmath_t>(ptr[k][i]);
      }
      op(s);
      for (int k = 0; k < K; ++k) {
        if (Written & (1u << k)) {
          ptr[k][i] = static_cast<scalar_t>(s[k]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------
// Square roots as torch.sqrt takes them.
//
// torch.sqrt of float32 / float64 is MKL's vmsSqrt / vmdSqrt (high accuracy) where torch is
// built with MKL, and libtorch_cpu exports both; elsewhere, and for float16 / bfloat16, it is
// at::vec's correctly rounded root, as ``vsqrt`` is. An op that takes roots is split around
// them: ``before(v, args)`` updates what comes first and puts the values to take the root of in
// ``args`` (``kRoots`` of them); ``after(v, roots)`` finishes, recomputing from v what it needs.

extern "C" {
// MKL's 64-bit-index vector math, as libtorch_cpu exports it (weak: absent without MKL).
void vmsSqrt_64(int64_t n, const float* a, float* r, int64_t mode) __attribute__((weak));
void vmdSqrt_64(int64_t n, const double* a, double* r, int64_t mode) __attribute__((weak));
}
// The mode torch's at::vml passes: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;

// In place; only where ``sqrt_is_mkl``.
inline void mkl_sqrt(float* x, int64_t n) { vmsSqrt_64(n, x, x, kVmlMode); }
inline void mkl_sqrt(double* x, int64_t n) { vmdSqrt_64(n, x, x, kVmlMode); }

// Whether torch.sqrt of this dtype is MKL's here.
template <typename scalar_t>
bool sqrt_is_mkl() {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    return at::hasMKL() && (std::is_same_v<scalar_t, float> ? vmsSqrt_64 != nullptr : vmdSqrt_64 != nullptr);
  } else {
    return false;
  }
}

// before, correctly rounded roots, after: one op for ``for_each``.
template <typename scalar_t, typename Op>
struct RootedInPlace {
  const Op& op;
  template <typename V>
  void operator()(V* v) const {
    V a[Op::kRoots];
    op.before(v, a);
    for (int r = 0; r < Op::kRoots; ++r) {
      a[r] = Ctx<scalar_t>::r(vsqrt(a[r]));
    }
    op.after(v, a);
  }
};

// ``for_each`` of an op split around its roots. With MKL roots (float32 / float64), each range
// goes in blocks of kBlock elements (32 KiB): ``before`` over the block (its values stored, the root
// arguments kept in a buffer), MKL's roots of the buffer, ``after`` over the block, which is
// still in cache.
template <typename scalar_t, int K, uint32_t Written, typename Op>
void for_each_rooted(int64_t n, const std::array<scalar_t*, K>& ptr, const Op& op) {
  if constexpr (Ctx<scalar_t>::reduced) {
    for_each<scalar_t, K, Written>(n, ptr, RootedInPlace<scalar_t, Op>{op});
  } else {
    if (!sqrt_is_mkl<scalar_t>()) {
      for_each<scalar_t, K, Written>(n, ptr, RootedInPlace<scalar_t, Op>{op});
      return;
    }
    using Vec = Vectorized<scalar_t>;
    constexpr int R = Op::kRoots;
    // 32 KiB a buffer: MKL's cost per call (about 0.5 us) spread over 8,192 / 4,096 values.
    constexpr int64_t kBlock = 32768 / sizeof(scalar_t);
    at::parallel_for(0, n, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      alignas(64) scalar_t buf[R][kBlock];
      // ``body(v, j)`` on each element (vector or scalar) of [b, b + len), the operands of
      // ``stored`` stored back.
      auto walk = [&](int64_t b, int64_t len, uint32_t stored, auto&& body) {
        int64_t j = 0;
        for (; j + Vec::size() <= len; j += Vec::size()) {
          Vec v[K];
          for (int k = 0; k < K; ++k) {
            v[k] = Vec::loadu(ptr[k] + b + j);
          }
          body(v, j);
          for (int k = 0; k < K; ++k) {
            if (stored & (1u << k)) {
              v[k].store(ptr[k] + b + j);
            }
          }
        }
        for (; j < len; ++j) {
          scalar_t s[K];
          for (int k = 0; k < K; ++k) {
            s[k] = ptr[k][b + j];
          }
          body(s, j);
          for (int k = 0; k < K; ++k) {
            if (stored & (1u << k)) {
              ptr[k][b + j] = s[k];
            }
          }
        }
      };
      for (int64_t b = begin; b < end; b += kBlock) {
        const int64_t len = std::min(kBlock, end - b);
        walk(b, len, Written & Op::kBeforeWrites, [&](auto* v, int64_t j) {
          using V = std::remove_pointer_t<decltype(v)>;
          V a[R];
          op.before(v, a);
          for (int r = 0; r < R; ++r) {
            store_at(a[r], buf[r] + j);
          }
        });
        for (int r = 0; r < R; ++r) {
          mkl_sqrt(buf[r], len);
        }
        walk(b, len, Written & Op::kAfterWrites, [&](auto* v, int64_t j) {
          using V = std::remove_pointer_t<decltype(v)>;
          V roots[R];
          for (int r = 0; r < R; ++r) {
            load_at(&roots[r], buf[r] + j);
          }
          op.after(v, roots);
        });
      }
    });
  }
}

// ---------------------------------------------------------------------------------------
// Operands of one parameter, laid out alike.

// The tensors of one parameter (parameter, gradient, state) as data pointers. ``kLikeParam``:
// of one layout, element k of each at the same offset: the parameter's own where it is dense,
// else contiguous. ``kContiguous``: each tensor contiguous (Adafactor, which walks rows and
// columns). A tensor already so is used where it is; any other is copied, and the written
// ones (bit k of ``written``) are copied back by ``finish``.
// A parameter's operands, without a heap allocation (at most six).
using Tensors = c10::SmallVector<at::Tensor, 6>;

class Staged {
 public:
  enum Layout { kLikeParam, kContiguous };

  Staged(Tensors tensors, uint32_t written, Layout layout = kLikeParam)
      : given_(std::move(tensors)), written_(written) {
    const at::Tensor& p = given_[0];
    const bool dense = layout == kLikeParam && p.is_non_overlapping_and_dense() && plain(p);
    const bool contiguous = !dense || p.is_contiguous();
    for (const at::Tensor& t : given_) {
      const bool fits = plain(t) && (contiguous ? t.is_contiguous() : t.strides() == p.strides());
      if (fits) {
        work_.push_back(t);
      } else if (contiguous) {
        work_.push_back(at::empty(t.sizes(), t.options()).copy_(t));
      } else {
        work_.push_back(at::empty_strided(p.sizes(), p.strides(), t.options()).copy_(t));
      }
    }
  }

  template <typename scalar_t>
  scalar_t* data(size_t k) {
    return static_cast<scalar_t*>(work_[k].data_ptr());
  }

  void finish() {
    for (size_t k = 0; k < given_.size(); ++k) {
      if ((written_ & (1u << k)) && !work_[k].is_same(given_[k])) {
        given_[k].copy_(work_[k]);
      }
    }
  }

 private:
  static bool plain(const at::Tensor& t) { return !t.is_neg() && !t.is_conj(); }

  Tensors given_;
  Tensors work_;
  uint32_t written_;
};

// Checks shared by every kernel: one operand per parameter in each list, all on the CPU,
// each of its parameter's shape and dtype (the dtype one of the four floating types).
void check_lists(const char* name, at::TensorList params,
                 std::initializer_list<std::pair<const char*, at::TensorList>> lists) {
  const size_t n = params.size();
  for (const auto& [what, list] : lists) {
    TORCH_CHECK(list.size() == n, "distopt_kernels::", name, ": ", n, " params but ",
                list.size(), " ", what);
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.device().is_cpu() && p.layout() == at::kStrided, "distopt_kernels::", name,
                ": params[", i, "] is not a dense CPU tensor");
    const auto dtype = p.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                    dtype == at::kBFloat16,
                "distopt_kernels::", name, ": params[", i, "] of ", dtype,
                " (expected a real floating dtype)");
  }
}

// ``t`` (an operand of params[i]) has its parameter's shape, dtype and device.
void check_like(const char* name, const char* what, size_t i, const at::Tensor& t,
                const at::Tensor& p) {
  TORCH_CHECK(t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() &&
                  t.device().is_cpu() && t.layout() == at::kStrided,
              "distopt_kernels::", name, ": ", what, "[", i, "] of shape ", t.sizes(), " and ",
              t.scalar_type(), " for a parameter of ", p.sizes(), " and ", p.scalar_type());
}

// A one-element state entry on the CPU (step, mu_product, eta, mu: float32 as the classes
// make them; loaded from a torch.optim state_dict, of the parameter's dtype except ``step``),
// read and written through its data pointer: tens of nanoseconds, where Tensor::item and
// Tensor::add_ are dispatcher calls.
class Slot {
 public:
  Slot(const char* name, const char* what, size_t i, const at::Tensor& t) : t_(t) {
    TORCH_CHECK(t.numel() == 1 && t.device().is_cpu() && t.layout() == at::kStrided &&
                    at::isFloatingType(t.scalar_type()),
                "distopt_kernels::", name, ": ", what, "[", i,
                "] must be a one-element floating-point CPU tensor, got ", t.sizes(), " of ",
                t.scalar_type(), " on ", t.device());
  }

  double get() const {
    double value = 0.0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t_.scalar_type(), "slot", [&] {
      value = static_cast<double>(*static_cast<const scalar_t*>(t_.const_data_ptr()));
    });
    return value;
  }

  // ``t.copy_(torch.as_tensor(value))``: through float32, as torch.optim stores a Python
  // number it computed (ASGD's eta and mu).
  void set_as_float(double value) const {
    const float rounded = static_cast<float>(value);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t_.scalar_type(), "slot", [&] {
      *static_cast<scalar_t*>(t_.data_ptr()) = static_cast<scalar_t>(rounded);
    });
  }

  // ``torch._foreach_add_([t], 1)`` / ``torch._foreach_mul_([t], factor)`` in t's dtype;
  // the new value.
  double add_one() const {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t_.scalar_type(), "slot", [&] {
      using opmath_t = at::opmath_type<scalar_t>;
      auto* d = static_cast<scalar_t*>(t_.data_ptr());
      *d = static_cast<scalar_t>(static_cast<opmath_t>(*d) + opmath_t(1));
    });
    return get();
  }
  double multiply(double factor) const {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t_.scalar_type(), "slot", [&] {
      using opmath_t = at::opmath_type<scalar_t>;
      auto* d = static_cast<scalar_t*>(t_.data_ptr());
      *d = static_cast<scalar_t>(static_cast<opmath_t>(*d) * Ctx<scalar_t>::in_dtype(factor));
    });
    return get();
  }

 private:
  const at::Tensor& t_;
};

// ``step += 1`` and the new count.
double advance(const char* name, size_t i, const at::Tensor& step) {
  return Slot(name, "steps", i, step).add_one();
}

// Runs ``body.template operator()<scalar_t>()`` for the dtype of ``t``.
#define DISTOPT_DISPATCH(t, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (t).scalar_type(), name, __VA_ARGS__)

// Every parameter of a kernel whose operands are p, g and two states (``a``, ``b``): their
// checks, the step count, then the op ``make(scalar_t(), i, t)`` returns for the dtype (i the
// parameter, t its new step count) over the operands. An op with roots (``kRoots``) goes
// through ``for_each_rooted``.
template <typename Make>
void step_each(const char* name, at::TensorList params, at::TensorList grads,
               at::TensorList steps, std::pair<const char*, at::TensorList> a,
               std::pair<const char*, at::TensorList> b, const Make& make) {
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, a, b});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    check_like(name, a.first, i, a.second[i], p);
    check_like(name, b.first, i, b.second[i], p);
    const double t = advance(name, i, steps[i]);
    Staged ops({p, grads[i], a.second[i], b.second[i]}, 0b1101);
    DISTOPT_DISPATCH(p, "distopt_kernels", [&] {
      const auto op = make(scalar_t(), i, t);
      const std::array<scalar_t*, 4> ptr{ops.data<scalar_t>(0), ops.data<scalar_t>(1),
                                         ops.data<scalar_t>(2), ops.data<scalar_t>(3)};
      if constexpr (decltype(op)::kRoots > 0) {
        for_each_rooted<scalar_t, 4, 0b1101>(p.numel(), ptr, op);
      } else {
        for_each<scalar_t, 4, 0b1101>(p.numel(), ptr, op);
      }
    });
    ops.finish();
  }
}

// The opmath type of a dtype tag.
template <typename scalar_t>
using opmath_of = at::opmath_type<scalar_t>;

// ---------------------------------------------------------------------------------------
// Adadelta: operands p, g, square_avg, acc_delta.

template <typename scalar_t>
struct AdadeltaOp {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t rho, one_minus_rho, eps, weight_decay, neg_lr;
  bool maximize, decay;
  static constexpr int kRoots = 2;
  // The operands ``before`` and ``after`` write (square_avg; p and acc_delta).
  static constexpr uint32_t kBeforeWrites = 0b0100, kAfterWrites = 0b1001;

  // The roots of square_avg + eps (std) and acc_delta + eps (delta).
  template <typename V>
  void before(V* v, V* args) const {
    const V g = C::grad(v[1], v[0], maximize, decay, weight_decay);
    v[2] = C::square_average(v[2], g, rho, one_minus_rho);
    args[0] = C::r(v[2] + splat(eps, g));
    args[1] = C::r(v[3] + splat(eps, g));
  }

  template <typename V>
  void after(V* v, const V* roots) const {
    const V g = C::grad(v[1], v[0], maximize, decay, weight_decay);
    V delta = C::r(roots[1] / roots[0]);
    delta = C::r(delta * g);
    v[3] = C::square_average(v[3], delta, rho, one_minus_rho);
    v[0] = C::r(C::add(v[0], delta, neg_lr));
  }
};

void adadelta(at::TensorList params, at::TensorList grads, at::TensorList steps,
              at::TensorList square_avgs, at::TensorList acc_deltas, double lr, double rho,
              double eps, double weight_decay, bool maximize) {
  step_each("adadelta_", params, grads, steps, {"square_avgs", square_avgs},
            {"acc_deltas", acc_deltas}, [&](auto tag, size_t, double) {
    using scalar_t = decltype(tag);
    using C = Ctx<scalar_t>;
    return AdadeltaOp<scalar_t>{C::in_dtype(rho), static_cast<opmath_of<scalar_t>>(1.0 - rho),
                                C::in_dtype(eps), C::in_dtype(weight_decay), C::in_dtype(-lr),
                                maximize, weight_decay != 0.0};
  });
}

// ---------------------------------------------------------------------------------------
// Adamax: operands p, g, exp_avg, exp_inf.

template <typename scalar_t>
struct AdamaxOp {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  LerpWeight<opmath_t> w;
  opmath_t beta2, eps, weight_decay, step_size;
  bool maximize, decay;
  static constexpr int kRoots = 0;

  template <typename V>
  void operator()(V* v) const {
    V& p = v[0];
    const V g = C::grad(v[1], p, maximize, decay, weight_decay);
    V& m = v[2];
    V& u = v[3];
    m = C::r(C::lerp(m, g, w.w, w.w_m1, w.small));
    u = C::r(u * splat(beta2, p));
    const V norm = C::r(vabs(g) + splat(eps, p));
    u = vmax(u, norm);
    p = C::r(C::addcdiv(p, m, u, step_size));
  }
};

void adamax(at::TensorList params, at::TensorList grads, at::TensorList steps,
            at::TensorList exp_avgs, at::TensorList exp_infs, double lr, double beta1,
            double beta2, double eps, double weight_decay, bool maximize) {
  step_each("adamax_", params, grads, steps, {"exp_avgs", exp_avgs}, {"exp_infs", exp_infs},
            [&](auto tag, size_t, double t) {
    using scalar_t = decltype(tag);
    using C = Ctx<scalar_t>;
    using opmath_t = opmath_of<scalar_t>;
    return AdamaxOp<scalar_t>{LerpWeight<opmath_t>(1.0 - beta1), C::in_dtype(beta2),
                              C::in_dtype(eps), C::in_dtype(weight_decay),
                              static_cast<opmath_t>(-(lr / (1.0 - std::pow(beta1, t)))),
                              maximize, weight_decay != 0.0};
  });
}

// ---------------------------------------------------------------------------------------
// RMSprop: operands p, g, square_avg, then momentum_buffer (Momentum), then grad_avg
// (Centered).

template <typename scalar_t, bool Momentum, bool Centered>
struct RmspropOp {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t alpha, one_minus_alpha, eps, weight_decay, momentum, lr_scaled;
  LerpWeight<opmath_t> w;
  bool maximize, decay;
  static constexpr int kRoots = 1;
  // square_avg (and grad_avg); p (and momentum_buffer).
  static constexpr uint32_t kBeforeWrites = 0b100 | (Centered ? 1u << (Momentum ? 4 : 3) : 0u);
  static constexpr uint32_t kAfterWrites = 0b1 | (Momentum ? 0b1000u : 0u);

  // The root of square_avg (centered: less grad_avg^2).
  template <typename V>
  void before(V* v, V* args) const {
    const V g = C::grad(v[1], v[0], maximize, decay, weight_decay);
    V& sq = v[2];
    sq = C::square_average(sq, g, alpha, one_minus_alpha);
    if constexpr (Centered) {
      V& grad_avg = v[Momentum ? 4 : 3];
      grad_avg = C::r(C::lerp(grad_avg, g, w.w, w.w_m1, w.small));
      args[0] = C::r(C::addcmul(sq, grad_avg, grad_avg, opmath_t(-1)));
    } else {
      args[0] = sq;
    }
  }

  template <typename V>
  void after(V* v, const V* roots) const {
    const V g = C::grad(v[1], v[0], maximize, decay, weight_decay);
    V& p = v[0];
    const V avg = C::r(roots[0] + splat(eps, p));
    if constexpr (Momentum) {
      V& buf = v[3];
      buf = C::r(buf * splat(momentum, p));
      buf = C::r(C::addcdiv(buf, g, avg, opmath_t(1)));
      p = C::r(C::add(p, buf, lr_scaled));
    } else {
      p = C::r(C::addcdiv(p, g, avg, lr_scaled));
    }
  }
};

void rmsprop(at::TensorList params, at::TensorList grads, at::TensorList steps,
             at::TensorList square_avgs, at::TensorList momentum_buffers,
             at::TensorList grad_avgs, double lr, double alpha, double eps,
             double weight_decay, double momentum, bool centered, bool maximize) {
  constexpr const char* name = "rmsprop_";
  const bool with_momentum = momentum > 0.0;
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, {"square_avgs", square_avgs}});
  TORCH_CHECK(momentum_buffers.size() == (with_momentum ? params.size() : 0),
              "distopt_kernels::rmsprop_: ", momentum_buffers.size(), " momentum_buffers for ",
              params.size(), " params with momentum ", momentum);
  TORCH_CHECK(grad_avgs.size() == (centered ? params.size() : 0), "distopt_kernels::rmsprop_: ",
              grad_avgs.size(), " grad_avgs for ", params.size(), " params, centered ", centered);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    check_like(name, "square_avgs", i, square_avgs[i], p);
    Tensors tensors{p, grads[i], square_avgs[i]};
    if (with_momentum) {
      check_like(name, "momentum_buffers", i, momentum_buffers[i], p);
      tensors.push_back(momentum_buffers[i]);
    }
    if (centered) {
      check_like(name, "grad_avgs", i, grad_avgs[i], p);
      tensors.push_back(grad_avgs[i]);
    }
    advance(name, i, steps[i]);
    const uint32_t written = ((1u << tensors.size()) - 1) & ~2u;
    Staged ops(tensors, written);
    DISTOPT_DISPATCH(p, name, [&] {
      using C = Ctx<scalar_t>;
      using opmath_t = typename C::opmath_t;
      const opmath_t lr_scaled = with_momentum ? C::in_dtype(-lr) : static_cast<opmath_t>(-lr);
      const int64_t n = p.numel();
      auto run = [&](auto momentum_tag, auto centered_tag) {
        constexpr bool M = decltype(momentum_tag)::value;
        constexpr bool Ce = decltype(centered_tag)::value;
        constexpr int K = 3 + M + Ce;
        RmspropOp<scalar_t, M, Ce> op{C::in_dtype(alpha), static_cast<opmath_t>(1.0 - alpha),
                                      C::in_dtype(eps), C::in_dtype(weight_decay),
                                      C::in_dtype(momentum),
                                      lr_scaled, LerpWeight<opmath_t>(1.0 - alpha), maximize,
                                      weight_decay != 0.0};
        std::array<scalar_t*, K> ptr;
        for (int k = 0; k < K; ++k) {
          ptr[k] = ops.data<scalar_t>(k);
        }
        for_each_rooted<scalar_t, K, ((1u << K) - 1) & ~2u>(n, ptr, op);
      };
      if (with_momentum && centered) {
        run(std::true_type{}, std::true_type{});
      } else if (with_momentum) {
        run(std::true_type{}, std::false_type{});
      } else if (centered) {
        run(std::false_type{}, std::true_type{});
      } else {
        run(std::false_type{}, std::false_type{});
      }
    });
    ops.finish();
  }
}

// ---------------------------------------------------------------------------------------
// Rprop: operands p, g, prev, step_size.

template <typename scalar_t>
struct RpropOp {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t etaminus, etaplus, step_size_min, step_size_max;
  bool maximize;
  static constexpr int kRoots = 0;

  template <typename V>
  void operator()(V* v) const {
    V& p = v[0];
    const V& g = v[1];
    V& prev = v[2];
    V& step_size = v[3];
    V sign = C::r(g * prev);
    V now = g;
    if (maximize) {
      sign = vneg(sign);
      now = vneg(now);
    }
    const V factor = sign_factor(vsign(sign), etaminus, etaplus);
    step_size = vclamp(C::r(step_size * factor), step_size_min, step_size_max);
    now = where_eq(factor, etaminus, splat(opmath_t(0), p), now);
    p = C::r(C::addcmul(p, vsign(now), step_size, opmath_t(-1)));
    prev = now;
  }
};

void rprop(at::TensorList params, at::TensorList grads, at::TensorList steps,
           at::TensorList prevs, at::TensorList step_sizes, double etaminus, double etaplus,
           double step_size_min, double step_size_max, bool maximize) {
  step_each("rprop_", params, grads, steps, {"prevs", prevs}, {"step_sizes", step_sizes},
            [&](auto tag, size_t, double) {
    using C = Ctx<decltype(tag)>;
    return RpropOp<decltype(tag)>{C::in_dtype(etaminus), C::in_dtype(etaplus),
                                  C::in_dtype(step_size_min), C::in_dtype(step_size_max),
                                  maximize};
  });
}

// ---------------------------------------------------------------------------------------
// NAdam and RAdam share their first half (decay, then the two moment averages).

template <typename scalar_t>
struct Moments {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  LerpWeight<opmath_t> w;
  opmath_t beta2, one_minus_beta2, weight_decay, decay_factor;
  bool maximize, decoupled, decay;

  // The gradient signed and (not decoupled) decayed; p is the same before and after ``update``
  // wherever this reads it.
  template <typename V>
  V signed_decayed(const V& p, const V& grad) const {
    return C::grad(grad, p, maximize, decay && !decoupled, weight_decay);
  }

  // Operands p, g, exp_avg (m), exp_avg_sq (v): p (decoupled decay), m and v updated in
  // place; the root of v is taken.
  static constexpr int kRoots = 1;
  // p (decoupled decay), exp_avg, exp_avg_sq; p.
  static constexpr uint32_t kBeforeWrites = 0b1101, kAfterWrites = 0b0001;
  template <typename V>
  void before(V* v, V* args) const {
    if (decay && decoupled) {
      v[0] = C::r(v[0] * splat(decay_factor, v[0]));
    }
    const V g = signed_decayed(v[0], v[1]);
    v[2] = C::r(C::lerp(v[2], g, w.w, w.w_m1, w.small));
    v[3] = C::square_average(v[3], g, beta2, one_minus_beta2);
    args[0] = v[3];
  }
};

template <typename scalar_t>
Moments<scalar_t> moments(double lr, double beta1, double beta2, double weight_decay,
                          bool decoupled, bool maximize) {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  return Moments<scalar_t>{LerpWeight<opmath_t>(1.0 - beta1), C::in_dtype(beta2),
                           static_cast<opmath_t>(1.0 - beta2), C::in_dtype(weight_decay),
                           C::in_dtype(1.0 - lr * weight_decay), maximize, decoupled,
                           weight_decay != 0.0};
}

// NAdam: operands p, g, exp_avg, exp_avg_sq.
template <typename scalar_t>
struct NadamOp : Moments<scalar_t> {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t bias_correction2_sqrt, eps, grad_size, exp_avg_size;
  template <typename V>
  void after(V* v, const V* roots) const {
    V& p = v[0];
    const V g = this->signed_decayed(p, v[1]);
    V denom = C::r(roots[0] / splat(bias_correction2_sqrt, p));
    denom = C::r(denom + splat(eps, p));
    p = C::r(C::addcdiv(p, g, denom, grad_size));
    p = C::r(C::addcdiv(p, v[2], denom, exp_avg_size));
  }
};

void nadam(at::TensorList params, at::TensorList grads, at::TensorList steps,
           at::TensorList mu_products, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
           double lr, double beta1, double beta2, double eps, double weight_decay,
           double momentum_decay, bool decoupled_weight_decay, bool maximize) {
  TORCH_CHECK(mu_products.size() == params.size(), "distopt_kernels::nadam_: ", params.size(),
              " params but ", mu_products.size(), " mu_products");
  step_each("nadam_", params, grads, steps, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
            [&](auto tag, size_t i, double t) {
    using scalar_t = decltype(tag);
    using opmath_t = opmath_of<scalar_t>;
    const double mu = beta1 * (1.0 - 0.5 * std::pow(0.96, t * momentum_decay));
    const double mu_next = beta1 * (1.0 - 0.5 * std::pow(0.96, (t + 1.0) * momentum_decay));
    // mu_product is float32 (or the parameter's dtype after a torch.optim state_dict), as in
    // torch.optim: the step sizes use its rounded value.
    const double mu_product = Slot("nadam_", "mu_products", i, mu_products[i]).multiply(mu);
    return NadamOp<scalar_t>{
        moments<scalar_t>(lr, beta1, beta2, weight_decay, decoupled_weight_decay, maximize),
        static_cast<opmath_t>(std::pow(1.0 - std::pow(beta2, t), 0.5)),
        Ctx<scalar_t>::in_dtype(eps),
        static_cast<opmath_t>(-(lr * (1.0 - mu) / (1.0 - mu_product))),
        static_cast<opmath_t>(-(lr * mu_next / (1.0 - mu_product * mu_next)))};
  });
}

// RAdam: operands p, g, exp_avg, exp_avg_sq. The factor ``adaptive_size / (sqrt(v) + eps) +
// plain_size`` multiplies exp_avg; a zero adaptive size (rho_t <= 5) gives an infinity whose
// reciprocal is the wanted zero, as in the foreach path.
template <typename scalar_t>
struct RadamOp : Moments<scalar_t> {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t eps, adaptive_size, plain_size;
  template <typename V>
  void after(V* v, const V* roots) const {
    V& p = v[0];
    V factor = C::r(roots[0] + splat(eps, p));
    factor = C::r(factor / splat(adaptive_size, p));
    factor = C::r(splat(opmath_t(1), p) / factor);
    factor = C::r(factor + splat(plain_size, p));
    p = C::r(C::addcmul(p, v[2], factor, opmath_t(1)));
  }
};

void radam(at::TensorList params, at::TensorList grads, at::TensorList steps,
           at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double beta1,
           double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
           bool maximize) {
  const double rho_inf = 2.0 / (1.0 - beta2) - 1.0;
  step_each("radam_", params, grads, steps, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
            [&](auto tag, size_t, double t) {
    using scalar_t = decltype(tag);
    using C = Ctx<scalar_t>;
    const double beta2_t = std::pow(beta2, t);
    const double rho_t = rho_inf - 2.0 * t * beta2_t / (1.0 - beta2_t);
    double rect = 0.0;
    if (rho_t > 5.0) {
      rect = std::pow((rho_t - 4.0) * (rho_t - 2.0) * rho_inf /
                          ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t),
                      0.5);
    }
    const double bias_correction1 = 1.0 - std::pow(beta1, t);
    const double plain_size = -(lr * (rect > 0.0 ? 0.0 : 1.0) / bias_correction1);
    const double adaptive_size = -(std::pow(1.0 - beta2_t, 0.5) * (lr * rect / bias_correction1));
    return RadamOp<scalar_t>{
        moments<scalar_t>(lr, beta1, beta2, weight_decay, decoupled_weight_decay, maximize),
        C::in_dtype(eps), static_cast<opmath_of<scalar_t>>(adaptive_size), C::in_dtype(plain_size)};
  });
}

// ---------------------------------------------------------------------------------------
// ASGD: operands p, g, ax; eta and mu per parameter (0-dim float32), in torch.optim's
// per-tensor order.

template <typename scalar_t, bool Average>
struct AsgdOp {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t weight_decay, shrink, neg_eta, mu;
  bool maximize, decay;

  template <typename V>
  void operator()(V* v) const {
    V& p = v[0];
    const V g = C::grad(v[1], p, maximize, decay, weight_decay);
    V& ax = v[2];
    p = C::r(p * splat(shrink, p));
    p = C::r(C::add(p, g, neg_eta));
    if constexpr (Average) {
      V diff = C::r(p - ax);
      diff = C::r(diff * splat(mu, p));
      ax = C::r(ax + diff);
    } else {
      ax = p;
    }
  }
};

void asgd(at::TensorList params, at::TensorList grads, at::TensorList steps, at::TensorList etas,
          at::TensorList mus, at::TensorList axs, double lr, double lambd, double alpha,
          double t0, double weight_decay, bool maximize) {
  constexpr const char* name = "asgd_";
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, {"etas", etas}, {"mus", mus},
                             {"axs", axs}});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    check_like(name, "axs", i, axs[i], p);
    const Slot eta_slot(name, "etas", i, etas[i]);
    const Slot mu_slot(name, "mus", i, mus[i]);
    const double step = advance(name, i, steps[i]);
    const double eta = eta_slot.get();
    const double mu = mu_slot.get();
    Staged ops({p, grads[i], axs[i]}, 0b101);
    DISTOPT_DISPATCH(p, name, [&] {
      using C = Ctx<scalar_t>;
      using opmath_t = typename C::opmath_t;
      auto run = [&](auto average_tag) {
        constexpr bool A = decltype(average_tag)::value;
        AsgdOp<scalar_t, A> op{C::in_dtype(weight_decay),
                               static_cast<opmath_t>(1.0 - lambd * eta), C::in_dtype(-eta),
                               static_cast<opmath_t>(mu), maximize, weight_decay != 0.0};
        for_each<scalar_t, 3, 0b101>(p.numel(), {ops.data<scalar_t>(0), ops.data<scalar_t>(1),
                                                  ops.data<scalar_t>(2)}, op);
      };
      if (mu == 1.0) {
        run(std::false_type{});
      } else {
        run(std::true_type{});
      }
    });
    ops.finish();
    // The next eta = lr / (1 + lambd * lr * step) ** alpha and mu = 1 / max(1, step - t0),
    // in double and stored as float32, as torch.optim's per-tensor ASGD computes them.
    eta_slot.set_as_float(lr / std::pow(1.0 + lambd * lr * step, alpha));
    mu_slot.set_as_float(1.0 / std::max(1.0, step - t0));
  }
}


// ---------------------------------------------------------------------------------------
// Adafactor: its norms and row and column means are reductions, so a step is three passes
// over the gradient (two over the parameter) instead of one: (1) the squares' row and column
// sums and the parameter's norm, (2) the update's norm, (3) the update, recomputed from the
// small row and column state rather than stored. The reductions run in double; torch's run in
// the parameter's dtype, in its own order (the README gives the difference).

// Sums of squares in double, lane by lane: ``add(x)`` adds x[k]^2 to lane k of W lanes
// (W: the lanes of a Vectorized<T>, T float or double), ``total()`` adds the lanes up in order.
// The squares and sums are vector ops in double, each rounded as a scalar loop rounds it.
template <typename T>
class SquareLanes {
 public:
  static constexpr int W = Vectorized<T>::size();
  static constexpr int D = Vectorized<double>::size();
  static constexpr int N = W / D;  // double vectors per T vector: 1 or 2
  static_assert(N >= 1, "a T vector holds at least one double vector's lanes");

  // The squares of x's lanes in double, N vectors of D.
  static void squares(const Vectorized<T>& x, Vectorized<double>* out) {
    if constexpr (std::is_same_v<T, double>) {
      out[0] = x * x;
    } else {
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
      const __m256 v = x;
      const Vectorized<double> lo(_mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      const Vectorized<double> hi(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
      out[0] = lo * lo;
      out[1] = hi * hi;
#else
      alignas(64) T buf[W];
      x.store(buf);
      for (int n = 0; n < N; ++n) {
        alignas(64) double wide[D];
        for (int k = 0; k < D; ++k) {
          wide[k] = static_cast<double>(buf[n * D + k]);
        }
        const Vectorized<double> d = Vectorized<double>::loadu(wide);
        out[n] = d * d;
      }
#endif
    }
  }
  void add(const Vectorized<T>& x) {
    Vectorized<double> sq[N];
    squares(x, sq);
    add_squares(sq);
  }
  void add_squares(const Vectorized<double>* sq) {
    for (int n = 0; n < N; ++n) {
      acc_[n] = acc_[n] + sq[n];
    }
  }
  double total() const {
    alignas(64) double lanes[N * D];
    for (int n = 0; n < N; ++n) {
      acc_[n].store(lanes + n * D);
    }
    double sum = 0.0;
    for (int k = 0; k < N * D; ++k) {
      sum += lanes[k];
    }
    return sum;
  }

 private:
  Vectorized<double> acc_[N] = {};
};

// The sum of row[0..n)^2 in double, in lanes (SquareLanes; 16 scalar lanes for float16 and
// bfloat16), and with ``kColumns``, col[j] += row[j]^2 in double too.
template <typename scalar_t, bool kColumns>
double squares_of_row(const scalar_t* row, int64_t n, double* col) {
  double total = 0.0;
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    using L = SquareLanes<scalar_t>;
    constexpr int D = Vectorized<double>::size();
    L lanes;
    for (; j + L::W <= n; j += L::W) {
      Vectorized<double> sq[L::N];
      L::squares(Vectorized<scalar_t>::loadu(row + j), sq);
      lanes.add_squares(sq);
      if constexpr (kColumns) {
        for (int k = 0; k < L::N; ++k) {
          (Vectorized<double>::loadu(col + j + k * D) + sq[k]).store(col + j + k * D);
        }
      }
    }
    total = lanes.total();
  } else {
    constexpr int kLanes = 16;
    double lanes[kLanes] = {};
    for (; j + kLanes <= n; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const double v = static_cast<double>(row[j + k]);
        lanes[k] += v * v;
        if constexpr (kColumns) {
          col[j + k] += v * v;
        }
      }
    }
    for (int k = 0; k < kLanes; ++k) {
      total += lanes[k];
    }
  }
  for (; j < n; ++j) {
    const double v = static_cast<double>(row[j]);
    total += v * v;
    if constexpr (kColumns) {
      col[j] += v * v;
    }
  }
  return total;
}

template <typename scalar_t>
double sum_squares(const scalar_t* x, int64_t n) {
  return squares_of_row<scalar_t, false>(x, n, nullptr);
}

// One partial result per thread of at::parallel_for, added up in thread order.
class PerThread {
 public:
  explicit PerThread(int64_t width) : width_(width), parts_(at::get_num_threads() * width, 0.0) {}
  double* mine() { return parts_.data() + at::get_thread_num() * width_; }
  std::vector<double> total() const {
    std::vector<double> out(width_, 0.0);
    for (size_t t = 0; t < parts_.size(); t += width_) {
      for (int64_t k = 0; k < width_; ++k) {
        out[k] += parts_[t + k];
      }
    }
    return out;
  }

 private:
  int64_t width_;
  std::vector<double> parts_;
};

// The elementwise update of Adafactor on one row of n elements: u = g / sqrt(max(e, eps1^2))
// where e is ``estimate(j)`` (factored: r * c_j / mean(r); else the variance), then either
// the sum of u^2 (``apply`` false) or p = p * decay_factor + scale * u (``apply`` true).
template <typename scalar_t>
struct AdafactorRow {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  opmath_t eps1_squared, decay_factor, scale;
  bool decay;

  template <typename V>
  V update(const V& estimate, const V& g) const {
    V e = vmax(estimate, splat(eps1_squared, g));
    e = C::r(splat(opmath_t(1), g) / vsqrt(e));
    return C::r(e * g);
  }

  template <typename V>
  void apply_to(V& p, const V& u) const {
    if (decay) {
      p = C::r(p * splat(decay_factor, p));
    }
    p = C::r(madd(u, splat(scale, p), p));
  }

  // ``estimate_at(V*, j)`` loads the estimate of elements j.. into a V.
  template <typename Estimate>
  double run(scalar_t* p, const scalar_t* g, int64_t n, bool apply, const Estimate& estimate_at) const {
    using Vo = Vectorized<opmath_t>;
    double squares = 0.0;
    int64_t j = 0;
    if constexpr (!C::reduced) {
      constexpr int64_t W = Vo::size();
      SquareLanes<opmath_t> lanes;
      for (; j + W <= n; j += W) {
        Vo e;
        estimate_at(&e, j);
        const Vo u = update(e, Vo::loadu(g + j));
        if (apply) {
          Vo pv = Vo::loadu(p + j);
          apply_to(pv, u);
          pv.store(p + j);
        } else {
          lanes.add(u);
        }
      }
      squares = lanes.total();
    }
    for (; j < n; ++j) {
      opmath_t e;
      estimate_at(&e, j);
      const opmath_t u = update(e, static_cast<opmath_t>(g[j]));
      if (apply) {
        opmath_t pv = static_cast<opmath_t>(p[j]);
        apply_to(pv, u);
        p[j] = static_cast<scalar_t>(pv);
      } else {
        squares += static_cast<double>(u) * static_cast<double>(u);
      }
    }
    return squares;
  }
};

// A value of opmath_t loaded from scalar_t storage: as a vector or a scalar.
template <typename scalar_t, typename opmath_t>
inline void load_as(Vectorized<opmath_t>* out, const scalar_t* src) {
  *out = Vectorized<opmath_t>::loadu(src);
}
template <typename scalar_t, typename opmath_t>
inline void load_as(opmath_t* out, const scalar_t* src) {
  *out = static_cast<opmath_t>(*src);
}

template <typename scalar_t>
void adafactor_one(const at::Tensor& p_in, const at::Tensor& g_in, const at::Tensor& first_in,
                   const at::Tensor& second_in, bool factored, double lr, double beta2_decay,
                   double t, double eps1, double eps2, double d, double weight_decay,
                   bool maximize) {
  using C = Ctx<scalar_t>;
  using opmath_t = typename C::opmath_t;
  const double one_minus_beta2_t = std::pow(t, beta2_decay);
  const double rho_t = std::min(lr, 1.0 / std::pow(t, 0.5));
  const int64_t numel = p_in.numel();
  Tensors tensors{p_in, maximize ? g_in.neg() : g_in, first_in};
  if (factored) {
    tensors.push_back(second_in);
  }
  Staged ops(tensors, factored ? 0b1101 : 0b101, Staged::kContiguous);
  scalar_t* p = ops.data<scalar_t>(0);
  const scalar_t* g = ops.data<scalar_t>(1);
  const LerpWeight<opmath_t> w(one_minus_beta2_t);
  AdafactorRow<scalar_t> row{C::in_dtype(eps1 * eps1), static_cast<opmath_t>(1.0 - lr * weight_decay),
                             opmath_t(0), weight_decay != 0.0};
  // The norm of a reduction as torch returns it: in the dtype, read as a Python float.
  auto as_dtype = [](double x) { return static_cast<double>(static_cast<scalar_t>(x)); };
  // A norm as torch returns it, from the sum of squares here (in double): torch adds the
  // squares in opmath_t (float for float32, float16 and bfloat16), which overflows to inf
  // where the double does not.
  auto norm_of = [&](double squares) {
    return squares > static_cast<double>(std::numeric_limits<opmath_t>::max())
               ? std::numeric_limits<double>::infinity()
               : as_dtype(std::sqrt(squares));
  };
  double param_squares = 0.0;
  double update_squares = 0.0;
  if (factored) {
    const int64_t cols = p_in.size(-1);
    const int64_t rows = p_in.size(-2);
    const int64_t batches = numel / std::max<int64_t>(1, rows * cols);
    scalar_t* row_var = ops.data<scalar_t>(2);
    scalar_t* col_var = ops.data<scalar_t>(3);
    // (1) Row and column sums of g^2, and the parameter's sum of squares.
    std::vector<double> row_sums(batches * rows);
    PerThread col_parts(batches * cols + 1);
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, cols));
    at::parallel_for(0, batches * rows, grain, [&](int64_t begin, int64_t end) {
      double* part = col_parts.mine();
      for (int64_t r = begin; r < end; ++r) {
        row_sums[r] = squares_of_row<scalar_t, true>(g + r * cols, cols, part + (r / rows) * cols);
        part[batches * cols] += sum_squares(p + r * cols, cols);
      }
    });
    const std::vector<double> col_sums = col_parts.total();
    param_squares = col_sums[batches * cols];
    // The means of g^2 as torch computes them (norm, squared, divided), into the averages.
    auto average = [&](scalar_t* var, double sum, int64_t count) {
      opmath_t mean = static_cast<opmath_t>(norm_of(sum));
      mean = C::r(mean * mean);
      mean = C::r(mean / static_cast<opmath_t>(count));
      *var = static_cast<scalar_t>(C::lerp(static_cast<opmath_t>(*var), mean, w.w, w.w_m1, w.small));
    };
    for (int64_t r = 0; r < batches * rows; ++r) {
      average(row_var + r, row_sums[r], cols);
    }
    for (int64_t k = 0; k < batches * cols; ++k) {
      average(col_var + k, col_sums[k], rows);
    }
    // Each batch's mean of the row averages (clamped at eps1) divides its estimates.
    std::vector<opmath_t> row_var_means(batches);
    for (int64_t b = 0; b < batches; ++b) {
      double sum = 0.0;
      for (int64_t r = 0; r < rows; ++r) {
        sum += static_cast<double>(row_var[b * rows + r]);
      }
      const opmath_t mean = static_cast<opmath_t>(as_dtype(sum / static_cast<double>(rows)));
      row_var_means[b] = std::isnan(mean) ? mean : std::max(mean, C::in_dtype(eps1));
    }
    // (2) the update's sum of squares, then (3) the update.
    auto pass = [&](bool apply) {
      PerThread parts(1);
      at::parallel_for(0, batches * rows, grain, [&](int64_t begin, int64_t end) {
        double* part = parts.mine();
        for (int64_t r = begin; r < end; ++r) {
          const int64_t b = r / rows;
          const opmath_t rv = static_cast<opmath_t>(row_var[r]);
          const opmath_t mean = row_var_means[b];
          const scalar_t* cv = col_var + b * cols;
          auto estimate_at = [&](auto* e, int64_t j) {
            using V = std::remove_pointer_t<decltype(e)>;
            V c;
            load_as<scalar_t, opmath_t>(&c, cv + j);
            *e = C::r(C::r(splat(rv, c) * c) / splat(mean, c));
          };
          part[0] += row.run(p + r * cols, g + r * cols, cols, apply, estimate_at);
        }
      });
      return parts.total()[0];
    };
    update_squares = pass(false);
    const double u_rms = norm_of(update_squares) / (std::pow(static_cast<double>(numel), 0.5) * d);
    const double alpha = std::max(eps2, norm_of(param_squares) / std::pow(static_cast<double>(numel), 0.5)) * rho_t;
    row.scale = C::in_dtype(-alpha / std::max(1.0, u_rms));
    pass(true);
  } else {
    scalar_t* variance = ops.data<scalar_t>(2);
    // (1) the new variance, the parameter's and the update's sums of squares.
    PerThread parts(2);
    at::parallel_for(0, numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      double* part = parts.mine();
      part[0] += sum_squares(p + begin, end - begin);
      for (int64_t j = begin; j < end; ++j) {
        const opmath_t gj = static_cast<opmath_t>(g[j]);
        const opmath_t square = C::r(gj * gj);
        variance[j] = static_cast<scalar_t>(
            C::lerp(static_cast<opmath_t>(variance[j]), square, w.w, w.w_m1, w.small));
      }
      auto estimate_at = [&](auto* e, int64_t j) {
        using V = std::remove_pointer_t<decltype(e)>;
        load_as<scalar_t, opmath_t>(e, variance + begin + j);
      };
      part[1] += row.run(p + begin, g + begin, end - begin, false, estimate_at);
    });
    const std::vector<double> sums = parts.total();
    param_squares = sums[0];
    update_squares = sums[1];
    const double u_rms = norm_of(update_squares) / (std::pow(static_cast<double>(numel), 0.5) * d);
    const double alpha = std::max(eps2, norm_of(param_squares) / std::pow(static_cast<double>(numel), 0.5)) * rho_t;
    row.scale = C::in_dtype(-alpha / std::max(1.0, u_rms));
    // (2) the update.
    at::parallel_for(0, numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      auto estimate_at = [&](auto* e, int64_t j) {
        load_as<scalar_t, opmath_t>(e, variance + begin + j);
      };
      row.run(p + begin, g + begin, end - begin, true, estimate_at);
    });
  }
  ops.finish();
}

void adafactor(at::TensorList params, at::TensorList grads, at::TensorList steps,
               at::TensorList firsts, at::TensorList seconds, double lr, double beta2_decay,
               double eps1, double eps2, double d, double weight_decay, bool maximize,
               bool factored) {
  constexpr const char* name = "adafactor_";
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, {"firsts", firsts},
                             {"seconds", seconds}});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    TORCH_CHECK(factored == (p.dim() > 1), "distopt_kernels::adafactor_: params[", i, "] of ",
                p.dim(), " dimensions in a set with factored=", factored);
    if (factored) {
      auto row_shape = p.sizes().vec();
      auto col_shape = p.sizes().vec();
      row_shape[p.dim() - 1] = 1;
      col_shape[p.dim() - 2] = 1;
      TORCH_CHECK(firsts[i].sizes() == at::IntArrayRef(row_shape) &&
                      seconds[i].sizes() == at::IntArrayRef(col_shape) &&
                      firsts[i].scalar_type() == p.scalar_type() &&
                      seconds[i].scalar_type() == p.scalar_type() && firsts[i].device().is_cpu() &&
                      seconds[i].device().is_cpu(),
                  "distopt_kernels::adafactor_: row_var[", i, "] ", firsts[i].sizes(),
                  " and col_var ", seconds[i].sizes(), " for a parameter of ", p.sizes());
    } else {
      check_like(name, "variances", i, firsts[i], p);
    }
    const double t = advance(name, i, steps[i]);
    DISTOPT_DISPATCH(p, name, [&] {
      adafactor_one<scalar_t>(p, grads[i], firsts[i], seconds[i], factored, lr, beta2_decay, t,
                              eps1, eps2, d, weight_decay, maximize);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Adam and AdamW on blockwise-quantised state (distopt.optim.Adam8bit, AdamW8bit, AdamW4bit).
//
// The two moments are kept as one code per element (8 bits, or 4 bits packed two to a byte)
// and one float32 scale per block of ``block_size`` elements. One pass per block of a
// parameter: decode both moments, update them and the parameter in float32, encode them again
// with the block's new absolute maximum. Nothing is written back but the parameter, the codes
// and the scales.
//
// The arithmetic is bitsandbytes' CPU AdamW8bit (0.50), op for op as torch computes its ops:
//   m = m * b1 + (1 - b1) * g           (torch's add with alpha: one fused multiply-add)
//   v = v * b2 + ((1 - b2) * g) * g     (addcmul: one fused multiply-add)
//   d = sqrt(v) / sqrt(1 - b2^t) + eps  (torch.sqrt: MKL's roots where torch has MKL)
//   p = p * (1 - lr * wd)               (AdamW; Adam adds wd * p to g first)
//   p = p + (-lr / (1 - b1^t)) * m / d  (addcdiv)
// and its 8-bit encoding: x / absmax is rounded to the nearest of 256 codes through a table of
// 65,536 bins of [-1, 1] (a code per bin: the one nearest the bin's value), the bin taken as
// trunc(fma((x * (1 / absmax) + 1) / 2, 65535, 0.5)); a block of zeros keeps code 0.
// The 4-bit encoding is torchao's (AdamW4bit): x / max(absmax, 1e-12) rounded to the nearest
// of 16 codes, a tie to the upper one, codes packed high nibble first.
//
// Blocks are cut from the start of each segment (a parameter; in a flat buffer, each member),
// so a piece of a parameter that starts at a multiple of ``block_size`` from its start has the
// same blocks, codes and scales as the whole parameter: sharded runs give the same bits.

constexpr int64_t kLutBins = 65536;

// The 8-bit table: bin i (value -1 + 2i / 65535) -> the index of the nearest code.
std::vector<uint8_t> build_code_table(const float* code) {
  std::array<float, 255> mid{};
  for (int i = 0; i < 255; ++i) {
    mid[i] = 0.5f * (code[i] + code[i + 1]);
  }
  std::vector<uint8_t> table(kLutBins);
  int k = 0;
  for (int64_t i = 0; i < kLutBins; ++i) {
    const float value = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutBins - 1);
    while (k < 255 && mid[k] < value) {
      ++k;
    }
    table[i] = static_cast<uint8_t>(k);
  }
  return table;
}

// Tables by code book, built once each (a process holds a handful: one per map).
const uint8_t* code_table(const float* code) {
  static std::mutex lock;
  static std::vector<std::pair<std::array<float, 256>, std::vector<uint8_t>>> tables;
  std::array<float, 256> key{};
  std::copy(code, code + 256, key.begin());
  std::lock_guard<std::mutex> guard(lock);
  for (const auto& [book, table] : tables) {
    if (book == key) {
      return table.data();
    }
  }
  tables.emplace_back(key, build_code_table(code));
  return tables.back().second.data();
}

// Square roots of x[0..n) in place, as torch.sqrt takes them.
inline void roots(float* x, int64_t n) {
  if (sqrt_is_mkl<float>()) {
    mkl_sqrt(x, n);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      x[i] = std::sqrt(x[i]);
    }
  }
}

// The largest |x| of a block (NaNs aside, the order of a max does not change it).
inline float block_absmax(const float* x, int64_t n) {
  float absmax = 0.0f;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) {
    absmax = std::max(absmax, lane);
  }
#endif
  for (; i < n; ++i) {
    absmax = std::max(absmax, std::fabs(x[i]));
  }
  return absmax;
}

// One moment's codes: decode a block to float32, encode a block from float32.
struct Codec8 {
  const float* code;
  const uint8_t* table;
  void decode(const uint8_t* q, float scale, float* out, int64_t n) const {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256 c = _mm256_setr_ps(code[q[i]], code[q[i + 1]], code[q[i + 2]], code[q[i + 3]],
                                      code[q[i + 4]], code[q[i + 5]], code[q[i + 6]], code[q[i + 7]]);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(c, s));
    }
#endif
    for (; i < n; ++i) {
      out[i] = code[q[i]] * scale;
    }
  }
  static float absmax_of(const float* x, int64_t n) {
    return block_absmax(x, n);
  }
  float encode(const float* x, uint8_t* q, int64_t n) const {
    const float absmax = absmax_of(x, n);
    if (absmax == 0.0f) {
      std::fill(q, q + n, uint8_t(0));
      return absmax;
    }
    const float inverse = 1.0f / absmax;
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
    const __m256 inv = _mm256_set1_ps(inverse), lo = _mm256_set1_ps(-1.0f), hi = _mm256_set1_ps(1.0f);
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), bins = _mm256_set1_ps(65535.0f);
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
      v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
      const __m256 t = _mm256_mul_ps(_mm256_add_ps(v, one), half);
      alignas(32) int32_t bin[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bin), _mm256_cvttps_epi32(_mm256_fmadd_ps(t, bins, half)));
      for (int j = 0; j < 8; ++j) {
        q[i + j] = table[bin[j]];
      }
    }
#endif
    for (; i < n; ++i) {
      const float v = std::clamp(x[i] * inverse, -1.0f, 1.0f);
      q[i] = table[static_cast<uint16_t>(std::fma((v + 1.0f) * 0.5f, 65535.0f, 0.5f))];
    }
    return absmax;
  }
};

struct Codec4 {
  const float* code;  // 16 codes, ascending
  static uint8_t nearest(const float* c, float v) {
    int k = v >= c[8] ? 8 : 0;
    k += v >= c[k + 4] ? 4 : 0;
    k += v >= c[k + 2] ? 2 : 0;
    k += v >= c[k + 1] ? 1 : 0;
    const int up = std::min(k + 1, 15);
    return static_cast<uint8_t>(v - c[k] >= (c[up] - c[k]) * 0.5f ? up : k);
  }
  void decode(const uint8_t* q, float scale, float* out, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t byte = q[i / 2];
      out[i] = code[(i % 2 == 0) ? (byte >> 4) : (byte & 0xF)] * scale;
    }
  }
  float encode(const float* x, uint8_t* q, int64_t n) const {
    float absmax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      absmax = std::max(absmax, std::fabs(x[i]));
    }
    const float scale = std::max(absmax, 1e-12f);
    for (int64_t i = 0; i < n; i += 2) {
      const uint8_t hi = nearest(code, x[i] / scale);
      const uint8_t lo = i + 1 < n ? nearest(code, x[i + 1] / scale) : uint8_t(0);
      q[i / 2] = static_cast<uint8_t>((hi << 4) | lo);
    }
    return scale;
  }
};

// Where block b lies: its first element, its length, its first code byte.
struct BlockAt {
  int64_t start, length, code;
};

// The blocks of a tensor made of segments of the given lengths (one segment: the tensor).
std::vector<BlockAt> blocks_of(int64_t numel, c10::ArrayRef<int64_t> segments, int64_t block,
                               int bits) {
  std::vector<BlockAt> out;
  int64_t start = 0, code = 0;
  auto cut = [&](int64_t length) {
    for (int64_t at = 0; at < length; at += block) {
      const int64_t n = std::min(block, length - at);
      out.push_back({start + at, n, code});
      code += bits == 8 ? n : (n + 1) / 2;
    }
    start += length;
  };
  if (segments.empty()) {
    cut(numel);
  } else {
    for (int64_t length : segments) {
      cut(length);
    }
  }
  return out;
}

// The scalars of one step, as torch would round each (double arithmetic, then float).
struct AdamScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, correction2, eps, decay, neg_step, l2;
  bool decoupled, maximize;
  AdamScalars(double lr, double b1, double b2, double eps_, double wd, bool decoupled_, bool maximize_,
              double t)
      : beta1(static_cast<float>(b1)), beta2(static_cast<float>(b2)),
        one_minus_beta1(static_cast<float>(1.0 - b1)), one_minus_beta2(static_cast<float>(1.0 - b2)),
        correction2(static_cast<float>(std::sqrt(1.0 - std::pow(b2, t)))), eps(static_cast<float>(eps_)),
        decay(static_cast<float>(1.0 - lr * wd)), neg_step(static_cast<float>(-lr / (1.0 - std::pow(b1, t)))),
        l2(static_cast<float>(wd)), decoupled(decoupled_ && wd > 0.0), maximize(maximize_) {
    if (decoupled_) {
      l2 = 0.0f;
    }
  }
};

// The moments' update of n elements (m, v decoded; root: where sqrt's argument goes), one
// branch-free loop per case so that each vectorises.
template <typename scalar_t>
void moments(const scalar_t* p, const scalar_t* g, float* m, float* v, float* root, int64_t n,
             const AdamScalars& k) {
  auto body = [&](auto grad_of) {
    for (int64_t i = 0; i < n; ++i) {
      const float grad = grad_of(i);
      m[i] = std::fma(grad, k.one_minus_beta1, m[i] * k.beta1);
      v[i] = std::fma(k.one_minus_beta2 * grad, grad, v[i] * k.beta2);
      root[i] = v[i];
    }
  };
  const float sign = k.maximize ? -1.0f : 1.0f;
  if (k.l2 != 0.0f) {
    body([&](int64_t i) { return std::fma(static_cast<float>(p[i]), k.l2, sign * static_cast<float>(g[i])); });
  } else if (k.maximize) {
    body([&](int64_t i) { return -static_cast<float>(g[i]); });
  } else {
    body([&](int64_t i) { return static_cast<float>(g[i]); });
  }
}

// One step over blocks [first, last) of one tensor; m, v: scratch of the blocks' elements.
template <typename scalar_t, typename Codec>
void blockwise_adam_range(scalar_t* p, const scalar_t* g, uint8_t* q1, float* s1, uint8_t* q2,
                          float* s2, const std::vector<BlockAt>& blocks, int64_t first,
                          int64_t last, const Codec& c1, const Codec& c2, const AdamScalars& k) {
  constexpr int64_t kChunk = 8192;  // elements decoded at once: 2 x 32 KiB of float32
  std::vector<float> m(kChunk), v(kChunk), roots_buffer(kChunk);
  int64_t b = first;
  while (b < last) {
    // As many whole blocks as fit in the chunk (at least one).
    int64_t e = b, n = 0;
    while (e < last && (e == b || n + blocks[e].length <= kChunk)) {
      n += blocks[e].length;
      ++e;
    }
    if (static_cast<int64_t>(m.size()) < n) {
      m.resize(n);
      v.resize(n);
      roots_buffer.resize(n);
    }
    const int64_t origin = blocks[b].start;
    for (int64_t j = b; j < e; ++j) {
      const BlockAt& at = blocks[j];
      c1.decode(q1 + at.code, s1[j], m.data() + (at.start - origin), at.length);
      c2.decode(q2 + at.code, s2[j], v.data() + (at.start - origin), at.length);
    }
    float* root = roots_buffer.data();
    moments(p + origin, g + origin, m.data(), v.data(), root, n, k);
    roots(root, n);
    if (k.decoupled) {
      for (int64_t i = 0; i < n; ++i) {
        const float denom = root[i] / k.correction2 + k.eps;
        p[origin + i] = static_cast<scalar_t>(static_cast<float>(p[origin + i]) * k.decay + k.neg_step * m[i] / denom);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float denom = root[i] / k.correction2 + k.eps;
        p[origin + i] = static_cast<scalar_t>(static_cast<float>(p[origin + i]) + k.neg_step * m[i] / denom);
      }
    }
    for (int64_t j = b; j < e; ++j) {
      const BlockAt& at = blocks[j];
      s1[j] = c1.encode(m.data() + (at.start - origin), q1 + at.code, at.length);
      s2[j] = c2.encode(v.data() + (at.start - origin), q2 + at.code, at.length);
    }
    b = e;
  }
}

// bitsandbytes' float32-state step (its AdamW8bit keeps parameters under min_8bit_size so):
//   d = sqrt(v) + eps * sqrt(1 - b2^t);  p = p + (-lr * sqrt(1 - b2^t) / (1 - b1^t)) * (m / d)
template <typename scalar_t>
void float_state_adam(scalar_t* p, const scalar_t* g, float* m, float* v, int64_t n,
                      const AdamScalars& k, double lr, double eps, double b1, double b2, double t) {
  const double c2 = std::sqrt(1.0 - std::pow(b2, t));
  const float shifted_eps = static_cast<float>(eps * c2);
  const float step = static_cast<float>(-lr * c2 / (1.0 - std::pow(b1, t)));
  std::vector<float> root(n);
  std::vector<float> grads(n);
  for (int64_t i = 0; i < n; ++i) {
    float grad = static_cast<float>(g[i]);
    if (k.maximize) {
      grad = -grad;
    }
    if (k.l2 != 0.0f) {
      grad = std::fma(static_cast<float>(p[i]), k.l2, grad);
    }
    m[i] = std::fma(grad, k.one_minus_beta1, m[i] * k.beta1);
    v[i] = std::fma(k.one_minus_beta2 * grad, grad, v[i] * k.beta2);
    root[i] = v[i];
  }
  roots(root.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    float w = static_cast<float>(p[i]);
    if (k.decoupled) {
      w = w * k.decay;
    }
    const float update = m[i] / (root[i] + shifted_eps);
    p[i] = static_cast<scalar_t>(std::fma(update, step, w));
  }
}

// A codes tensor of one parameter: uint8, contiguous, ``bytes`` long; its scales float32,
// contiguous, one per block.
void check_codes(size_t i, const char* what, const at::Tensor& q, int64_t bytes,
                 const at::Tensor& scales, int64_t blocks) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.is_contiguous() &&
                  q.numel() == bytes,
              "distopt_kernels::blockwise_adam_: ", what, "[", i, "] must be ", bytes,
              " contiguous uint8 codes on the CPU, got ", q.numel(), " of ", q.scalar_type());
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == blocks,
              "distopt_kernels::blockwise_adam_: ", what, "_absmax[", i, "] must be ", blocks,
              " contiguous float32 scales on the CPU, got ", scales.numel(), " of ",
              scales.scalar_type());
}

void blockwise_adam(at::TensorList params, at::TensorList grads, at::TensorList steps,
                    at::TensorList exp_avgs, at::TensorList exp_avg_absmax,
                    at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_absmax,
                    const at::Tensor& code1, const at::Tensor& code2, at::IntArrayRef segments,
                    at::IntArrayRef segment_counts, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool decoupled, bool maximize, int64_t bits,
                    int64_t block_size) {
  constexpr const char* name = "blockwise_adam_";
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, {"exp_avgs", exp_avgs},
                             {"exp_avg_absmax", exp_avg_absmax}, {"exp_avg_sqs", exp_avg_sqs},
                             {"exp_avg_sq_absmax", exp_avg_sq_absmax}});
  TORCH_CHECK(bits == 8 || bits == 4, "distopt_kernels::blockwise_adam_: bits=", bits,
              " (expected 8 or 4)");
  TORCH_CHECK(block_size > 0 && block_size % 2 == 0, "distopt_kernels::blockwise_adam_: block_size=",
              block_size, " (expected a positive even number)");
  const int64_t books = bits == 8 ? 256 : 16;
  for (const at::Tensor* c : {&code1, &code2}) {
    TORCH_CHECK(c->device().is_cpu() && c->scalar_type() == at::kFloat && c->is_contiguous() &&
                    c->numel() == books,
                "distopt_kernels::blockwise_adam_: a code book of ", bits, " bits must be ", books,
                " contiguous float32 values, got ", c->numel(), " of ", c->scalar_type());
  }
  TORCH_CHECK(segment_counts.empty() || segment_counts.size() == params.size(),
              "distopt_kernels::blockwise_adam_: ", segment_counts.size(), " segment counts for ",
              params.size(), " params");
  const float* book1 = code1.data_ptr<float>();
  const float* book2 = code2.data_ptr<float>();
  int64_t segment_at = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    TORCH_CHECK(p.is_contiguous() && grads[i].is_contiguous() && p.scalar_type() != at::kDouble,
                "distopt_kernels::blockwise_adam_: params[", i,
                "] and its gradient must be contiguous float32, float16 or bfloat16");
    const int64_t count = segment_counts.empty() ? 0 : segment_counts[i];
    TORCH_CHECK(segment_at + count <= static_cast<int64_t>(segments.size()),
                "distopt_kernels::blockwise_adam_: segment counts exceed the segments");
    const auto own = segments.slice(segment_at, count);
    segment_at += count;
    int64_t covered = 0;
    for (int64_t length : own) {
      covered += length;
    }
    TORCH_CHECK(own.empty() || covered == p.numel(), "distopt_kernels::blockwise_adam_: the segments of params[",
                i, "] cover ", covered, " of its ", p.numel(), " elements");
    const std::vector<BlockAt> blocks = blocks_of(p.numel(), own, block_size, static_cast<int>(bits));
    const int64_t bytes = blocks.empty() ? 0 : blocks.back().code + (bits == 8 ? blocks.back().length
                                                                               : (blocks.back().length + 1) / 2);
    const int64_t n_blocks = static_cast<int64_t>(blocks.size());
    check_codes(i, "exp_avgs", exp_avgs[i], bytes, exp_avg_absmax[i], n_blocks);
    check_codes(i, "exp_avg_sqs", exp_avg_sqs[i], bytes, exp_avg_sq_absmax[i], n_blocks);
  }
  const uint8_t* table1 = bits == 8 ? code_table(book1) : nullptr;
  const uint8_t* table2 = bits == 8 ? code_table(book2) : nullptr;
  segment_at = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const int64_t count = segment_counts.empty() ? 0 : segment_counts[i];
    const auto own = segments.slice(segment_at, count);
    segment_at += count;
    const std::vector<BlockAt> blocks = blocks_of(p.numel(), own, block_size, static_cast<int>(bits));
    const double t = advance(name, i, steps[i]);
    const AdamScalars k(lr, beta1, beta2, eps, weight_decay, decoupled, maximize, t);
    uint8_t* q1 = exp_avgs[i].data_ptr<uint8_t>();
    uint8_t* q2 = exp_avg_sqs[i].data_ptr<uint8_t>();
    float* s1 = exp_avg_absmax[i].data_ptr<float>();
    float* s2 = exp_avg_sq_absmax[i].data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / block_size);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), name, [&] {
      scalar_t* pd = p.data_ptr<scalar_t>();
      const scalar_t* gd = grads[i].const_data_ptr<scalar_t>();
      at::parallel_for(0, static_cast<int64_t>(blocks.size()), grain, [&](int64_t first, int64_t last) {
        if (bits == 8) {
          blockwise_adam_range<scalar_t>(pd, gd, q1, s1, q2, s2, blocks, first, last,
                                         Codec8{book1, table1}, Codec8{book2, table2}, k);
        } else {
          blockwise_adam_range<scalar_t>(pd, gd, q1, s1, q2, s2, blocks, first, last,
                                         Codec4{book1}, Codec4{book2}, k);
        }
      });
    });
  }
}

// The float32-state step of parameters too small to quantise.
void float_state_adam_list(at::TensorList params, at::TensorList grads, at::TensorList steps,
                           at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
                           double beta1, double beta2, double eps, double weight_decay,
                           bool decoupled, bool maximize) {
  constexpr const char* name = "float_state_adam_";
  check_lists(name, params, {{"grads", grads}, {"steps", steps}, {"exp_avgs", exp_avgs},
                             {"exp_avg_sqs", exp_avg_sqs}});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_like(name, "grads", i, grads[i], p);
    TORCH_CHECK(p.is_contiguous() && grads[i].is_contiguous() && p.scalar_type() != at::kDouble,
                "distopt_kernels::float_state_adam_: params[", i,
                "] and its gradient must be contiguous float32, float16 or bfloat16");
    for (const at::Tensor* s : {&exp_avgs[i], &exp_avg_sqs[i]}) {
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == p.numel() &&
                      s->device().is_cpu(),
                  "distopt_kernels::float_state_adam_: the moments of params[", i,
                  "] must be contiguous float32 CPU tensors of its ", p.numel(), " elements");
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const double t = advance(name, i, steps[i]);
    const AdamScalars k(lr, beta1, beta2, eps, weight_decay, decoupled, maximize, t);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), name, [&] {
      float_state_adam<scalar_t>(p.data_ptr<scalar_t>(), grads[i].const_data_ptr<scalar_t>(),
                                 exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                                 p.numel(), k, lr, eps, beta1, beta2, t);
    });
  }
}

}  // namespace

TORCH_LIBRARY(distopt_kernels, m) {
  m.def("adadelta_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] square_avgs, Tensor(d!)[] acc_deltas, float lr, float rho, float eps, "
        "float weight_decay, bool maximize) -> ()",
        &adadelta);
  m.def("adamax_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_infs, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, bool maximize) -> ()",
        &adamax);
  m.def("rmsprop_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] square_avgs, Tensor(d!)[] momentum_buffers, Tensor(e!)[] grad_avgs, "
        "float lr, float alpha, float eps, float weight_decay, float momentum, bool centered, "
        "bool maximize) -> ()",
        &rmsprop);
  m.def("rprop_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, Tensor(c!)[] prevs, "
        "Tensor(d!)[] step_sizes, float etaminus, float etaplus, float step_size_min, "
        "float step_size_max, bool maximize) -> ()",
        &rprop);
  m.def("nadam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] mu_products, Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, float momentum_decay, "
        "bool decoupled_weight_decay, bool maximize) -> ()",
        &nadam);
  m.def("radam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, bool decoupled_weight_decay, bool maximize) -> ()",
        &radam);
  m.def("asgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, Tensor(c!)[] etas, "
        "Tensor(d!)[] mus, Tensor(e!)[] axs, float lr, float lambd, float alpha, float t0, "
        "float weight_decay, bool maximize) -> ()",
        &asgd);
  m.def("adafactor_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] firsts, Tensor(d!)[] seconds, float lr, float beta2_decay, float eps1, "
        "float eps2, float d, float weight_decay, bool maximize, bool factored) -> ()",
        &adafactor);
  m.def("blockwise_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_absmax, Tensor(e!)[] exp_avg_sqs, "
        "Tensor(f!)[] exp_avg_sq_absmax, Tensor code1, Tensor code2, int[] segments, "
        "int[] segment_counts, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool decoupled, bool maximize, int bits, int block_size) -> ()",
        &blockwise_adam);
  m.def("float_state_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, bool decoupled, bool maximize) -> ()",
        &float_state_adam_list);
}
