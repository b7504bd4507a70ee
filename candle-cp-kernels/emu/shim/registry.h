// Kernel registry of the host CUDA shim (emu/shim/): every `extern "C"` kernel entry of a source
// compiled for the shim registers itself by name, so that cuModuleGetFunction(name) finds it and
// cuLaunchKernel unpacks the driver's `void** kernelParams` into a call with the entry's own
// parameter types. The registrations are appended to each preprocessed kernel file by reg.py
// (one `CP_EMU_REGISTER(entry)` per entry definition); see docs/gpu.md ("The host CUDA shim").
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

namespace cp_emu {

// Calls an entry with its parameters taken from the driver's kernelParams array (one pointer
// per parameter, pointing at the argument's value, as cuLaunchKernel passes them).
using Thunk = void (*)(void** params);

// Adds an entry (called from static initializers; a second entry with the same name is an error
// reported when the shim starts).
void register_kernel(const char* name, Thunk thunk, size_t n_params);
// The entry registered under `name`, or nullptr. `n_params` receives its parameter count.
Thunk find_kernel(const char* name, size_t* n_params);

template <typename... A, size_t... I>
inline void call_unpacked(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}
template <typename F> struct Arity;
template <typename... A> struct Arity<void (*)(A...)> { static constexpr size_t value = sizeof...(A); };

template <auto F> void thunk(void** p) { call_unpacked(F, p, std::make_index_sequence<Arity<decltype(F)>::value>{}); }

struct KernelReg {
  KernelReg(const char* name, Thunk t, size_t n) { register_kernel(name, t, n); }
};

}  // namespace cp_emu

#define CP_EMU_REGISTER(entry) \
  static ::cp_emu::KernelReg cp_emu_reg_##entry(#entry, &::cp_emu::thunk<&entry>, ::cp_emu::Arity<decltype(&entry)>::value);
