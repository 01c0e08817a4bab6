#pragma once
// Which BLAS libtorch computes with, and how many threads it may use. See Note [BLAS threads per rank].
#include <string>

namespace shardlab {

// Note [BLAS threads per rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Debian's libtorch does its matrix products in whatever libblas.so.3 the system alternative points to: the
// reference (netlib) BLAS, or OpenBLAS once libopenblas0-pthread is installed (tools/install-deps installs it;
// about 4x faster on the tiny GPT). OpenBLAS starts one thread per core in every process, so N ranks on one
// machine would run N x cores threads and slow each other down (a 2-rank DDP step went from 10 ms to 90 ms).
// As torchrun does, shardlab-run gives every rank OMP_NUM_THREADS=1 when it is not set (OpenBLAS reads it too),
// the tests run with OMP_NUM_THREADS=1, and `shardlab --threads N` sets both libtorch's and OpenBLAS's threads.

/// The BLAS this process computes with: OpenBLAS's own description ("OpenBLAS 0.3.21 DYNAMIC_ARCH ...") when
/// OpenBLAS is loaded, otherwise
/// "reference BLAS (netlib)" (or what libblas.so.3 resolves to, when that is neither).
std::string blas_description();

/// Sets how many threads OpenBLAS may use (n >= 1); returns false, changing nothing, when the BLAS is not OpenBLAS.
bool set_blas_threads(int n);

/// How many threads OpenBLAS may use now; 1 for a BLAS without threads.
int blas_threads();

}  // namespace shardlab
