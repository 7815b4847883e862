#include "engine/runtime/resident_memory.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

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

double peak_resident_since_restart() { return status_kib("VmHWM"); }

bool restart_peak_resident() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace ds
