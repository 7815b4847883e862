// ds — training metrics for other tools, in DeepSpeed's monitor layouts (reference §1.11), written by
// rank 0 under <output_path>/<job_name>/ (output_path "" means the working directory, as in DeepSpeed):
//   csv_monitor:  one CSV per metric, named by the metric with '/' and ' ' turned into '_'
//                 (Train_Samples_lr.csv), header "step,<last name segment>", then "step,value" rows.
//   tensorboard:  an events.out.tfevents.* file of scalar summaries (TFRecord framing, CRC32C), which
//                 TensorBoard and tbparse read; written without TensorFlow or protobuf.
// The x axis is DeepSpeed's: global samples seen. metrics.jsonl (the run directory) is always written
// by the trainer; these are extra sinks.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

struct MetricEvent {
  std::string name;  // "Train/Samples/lr"
  double value = 0;
  int64_t step = 0;  // global samples
};

class MetricSink {
 public:
  virtual ~MetricSink() = default;
  virtual void write(const std::vector<MetricEvent>& events) = 0;
};

class CsvMonitor : public MetricSink {
 public:
  explicit CsvMonitor(std::string dir);
  void write(const std::vector<MetricEvent>& events) override;

 private:
  std::string dir_;
  std::map<std::string, std::ofstream> files_;
};

class TensorBoardMonitor : public MetricSink {
 public:
  explicit TensorBoardMonitor(const std::string& dir);
  void write(const std::vector<MetricEvent>& events) override;
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event_bytes);
  std::string path_;
  std::ofstream out_;
};

// The sinks the config enables (possibly none). Throws UserError when a directory cannot be created.
std::vector<std::unique_ptr<MetricSink>> open_monitors(const RunSettings& run);

// CRC-32C (Castagnoli), and TFRecord's masked form of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

}  // namespace ds
