#include "shardlab/course/blas.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

namespace shardlab {
namespace {

// OpenBLAS's own entry points, looked up at run time: shardlab links libblas.so.3 through libtorch only, and which
// library that is depends on the system alternative (see Note [BLAS threads per rank]).
template <typename Fn>
Fn openblas(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

std::string blas_description() {
  if (auto config = openblas<char* (*)()>("openblas_get_config")) {  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
    const std::string c = config();
    return c.rfind("OpenBLAS", 0) == 0 ? c : "OpenBLAS " + c;
  }
  std::error_code ec;
  const std::string lib = std::filesystem::canonical("/usr/lib/x86_64-linux-gnu/libblas.so.3", ec).string();
  if (ec || lib.find("/blas/") != std::string::npos) return "reference BLAS (netlib)";
  return "BLAS at " + lib;
}

bool set_blas_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_blas_threads: expected at least 1 thread; got " + std::to_string(n));
  auto set = openblas<void (*)(int)>("openblas_set_num_threads");
  if (set == nullptr) return false;
  set(n);
  return true;
}

int blas_threads() {
  auto get = openblas<int (*)()>("openblas_get_num_threads");
  return get == nullptr ? 1 : get();
}

}  // namespace shardlab
