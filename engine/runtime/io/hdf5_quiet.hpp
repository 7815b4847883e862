// ds — HDF5 prints its own error stack to stderr on every failed call; ds reports failures itself,
// naming the file, so every HDF5 user here silences the library first.
#pragma once

#include <hdf5.h>

namespace ds {
inline void quiet_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
}  // namespace ds
