#include "engine/runtime/device/kernel_trace.hpp"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#ifdef DS_WITH_CUPTI
#include <cupti_activity.h>
#include <cupti_version.h>
#include <dlfcn.h>
#endif

namespace ds {

std::string short_kernel_name(const std::string& name) {
  if (name.rfind("_Z", 0) != 0) return name;  // not a mangled C++ name: cuBLAS's, a C kernel's
  int status = 0;
  char* demangled = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  if (status != 0 || !demangled) {
    std::free(demangled);
    return name;
  }
  std::string s = demangled;
  std::free(demangled);
  // A namespace spelled with parentheses would end the name at the parameter list's test below.
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = s.find(anonymous)) != std::string::npos;) s.erase(at, anonymous.size());
  std::string out;
  int depth = 0;
  for (const char c : s) {
    if (depth == 0 && c == '(') break;  // the parameter list
    if (c == '<') {
      if (depth++ == 0) out += "<...>";
    } else if (c == '>') {
      depth = std::max(0, depth - 1);
    } else if (depth == 0) {
      out += c;
    }
  }
  if (out.rfind("void ", 0) == 0) out.erase(0, 5);  // a kernel's return type
  return out;
}

namespace {

std::vector<KernelTime> sorted(std::map<std::string, KernelTime>& by_name) {
  std::vector<KernelTime> out;
  out.reserve(by_name.size());
  for (auto& [name, t] : by_name) out.push_back(std::move(t));
  std::stable_sort(out.begin(), out.end(), [](const KernelTime& a, const KernelTime& b) { return a.seconds > b.seconds; });
  return out;  // (a map's order: ties by name)
}

void add_to(std::map<std::string, KernelTime>& by_name, const std::string& name, double launches, double seconds, double bytes) {
  KernelTime& t = by_name[name];
  t.name = name;
  t.launches += launches;
  t.seconds += seconds;
  t.bytes += bytes;
}

}  // namespace

std::vector<KernelTime> kernel_totals(const std::vector<KernelRun>& runs) {
  std::map<std::string, KernelTime> by_name;
  std::map<std::string, std::string> short_of;  // a step launches the same few names thousands of times
  for (const KernelRun& r : runs) {
    auto known = short_of.find(r.name);
    if (known == short_of.end()) known = short_of.emplace(r.name, short_kernel_name(r.name)).first;
    add_to(by_name, known->second, 1, r.end_ns > r.start_ns ? static_cast<double>(r.end_ns - r.start_ns) * 1e-9 : 0.0,
           static_cast<double>(r.bytes));
  }
  return sorted(by_name);
}

std::vector<KernelTime> mean_kernel_times(const std::vector<std::vector<KernelTime>>& per_step, int64_t steps) {
  std::map<std::string, KernelTime> by_name;
  for (const auto& step : per_step)
    for (const KernelTime& k : step) add_to(by_name, k.name, k.launches, k.seconds, k.bytes);
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  for (auto& [name, t] : by_name) {
    t.launches /= n;
    t.seconds /= n;
    t.bytes /= n;
  }
  return sorted(by_name);
}

std::string copy_name(CopyWay way, HostMemory host) {
  const char* memory = host == HostMemory::pageable ? ", pageable" : host == HostMemory::page_locked ? ", page-locked" : "";
  switch (way) {
    case CopyWay::host_to_device: return std::string("host to device") + memory;
    case CopyWay::device_to_host: return std::string("device to host") + memory;
    case CopyWay::device_to_device: return "device to device";
    case CopyWay::other: break;
  }
  return std::string("other") + memory;
}

#ifdef DS_WITH_CUPTI
namespace {

// CUPTI's entry points, from the library loaded at the first trace.
struct CuptiApi {
  decltype(&cuptiGetVersion) get_version = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
};

CuptiApi g_api;
std::mutex g_mutex;            // CUPTI hands buffers back on its own thread too
std::vector<KernelRun> g_runs;  // completed since the last take
std::vector<KernelRun> g_copies;  // the copies completed since the last take
bool g_tracing = false;

// The library CUDA LibTorch already loaded (one CUPTI in a process), else the toolkit's.
void* open_cupti(std::string* tried) {
  const std::string soname = "libcupti.so." + std::to_string(CUDA_VERSION / 1000);
  for (const std::string& name : {soname, std::string("libcupti.so")})
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD)) return h;
  for (const std::string& name : {soname, "/usr/local/cuda/lib64/" + soname, "/usr/local/cuda/lib/" + soname,
                                  "/usr/local/cuda/extras/CUPTI/lib64/" + soname}) {
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += (tried->empty() ? "" : ", ") + name;
  }
  return nullptr;
}

