// Native helpers for flat parameter buffers (functional/_flat.py) and an owner's step
// (distopt/local_optimizer.py: gradient lookups and checks, autograd version counters).
//
// The TorchScript interpreter spends about a microsecond per parameter on the bookkeeping of a
// flat step (checking each gradient, looking it up in the autograd context's dict, copying
// it into the flat gradient buffer); these ops do the same per-parameter work in C++, where
// it costs tens of nanoseconds. Registered with TORCH_LIBRARY, so TorchScript code and eager
// code call them alike as torch.ops.distopt_flat.*, without the GIL.
#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <vector>

namespace {

// Fill ``out`` (a flat gradient buffer) with the gradients of a flat buffer's members and
// return true, if every member can take part in a flat step: its gradient (``grads[members[k]]``)
// is present, a plain strided tensor with its own memory (not a tensor subclass), of its view's
// dtype, shape and device, not sharing memory with ``out``, and the member ``params[k]`` is
// still set to its view ``views[k]``. Otherwise return false and write nothing. Member k lies at
// ``offsets[k]`` of ``out``, back to back in buffer order. Arguments that do not describe a flat
// buffer (lengths, offsets outside ``out``, ``out`` of another dtype) raise before any write.
bool fill(const c10::List<std::optional<at::Tensor>>& grads, at::IntArrayRef members,
          at::TensorList params, at::TensorList views, at::IntArrayRef offsets, at::Tensor out) {
  const size_t n = members.size();
  TORCH_CHECK(params.size() == n && views.size() == n && offsets.size() == n,
              "distopt_flat::fill: ", n, " members but ", params.size(), " params, ",
              views.size(), " views and ", offsets.size(), " offsets");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "distopt_flat::fill: out must be a 1-D "
              "contiguous buffer, got sizes ", out.sizes(), " and strides ", out.strides());
  const int64_t count = static_cast<int64_t>(grads.size());
  const int64_t total = out.numel();
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = members[k];
    TORCH_CHECK(i >= 0 && i < count, "distopt_flat::fill: member index ", i, " for ", count,
                " gradients");
    const at::Tensor& v = views[k];
    TORCH_CHECK(v.scalar_type() == out.scalar_type(), "distopt_flat::fill: member ", k, " of ",
                v.scalar_type(), " in a buffer of ", out.scalar_type());
    const int64_t numel = v.numel();
    // Written so that no sum can overflow: 0 <= offset <= total - numel.
    TORCH_CHECK(offsets[k] >= 0 && numel <= total && offsets[k] <= total - numel,
                "distopt_flat::fill: member ", k, " at ", offsets[k], " (", numel,
                " elements) outside the buffer of ", total);
  }
  const auto& out_storage = out.storage();
  std::vector<at::Tensor> gs;
  gs.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    std::optional<at::Tensor> g = grads.get(members[k]);
    if (!g.has_value() || !g->defined()) {
      return false;
    }
    const at::Tensor& v = views[k];
    if (g->layout() != at::kStrided || g->scalar_type() != v.scalar_type() ||
        g->device() != v.device() || g->sizes() != v.sizes() || !params[k].is_set_to(v)) {
      return false;
    }
    // A tensor subclass (Python dispatch) or a tensor without memory of its own: let the
    // per-parameter path (ATen's own ops) take it.
    if (g->key_set().has(c10::DispatchKey::Python) || !g->has_storage() ||
        (g->numel() > 0 && g->const_data_ptr() == nullptr)) {
      return false;
    }
    // A gradient that is a view of the flat gradient buffer itself: copying in place would
    // read what an earlier copy wrote.
    if (g->storage().is_alias_of(out_storage)) {
      return false;
    }
    gs.push_back(std::move(*g));
  }
  const bool cpu = out.is_cpu();
  if (!cpu) {
    // On a GPU a copy per member is a kernel launch per member (10,000 for 10,000 small
    // parameters); the members lie back to back in buffer order, so one cat fills ``out``.
    bool back_to_back = true;
    int64_t end = 0;
    std::vector<at::Tensor> rows;
    rows.reserve(n);
    for (size_t k = 0; k < n; ++k) {
      if (offsets[k] != end) {
        back_to_back = false;
        break;
      }
      end += gs[k].numel();
      rows.push_back(gs[k].reshape({-1}));
    }
    if (back_to_back && end == out.numel()) {
      at::cat_out(out, rows, 0);
      return true;
    }
  }
  const int64_t item = out.element_size();
  char* base = cpu ? static_cast<char*>(out.data_ptr()) : nullptr;
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor& g = gs[k];
    const int64_t numel = g.numel();
    if (cpu && g.is_cpu() && g.is_contiguous() && !g.is_conj() && !g.is_neg()) {
      std::memcpy(base + offsets[k] * item, g.const_data_ptr(), static_cast<size_t>(numel * item));
    } else {
      out.narrow(0, offsets[k], numel).view(g.sizes()).copy_(g);
    }
  }
  return true;
}

