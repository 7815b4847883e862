// ds — how much memory this process holds, from the kernel's own accounts (no LibTorch).
#pragma once

namespace ds {

// Resident now (/proc/self/statm); 0 when unreadable.
double resident_bytes();
// The resident pages backed by files (RssFile in /proc/self/status): the code of ds and its libraries as it
// first runs, and mapped files (token files). They can be dropped and read again; the plan does not count
// them. 0 when unreadable.
double resident_file_bytes();
// The resident pages of code generated at run time: anonymous executable mappings (oneDNN's JIT kernels,
// written in the first step, ~3 MiB for fp32 products). Counted with the code, not as training memory.
double resident_generated_code_bytes();
// Both of the above: what the peak memory line sets apart from training as "code and files".
double resident_code_and_file_bytes();
// The process's peak resident memory (getrusage).
double peak_resident_bytes();
// The most resident since the last restart_peak_resident (VmHWM in /proc/self/status); 0 when unreadable.
double peak_resident_since_restart();
// Starts a new high-water mark at the current resident size ("5" to /proc/self/clear_refs). False where
// that is not allowed; peaks then count from the process's start. It also lowers what getrusage reports.
bool restart_peak_resident();

}  // namespace ds
