// ds — what the hardware a plan is made for can do: the GPU models ds knows (memory, peak matmul rates, the
// link between the GPUs of one node) and the links between ranks, by name. The one place these figures live:
// the time prediction (engine/plan/step_time.hpp) reads them from the Topology, which takes them from
// --gpu, a detected GPU's name, --intra-node-link / --inter-node-link, --mfu and offload's --host-link,
// --host-memory-bw and --nvme-bw.
//
// A link's rate is NCCL's bus bandwidth ("busbw" in nccl-tests): what one rank's share of a large ring
// collective moves per second, so a collective of payload S takes S x factor / busbw, the factor 2 (n - 1) / n
// for an all-reduce and (n - 1) / n for a reduce-scatter or an all-gather (the plan's wire bytes per rank).
// Figures are what such links sustain, not their line rates: NVLink 4's 450 GB/s a direction carries about
// 370 GB/s of busbw through NCCL's protocol (ring; NVLink SHARP all-reduces reach more), InfiniBand about 90%
// of the NIC's rate. Named network links assume one NIC per GPU (as DGX H100 has); with fewer, give a rate.
// A group across nodes runs one ring per NIC: with k of its ranks on each node, k NICs carry it, so its busbw is
// min(the node's link, k x the network's per GPU) (step_time.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ds {

struct Link {
  std::string name;          // "nvlink4", "ib-ndr", or the rate as given ("100GB/s"); "" unknown
  double busbw = 0;          // bytes per second per rank, large messages; 0 unknown
  double latency_s = 0;      // added once per call: a small message's time
  bool known() const { return busbw > 0; }
};

// The links ds knows by name, in the order --help lists them.
const std::vector<Link>& known_links();
// A GPU's copies to and from its host's pinned memory, per direction, by name ("pcie5": about 50 GB/s; "pcie4":
// about 25 GB/s: what pinned copies sustain of x16's 64 and 32 GB/s) or by rate in bytes ("50GB/s"). nullopt: neither.
std::optional<Link> host_link_from_text(const std::string& text);
// "pcie5, pcie4" for messages.
std::string known_host_link_names();
// A rate in bytes a second ("200GB/s", "6.5GiB/s"), for memory and drives. nullopt: not one.
std::optional<double> byte_rate_from_text(const std::string& text);

// A link by name ("nvlink4") or by rate ("300GB/s", "25GiB/s", "400Gb/s": bits, the NIC's line rate, taken at
// 90%). `network`: a rate given across nodes takes the network's latency, else NVLink's. nullopt: neither.
std::optional<Link> link_from_text(const std::string& text, bool network);
// "nvlink4, nvlink3, ..." for messages.
std::string known_link_names();

struct GpuModel {
  std::string name;            // "h100", the --gpu spelling
  std::string label;           // "H100 SXM 80GB"
  std::vector<std::string> matches;  // lower-case pieces of nvidia-smi's name that identify it, all present
  double memory_bytes = 0;     // as the driver reports it
  double peak_flops_16bit = 0; // dense bf16/fp16 matmul with fp32 accumulation
  double peak_flops_fp32 = 0;  // fp32 without TF32 (LibTorch's default for fp32 matmuls)
  std::string intra_node_link; // the link between the GPUs of one node, a known_links() name
  std::string host_link;       // the link to its host's memory, a host_link_from_text() name
};
const std::vector<GpuModel>& known_gpus();
// The model by its --gpu name, or nullopt.
const GpuModel* gpu_by_name(const std::string& name);
// The model nvidia-smi's name ("NVIDIA H100 80GB HBM3") is, or nullptr.
const GpuModel* gpu_from_device_name(const std::string& device_name);
std::string known_gpu_names();

// The share of the peak matmul rate a step reaches (model FLOPs / time / peak) when --mfu is not given: what ds
// measured on one H200 (0.39 for GPT-2 124M, 0.46 for GPT-2 1.5B and TinyLlama 1.1B).
inline constexpr double kAssumedMfu = 0.45;

// What the machine a plan is made for can do, as far as it is known (0 / unknown links: not known). The
// Topology carries it; the time prediction says what is missing rather than guess.
struct HardwareRates {
  std::string gpu;               // a known GpuModel's label, "" none
  double peak_flops_16bit = 0;   // per rank
  double peak_flops_fp32 = 0;
  double mfu = kAssumedMfu;
  bool mfu_given = false;        // --mfu (else kAssumedMfu)
  Link intra_node, inter_node;
  // Offload (step_time.cpp): a GPU's copies to and from its host (--host-link, else the GPU's PCIe), per GPU; the
  // bytes a second a node's memory streams (--host-memory-bw: the optimizer's step on the host) and its drives
  // under nvme_path read or write (--nvme-bw), each shared by the node's ranks. 0 / unknown: not known.
  Link host_link;
  double host_memory_bw = 0, nvme_bw = 0;
};

}  // namespace ds
