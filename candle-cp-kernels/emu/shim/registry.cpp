// Kernel registry of the host CUDA shim (registry.h).
#include "registry.h"

#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace cp_emu {
namespace {
struct Entry {
  Thunk thunk;
  size_t n_params;
};
// Function-local statics: registrations run from other translation units' static initializers.
std::map<std::string, Entry>& table() {
  static std::map<std::string, Entry> t;
  return t;
}
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

void register_kernel(const char* name, Thunk thunk, size_t n_params) {
  std::lock_guard<std::mutex> g(table_mutex());
  auto [it, fresh] = table().emplace(name, Entry{thunk, n_params});
  if (!fresh && it->second.thunk != thunk) std::fprintf(stderr, "cpemu: kernel entry %s registered twice\n", name);
}

Thunk find_kernel(const char* name, size_t* n_params) {
  std::lock_guard<std::mutex> g(table_mutex());
  auto it = table().find(name);
  if (it == table().end()) return nullptr;
  if (n_params) *n_params = it->second.n_params;
  return it->second.thunk;
}

}  // namespace cp_emu
