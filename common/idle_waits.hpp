// How idle worker threads wait: the settings ds train and ds profile start with (cli/main.cpp sets
// them before the libraries that read them load) and the start-up line names (run_report.cpp).
//  - libgomp's threads that finish their share of a parallel region spin 300,000 rounds before they
//    sleep: beside another busy process a GPT-2 6x384 bf16 run fell 2.3-3.2x with that spin, 1.6-1.7x
//    with 1000, no slower on a quiet machine.
//  - OpenBLAS's own worker threads (the pthreads build runs LibTorch's fp32 products; ds's layers run
//    theirs through oneDNN where built with it, engine/runtime/model/matmul.hpp) spin and yield
//    for 2^28 cycles after each product, through ds's OpenMP kernels between products; 2^4 makes them
//    sleep at once: GPT-2 6x384 fp32 on 2 cores, 13 of 13 interleaved pairs faster, the median step
//    4-7% shorter (bench/RESULTS.md).
#pragma once

namespace ds {

struct IdleWait {
  const char* variable;      // what ds sets, unless the user set it or `user_choice`
  const char* value;
  const char* user_choice;   // another variable by which the user chose already (or nullptr)
};

inline constexpr IdleWait kIdleWaits[] = {
    {"GOMP_SPINCOUNT", "1000", "OMP_WAIT_POLICY"},
    {"OPENBLAS_THREAD_TIMEOUT", "4", nullptr},
};

}  // namespace ds