// ``[grads.get(p) for p in params]``: the gradient of each parameter in an autograd
// context's dict (keyed by tensor identity, as TorchScript's dict is), or None.
c10::List<std::optional<at::Tensor>> lookup(const c10::Dict<at::Tensor, at::Tensor>& grads,
                                             at::TensorList params) {
  c10::List<std::optional<at::Tensor>> found;
  found.reserve(params.size());
  for (const at::Tensor& p : params) {
    auto it = grads.find(p);
    if (it == grads.end()) {
      found.push_back(std::nullopt);
    } else {
      found.push_back(it->value());
    }
  }
  return found;
}

// Before an owner's step, ``check_step(Tensor[] params, Tensor?[] grads, int kind) ->
// (int, int[])``: (the position of the first gradient that a class taking gradients of
// ``kind`` (0: strided only, 1: sparse COO only, 2: either) refuses before its step, being
// of another layout, shape, dtype or device than its parameter, or -1; for each parameter
// with a gradient (one the step updates) its autograd version counter, else -1). A None
// gradient fits; an inference tensor has no counter: 0, and ``bump_versions`` leaves it.
// Boxed, as ``bump_versions``: it reads the interpreter's lists in place, where an unboxed
// kernel would copy each optional gradient (12 instead of 22 ns a parameter, measured).
void check_step(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const int64_t kind = torch::jit::peek(*stack, 2, 3).toInt();
  const auto& grads = torch::jit::peek(*stack, 1, 3).toListRef();
  const auto& params = torch::jit::peek(*stack, 0, 3).toListRef();
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "distopt_flat::check_step: ", n, " params but ",
              grads.size(), " gradients");
  int64_t misfit = -1;
  c10::List<int64_t> before;
  before.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& gradient = grads[i];
    if (gradient.isNone() || !gradient.toTensor().defined()) {
      before.push_back(-1);
      continue;
    }
    const at::Tensor& g = gradient.toTensor();
    const at::Tensor& p = params[i].toTensor();
    before.push_back(p.is_inference() ? 0 : p._version());
    if (misfit >= 0) {
      continue;
    }
    const auto layout = g.layout();
    const bool layout_fits = layout == at::kStrided  ? kind != 1
                             : layout == at::kSparse ? kind != 0
                                                     : false;
    if (!layout_fits || g.sizes() != p.sizes() || g.scalar_type() != p.scalar_type() ||
        g.device() != p.device()) {
      misfit = static_cast<int64_t>(i);
    }
  }
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, misfit, std::move(before));
}

// After the step, ``bump_versions(Tensor(a!)[] params, int[] before) -> ()``: bump the
// version counter of each ``params[i]`` that it updated (``before[i]``, from ``check_step``,
// is not -1) and left at ``before[i]``, as torch.optim's in-place update bumps it. Kernels
// that bumped it already (foreach ops) keep their count; those that write through a data
// pointer (torch's fused kernels, distopt_kernels, a flat buffer's kernel, which changes its
// members through the buffer) get one bump.
void bump_versions(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const auto& before = torch::jit::peek(*stack, 1, 2).toListRef();
  const auto& params = torch::jit::peek(*stack, 0, 2).toListRef();
  const size_t n = params.size();
  TORCH_CHECK(before.size() == n, "distopt_flat::bump_versions: ", n, " params but ",
              before.size(), " versions");
  for (size_t i = 0; i < n; ++i) {
    const int64_t version = before[i].toInt();
    const at::Tensor& p = params[i].toTensor();
    if (version >= 0 && !p.is_inference() && p._version() == version) {
      p.unsafeGetTensorImpl()->bump_version();
    }
  }
  torch::jit::drop(*stack, 2);
}

}  // namespace

TORCH_LIBRARY(distopt_flat, m) {
  m.def("fill(Tensor?[] grads, int[] members, Tensor[] params, Tensor[] views, int[] offsets, "
        "Tensor(a!) out) -> bool",
        &fill);
  m.def("lookup(Dict(Tensor, Tensor) grads, Tensor[] params) -> Tensor?[]", &lookup);
  m.def("check_step(Tensor[] params, Tensor?[] grads, int kind) -> (int, int[])",
        torch::CppFunction::makeFromBoxedFunction<&check_step>());
  // ``(a!)``: a call that returns nothing and mutates nothing would be removed by
  // TorchScript as dead code.
  m.def("bump_versions(Tensor(a!)[] params, int[] before) -> ()",
        torch::CppFunction::makeFromBoxedFunction<&bump_versions>());
}
