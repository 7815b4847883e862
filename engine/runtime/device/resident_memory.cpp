#include "engine/runtime/device/resident_memory.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ds {

double resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

double peak_resident_bytes() {
  rusage usage{};
  return getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<double>(usage.ru_maxrss) * 1024.0 : 0.0;
}

namespace {
// A "Name:   N kB" line of /proc/self/status, in bytes; 0 when missing.
double status_kib(const std::string& name) {
  std::ifstream f("/proc/self/status");
  const std::string key = name + ":";
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key, 0) == 0) return std::strtod(line.c_str() + key.size(), nullptr) * 1024.0;
  return 0;
}
}  // namespace

double resident_file_bytes() { return status_kib("RssFile"); }

double resident_generated_code_bytes() {
  const long page = sysconf(_SC_PAGESIZE);
  std::ifstream maps("/proc/self/maps");
  double bytes = 0;
  std::vector<unsigned char> in_core;
  for (std::string line; std::getline(maps, line);) {
    // "start-end perms offset dev inode [path]": executable, and no path (not a file, not [vdso]).
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode, path;
    fields >> range >> perms >> offset >> dev >> inode >> path;
    if (perms.size() < 3 || perms[2] != 'x' || !path.empty()) continue;
    const unsigned long start = std::strtoul(range.c_str(), nullptr, 16);
    const unsigned long end = std::strtoul(range.c_str() + range.find('-') + 1, nullptr, 16);
    const std::size_t pages = (end - start) / static_cast<unsigned long>(page);
    in_core.assign(pages, 0);
    if (mincore(reinterpret_cast<void*>(start), end - start, in_core.data()) != 0) continue;
    for (unsigned char c : in_core) bytes += (c & 1) ? static_cast<double>(page) : 0.0;
  }
  return bytes;
}

double resident_code_and_file_bytes() { return resident_file_bytes() + resident_generated_code_bytes(); }

double peak_resident_since_restart() { return status_kib("VmHWM"); }

bool restart_peak_resident() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace ds
