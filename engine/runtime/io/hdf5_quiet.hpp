// ds — HDF5 prints its own error stack to stderr on every failed call; ds reports failures itself,
// naming the file, so every HDF5 user here silences the library first.
#pragma once

#include <hdf5.h>

namespace ds {
// Silences the calling thread's error stack (the library is thread-safe: each thread has its own), and clears it
// when the thread ends: a failed call's stack left in a thread that ended (a thread rank of a test) keeps HDF5 from
// closing at the process's exit, which it then says in a line of its own ("infinite loop closing library").
inline void quiet_hdf5() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  thread_local struct ClearedAtThreadExit {
    ~ClearedAtThreadExit() { H5Eclear2(H5E_DEFAULT); }
  } cleared;
  (void)cleared;
}
}  // namespace ds