std::string load_api() {
  if (g_api.next_record) return "";
  std::string tried;
  void* lib = open_cupti(&tried);
  if (!lib) return "CUPTI could not be loaded (tried " + tried + "): put the CUDA toolkit's libcupti on LD_LIBRARY_PATH";
  CuptiApi api;
  const auto find = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    return fn != nullptr;
  };
  if (!(find(api.get_version, "cuptiGetVersion") && find(api.result_string, "cuptiGetResultString") &&
        find(api.register_callbacks, "cuptiActivityRegisterCallbacks") && find(api.enable, "cuptiActivityEnable") &&
        find(api.disable, "cuptiActivityDisable") && find(api.flush_all, "cuptiActivityFlushAll") &&
        find(api.next_record, "cuptiActivityGetNextRecord")))
    return "the CUPTI library loaded lacks the activity API";
  uint32_t version = 0;
  // Kernel records are read as this build's CUpti_ActivityKernel10 (its start, end and name where every kernel
  // record since the fourth has them): a CUPTI of the same CUDA major version writes it. (From CUDA 13 on the API
  // version is the major x 10000 + the rest; builds here are against 13.)
  if (api.get_version(&version) != CUPTI_SUCCESS || version / 10000 != CUPTI_API_VERSION / 10000)
    return "the CUPTI library loaded is API version " + std::to_string(version) + ", of another CUDA than this build's " +
           std::to_string(CUPTI_API_VERSION);
  g_api = api;
  return "";
}

std::string failure(CUptiResult r) {
  const char* s = nullptr;
  g_api.result_string(r, &s);
  return s ? s : "CUPTI error " + std::to_string(static_cast<int>(r));
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t{8} << 20;  // about 40,000 kernel records
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;  // as many as fit
}

// A copy record's way and host memory, by name.
std::string copy_record_name(const CUpti_ActivityMemcpy6& c) {
  const auto host_memory = [](uint8_t kind) {
    if (kind == CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE) return HostMemory::pageable;
    if (kind == CUPTI_ACTIVITY_MEMORY_KIND_PINNED) return HostMemory::page_locked;
    return HostMemory::none;
  };
  switch (c.copyKind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return copy_name(CopyWay::host_to_device, host_memory(c.srcKind));
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return copy_name(CopyWay::device_to_host, host_memory(c.dstKind));
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return copy_name(CopyWay::device_to_device, HostMemory::none);
    default: return copy_name(CopyWay::other, HostMemory::none);
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    CUpti_Activity* record = nullptr;
    while (g_api.next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (!g_tracing) continue;
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        g_runs.push_back({k->name ? k->name : "(unnamed)", k->start, k->end});
      } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
        const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        g_copies.push_back({copy_record_name(*c), c->start, c->end, c->bytes});
      }
    }
  }
  std::free(buffer);
}

class CuptiTrace : public KernelTrace {
 public:
  ~CuptiTrace() override {
    g_api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    g_api.disable(CUPTI_ACTIVITY_KIND_MEMCPY);
    g_api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_tracing = false;
    g_runs.clear();
    g_copies.clear();
  }
  std::vector<KernelRun> take() override {
    g_api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // (hands back buffers of records already complete)
    std::lock_guard<std::mutex> lock(g_mutex);
    taken_copies_ = std::exchange(g_copies, {});
    return std::exchange(g_runs, {});
  }
  std::vector<KernelRun> take_copies() override { return std::exchange(taken_copies_, {}); }

 private:
  std::vector<KernelRun> taken_copies_;
};

}  // namespace

std::unique_ptr<KernelTrace> KernelTrace::start(std::string* why_not) {
  if (g_tracing) {
    *why_not = "a kernel trace is already running in this process";
    return nullptr;
  }
  if (std::string why = load_api(); !why.empty()) {
    *why_not = why;
    return nullptr;
  }
  static bool registered = false;
  if (!registered) {
    if (const CUptiResult r = g_api.register_callbacks(buffer_requested, buffer_completed); r != CUPTI_SUCCESS) {
      *why_not = "CUPTI refused its buffers: " + failure(r);
      return nullptr;
    }
    registered = true;
  }
  if (const CUptiResult r = g_api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL); r != CUPTI_SUCCESS) {
    *why_not = "CUPTI refused to trace kernels (" + failure(r) +
               (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED ? ": another profiler, such as nsys or ncu, holds it)" : ")");
    return nullptr;
  }
  if (const CUptiResult r = g_api.enable(CUPTI_ACTIVITY_KIND_MEMCPY); r != CUPTI_SUCCESS) {
    g_api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    *why_not = "CUPTI refused to trace copies (" + failure(r) + ")";
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_runs.clear();
    g_copies.clear();
    g_tracing = true;
  }
  return std::make_unique<CuptiTrace>();
}

#else

std::unique_ptr<KernelTrace> KernelTrace::start(std::string* why_not) {
  *why_not = "this build has no CUDA toolkit's CUPTI (kernels are listed by a build where the toolkit's cupti_activity.h is found)";
  return nullptr;
}

#endif

}  // namespace ds
