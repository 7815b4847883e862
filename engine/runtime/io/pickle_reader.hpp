// ds — a bounded reader of the pickles inside torch.save files, which never runs what a pickle names.
// Python's torch.load executes any callable a pickle carries; this reader builds values only: None, bools,
// ints, floats, strings, bytes, lists, tuples, dicts, sets, and the few torch and DeepSpeed globals a
// checkpoint records — tensors (torch._utils._rebuild_tensor_v2 over a storage named by a persistent
// id), OrderedDict, torch.Size, and DeepSpeed's LossScaler, fragment_address and ZeroStageEnum as plain
// records. Any other global is refused by name before anything is built. Opcodes are those of protocols
// 2-4 that torch.save emits (and a few neighbours); limits on size, nesting, values and memo entries
// make hostile input an error naming the file and the byte offset, never a crash or a hang
// (fuzz/fuzz_torch_pickle.cpp). Values live in the Pickle that read them and refer to each other by
// pointer, so shared and even cyclic references cost nothing and are never walked without a depth bound.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/runtime/io/safetensors.hpp"

namespace ds {

enum class PyKind { none, boolean, integer, real, string, bytes, list, tuple, dict, set, global, storage, tensor, object };

struct PyValue {
  PyKind kind = PyKind::none;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  // A string's or bytes' contents; a global's "module.name"; an object's class ("module.name").
  std::string text;
  std::vector<const PyValue*> items;                               // list, tuple, set
  std::vector<std::pair<const PyValue*, const PyValue*>> entries;  // dict, in insertion order
  const PyValue* state = nullptr;                                  // object: what BUILD gave it (a dict)
  // storage: its member key, element type and element count; tensor: its storage and view.
  std::string storage_key;
  StDtype dtype = StDtype::F32;
  int64_t storage_numel = 0;
  const PyValue* storage = nullptr;
  int64_t offset = 0;
  std::vector<int64_t> shape, stride;

  bool is(PyKind k) const { return kind == k; }
  // A dict's (or an object state's) value under a string key; nullptr when absent. The last entry wins.
  const PyValue* get(const std::string& key) const;
  int64_t numel() const;      // a tensor's element count
  bool contiguous() const;    // a tensor whose elements are consecutive in its storage
  const char* kind_name() const;
};

class Pickle {
 public:
  // Reads `bytes` (a data.pkl); UserError naming `source` and the offset on anything outside what ds reads.
  Pickle(const std::string& bytes, const std::string& source);
  const PyValue& root() const { return *root_; }
  const std::string& source() const { return source_; }
  std::vector<const PyValue*> storages() const;  // every storage the pickle names, once each

 private:
  friend class PickleMachine;
  std::vector<std::unique_ptr<PyValue>> values_;
  const PyValue* root_ = nullptr;
  std::string source_;
};

// A value as JSON (a DeepSpeed checkpoint's ds_config): dicts with string keys, lists, numbers, strings.
// Anything else (a tensor, an object) becomes a string naming it; nesting beyond 64 levels is a UserError.
nlohmann::json pickle_to_json(const PyValue& v, const std::string& source);

}  // namespace ds
