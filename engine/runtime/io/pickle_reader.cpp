#include "engine/runtime/io/pickle_reader.hpp"

#include <cstring>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "common/error.hpp"

namespace ds {

const PyValue* PyValue::get(const std::string& key) const {
  const PyValue* d = kind == PyKind::object ? state : this;
  if (!d || d->kind != PyKind::dict) return nullptr;
  for (auto it = d->entries.rbegin(); it != d->entries.rend(); ++it)
    if (it->first->kind == PyKind::string && it->first->text == key) return it->second;
  return nullptr;
}

int64_t PyValue::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded when the tensor was built
  return n;
}

bool PyValue::contiguous() const {
  int64_t expect = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

const char* PyValue::kind_name() const {
  switch (kind) {
    case PyKind::none: return "None";
    case PyKind::boolean: return "bool";
    case PyKind::integer: return "int";
    case PyKind::real: return "float";
    case PyKind::string: return "str";
    case PyKind::bytes: return "bytes";
    case PyKind::list: return "list";
    case PyKind::tuple: return "tuple";
    case PyKind::dict: return "dict";
    case PyKind::set: return "set";
    case PyKind::global: return "class or function";
    case PyKind::storage: return "storage";
    case PyKind::tensor: return "tensor";
    case PyKind::object: return "object";
  }
  return "?";
}

namespace {

// Whether `s` is well-formed UTF-8 (what pickle's BINUNICODE holds; Python writes lone surrogates too, which
// no checkpoint key or config value needs).
bool valid_utf8(const char* s, size_t n) {
  for (size_t i = 0; i < n;) {
    const auto c = static_cast<uint8_t>(s[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t k = 1; k < len; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += len;
  }
  return true;
}

// Values and the references containers hold, each bounded: a value costs a few hundred bytes, a reference
// eight, so a hostile pickle stays under about a gigabyte however it shares and copies.
constexpr size_t kMaxValues = size_t{1} << 21, kMaxReferences = size_t{1} << 24, kMaxMarks = 4096, kMaxStack = size_t{1} << 22;

// The globals a checkpoint may name: what each becomes. Anything else is refused by name.
enum class Allowed { rebuild_tensor, rebuild_parameter, storage_class, ordered_dict, torch_size, set, getattr, zero_stage_enum, record_class, codecs_encode, torch_device };

struct AllowedGlobal {
  Allowed what;
  StDtype dtype = StDtype::F32;  // storage classes
};

const std::map<std::string, AllowedGlobal>& allowed_globals() {
  static const std::map<std::string, AllowedGlobal> table = {
      {"torch._utils._rebuild_tensor_v2", {Allowed::rebuild_tensor}},
      {"torch._utils._rebuild_parameter", {Allowed::rebuild_parameter}},
      {"torch.FloatStorage", {Allowed::storage_class, StDtype::F32}},
      {"torch.DoubleStorage", {Allowed::storage_class, StDtype::F64}},
      {"torch.HalfStorage", {Allowed::storage_class, StDtype::F16}},
      {"torch.BFloat16Storage", {Allowed::storage_class, StDtype::BF16}},
      {"torch.LongStorage", {Allowed::storage_class, StDtype::I64}},
      {"torch.IntStorage", {Allowed::storage_class, StDtype::I32}},
      {"torch.ShortStorage", {Allowed::storage_class, StDtype::I16}},
      {"torch.CharStorage", {Allowed::storage_class, StDtype::I8}},
      {"torch.ByteStorage", {Allowed::storage_class, StDtype::U8}},
      {"torch.BoolStorage", {Allowed::storage_class, StDtype::BOOL}},
      {"collections.OrderedDict", {Allowed::ordered_dict}},
      {"torch.Size", {Allowed::torch_size}},
      {"__builtin__.set", {Allowed::set}},
      {"builtins.set", {Allowed::set}},
      {"__builtin__.getattr", {Allowed::getattr}},
      {"builtins.getattr", {Allowed::getattr}},
      {"deepspeed.runtime.zero.config.ZeroStageEnum", {Allowed::zero_stage_enum}},
      {"deepspeed.runtime.fp16.loss_scaler.LossScaler", {Allowed::record_class}},
      {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", {Allowed::record_class}},
      {"deepspeed.utils.tensor_fragment.fragment_address", {Allowed::record_class}},
      {"_codecs.encode", {Allowed::codecs_encode}},
      {"torch.device", {Allowed::torch_device}},
  };
  return table;
}

}  // namespace

// The pickle virtual machine, restricted: a stack, a mark stack, a memo; values built in the Pickle's arena.
class PickleMachine {
 public:
  PickleMachine(Pickle& out, const std::string& bytes) : out_(out), p_(bytes) {}

  void run() {
    while (true) {
      if (at_ >= p_.size()) fail("the pickle ends without STOP");
      op_at_ = at_;
      const uint8_t op = static_cast<uint8_t>(p_[at_++]);
      switch (op) {
        case 0x80: take(1); break;                                     // PROTO
        case 0x95: take(8); break;                                     // FRAME: a length hint
        case '.': {                                                    // STOP
          out_.root_ = pop();
          return;
        }
        case '(': {
          if (marks_.size() >= kMaxMarks) fail("nesting deeper than " + std::to_string(kMaxMarks));
          marks_.push_back(stack_.size());
          break;
        }
        case '0': pop(); break;                                        // POP
        case '1': pop_mark(); break;                                   // POP_MARK
        case '2': push(top());  break;                                 // DUP
        case 'N': push(make(PyKind::none)); break;
        case 0x88: case 0x89: {                                        // NEWTRUE, NEWFALSE
          PyValue* v = make(PyKind::boolean);
          v->boolean = op == 0x88;
          push(v);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(le(4))); break;       // BININT
        case 'K': push_int(static_cast<int64_t>(le(1))); break;       // BININT1
        case 'M': push_int(static_cast<int64_t>(le(2))); break;       // BININT2
        case 0x8a: {                                                   // LONG1
          const uint64_t n = le(1);
          if (n > 8) fail("an integer of " + std::to_string(n) + " bytes (more than 64 bits)");
          uint64_t v = n ? le(static_cast<int>(n)) : 0;
          if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {                                                    // BINFLOAT: big-endian
          uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(take(1)[0]);
          PyValue* v = make(PyKind::real);
          std::memcpy(&v->real, &bits, 8);
          push(v);
          break;
        }
        case 'X': push_text(PyKind::string, le(4)); break;            // BINUNICODE
        case 0x8c: push_text(PyKind::string, le(1)); break;           // SHORT_BINUNICODE
        case 0x8d: push_text(PyKind::string, le(8)); break;           // BINUNICODE8
        case 'B': push_text(PyKind::bytes, le(4)); break;             // BINBYTES
        case 'C': push_text(PyKind::bytes, le(1)); break;             // SHORT_BINBYTES
        case '}': push(make(PyKind::dict)); break;
        case ']': push(make(PyKind::list)); break;
        case ')': push(make(PyKind::tuple)); break;
        case 0x8f: push(make(PyKind::set)); break;                     // EMPTY_SET
        case 't': {                                                    // TUPLE
          PyValue* v = make(PyKind::tuple);
          v->items = pop_mark();
          refs(v->items.size());
          push(v);
          break;
        }
        case 0x85: case 0x86: case 0x87: {                             // TUPLE1-3
          PyValue* v = make(PyKind::tuple);
          const size_t n = op - 0x84u;
          if (stack_.size() < n + floor()) fail("TUPLE" + std::to_string(n) + " on a stack of fewer values");
          refs(n);
          v->items.assign(stack_.end() - static_cast<long>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(v);
          break;
        }
        case 'a': {                                                    // APPEND
          const PyValue* x = pop();
          refs(1);
          sequence(top(), "APPEND")->items.push_back(x);
          break;
        }
        case 'e': case 0x90: {                                         // APPENDS, ADDITEMS
          std::vector<const PyValue*> xs = pop_mark();
          PyValue* s = sequence(top(), op == 'e' ? "APPENDS" : "ADDITEMS");
          refs(xs.size());
          s->items.insert(s->items.end(), xs.begin(), xs.end());
          break;
        }
        case 's': {                                                    // SETITEM
          const PyValue* v = pop();
          const PyValue* k = pop();
          refs(2);
          dict(top(), "SETITEM")->entries.emplace_back(k, v);
          break;
        }
        case 'u': {                                                    // SETITEMS
          std::vector<const PyValue*> kv = pop_mark();
          if (kv.size() % 2) fail("SETITEMS with an odd number of values");
          PyValue* d = dict(top(), "SETITEMS");
          refs(kv.size());
          for (size_t i = 0; i < kv.size(); i += 2) d->entries.emplace_back(kv[i], kv[i + 1]);
          break;
        }
        case 'q': memo_put(le(1)); break;                              // BINPUT
        case 'r': memo_put(le(4)); break;                              // LONG_BINPUT
        case 0x94: memo_put(memo_.size()); break;                      // MEMOIZE
        case 'h': memo_get(le(1)); break;                              // BINGET
        case 'j': memo_get(le(4)); break;                              // LONG_BINGET
        case 'c': {                                                    // GLOBAL "module\nname\n"
          const std::string module = line(), name = line();
          push(global(module, name));
          break;
        }
        case 0x93: {                                                   // STACK_GLOBAL
          const PyValue* name = pop();
          const PyValue* module = pop();
          if (!module->is(PyKind::string) || !name->is(PyKind::string)) fail("STACK_GLOBAL of a non-string");
          push(global(module->text, name->text));
          break;
        }
        case 'Q': persistent_id(); break;                              // BINPERSID
        case 'R': {                                                    // REDUCE
          const PyValue* args = pop();
          const PyValue* callee = pop();
          push(reduce(callee, args));
          break;
        }
        case 0x81: {                                                   // NEWOBJ
          const PyValue* args = pop();
          const PyValue* cls = pop();
          if (!cls->is(PyKind::global) || allowed_globals().at(cls->text).what != Allowed::record_class)
            fail("NEWOBJ of " + describe(*cls) + ", which is not a class ds reads as a record");
          if (!args->is(PyKind::tuple)) fail("NEWOBJ with arguments that are not a tuple");
          PyValue* o = make(PyKind::object);
          o->text = cls->text;
          push(o);
          break;
        }
        case 'b': {                                                    // BUILD: state for the object below
          const PyValue* state = pop();
          PyValue* target = mutable_top();
          if (target->is(PyKind::object)) target->state = state;
          // OrderedDict's BUILD sets attributes (a module's _metadata), a tensor's its Python attributes:
          // neither matters to the weights, so they are kept nowhere.
          else if (!target->is(PyKind::dict) && !target->is(PyKind::tensor))
            fail("BUILD on a " + std::string(target->kind_name()));
          break;
        }
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(std::string("opcode ") + hex + ", which torch.save does not write");
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw UserError("'" + out_.source_ + "': the pickle at byte " + std::to_string(op_at_) + ": " + what,
                    "ds reads the pickles torch.save writes for checkpoints and refuses anything else; is the file damaged?");
  }
  const char* take(uint64_t n) {
    if (n > p_.size() - at_) fail("the pickle ends inside an opcode's argument");
    const char* s = p_.data() + at_;
    at_ += n;
    return s;
  }
  uint64_t le(int n) {
    const char* s = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[i]);
    return v;
  }
  std::string line() {
    const size_t end = p_.find('\n', at_);
    if (end == std::string::npos || end - at_ > 256) fail("a GLOBAL's name without its newline");
    std::string s = p_.substr(at_, end - at_);
    at_ = end + 1;
    return s;
  }
  PyValue* make(PyKind k) {
    if (out_.values_.size() >= kMaxValues) fail("more than " + std::to_string(kMaxValues) + " values");
    out_.values_.push_back(std::make_unique<PyValue>());
    out_.values_.back()->kind = k;
    return out_.values_.back().get();
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Every reference a container takes is counted: sets and OrderedDicts copy their argument's.
  void refs(size_t n) {
    references_ += n;
    if (references_ > kMaxReferences) fail("containers holding more than " + std::to_string(kMaxReferences) + " references");
  }
  void push(const PyValue* v) {
    if (stack_.size() >= kMaxStack) fail("a stack deeper than " + std::to_string(kMaxStack));
    stack_.push_back(const_cast<PyValue*>(v));
  }
  void push_int(int64_t i) {
    PyValue* v = make(PyKind::integer);
    v->integer = i;
    push(v);
  }
  void push_text(PyKind k, uint64_t n) {
    PyValue* v = make(k);
    const char* s = take(n);
    if (k == PyKind::string && !valid_utf8(s, n)) fail("a string that is not UTF-8");
    v->text.assign(s, n);
    push(v);
  }
  PyValue* pop() {
    if (stack_.size() <= floor()) fail("an opcode takes a value from an empty stack");
    PyValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  PyValue* top() const {
    if (stack_.size() <= floor()) fail("an opcode needs a value on an empty stack");
    return stack_.back();
  }
  PyValue* mutable_top() const { return top(); }
  std::vector<const PyValue*> pop_mark() {
    if (marks_.empty()) fail("an opcode needs a MARK that is not there");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<const PyValue*> xs(stack_.begin() + static_cast<long>(m), stack_.end());
    stack_.resize(m);
    return xs;
  }
  PyValue* sequence(PyValue* v, const char* op) const {
    if (!v->is(PyKind::list) && !v->is(PyKind::set)) fail(std::string(op) + " to a " + v->kind_name());
    return v;
  }
  PyValue* dict(PyValue* v, const char* op) const {
    if (!v->is(PyKind::dict)) fail(std::string(op) + " to a " + v->kind_name());
    return v;
  }
  void memo_put(uint64_t i) {
    if (memo_.size() >= kMaxValues) fail("more than " + std::to_string(kMaxValues) + " memo entries");
    memo_[i] = top();
  }
  void memo_get(uint64_t i) {
    auto it = memo_.find(i);
    if (it == memo_.end()) fail("a memo reference to entry " + std::to_string(i) + ", which was never stored");
    push(it->second);
  }
  std::string describe(const PyValue& v) const { return v.is(PyKind::global) ? v.text : std::string("a ") + v.kind_name(); }

  const PyValue* global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    if (!allowed_globals().count(full))
      fail("it names " + full + ", which ds never runs: a checkpoint holds tensors, numbers, strings and containers, "
           "and ds builds only those (torch.load would have run it)");
    PyValue* v = make(PyKind::global);
    v->text = full;
    return v;
  }

  // ('storage', <storage class>, key, location, numel): one storage per key, shared by its views.
  void persistent_id() {
    const PyValue* pid = pop();
    if (!pid->is(PyKind::tuple) || pid->items.size() != 5 || !pid->items[0]->is(PyKind::string) || pid->items[0]->text != "storage")
      fail("a persistent id that is not ('storage', type, key, location, numel)");
    const PyValue* cls = pid->items[1];
    if (!cls->is(PyKind::global) || allowed_globals().at(cls->text).what != Allowed::storage_class)
      fail("a storage of " + describe(*cls));
    const PyValue *key = pid->items[2], *numel = pid->items[4];
    if (!key->is(PyKind::string) || key->text.empty() || key->text.size() > 64 || !numel->is(PyKind::integer) || numel->integer < 0)
      fail("a storage with a bad key or element count");
    const StDtype dtype = allowed_globals().at(cls->text).dtype;
    auto it = storages_.find(key->text);
    if (it != storages_.end()) {
      if (it->second->dtype != dtype || it->second->storage_numel != numel->integer)
        fail("storage '" + key->text + "' described twice, differently");
      push(it->second);
      return;
    }
    PyValue* s = make(PyKind::storage);
    s->storage_key = key->text;
    s->dtype = dtype;
    s->storage_numel = numel->integer;
    storages_[key->text] = s;
    push(s);
  }

  std::vector<int64_t> ints(const PyValue* t, const char* what) const {
    if (!t->is(PyKind::tuple) || t->items.size() > 64) fail(std::string(what) + " is not a tuple of at most 64 integers");
    std::vector<int64_t> out;
    for (const PyValue* i : t->items) {
      if (!i->is(PyKind::integer) || i->integer < 0) fail(std::string(what) + " holds something other than a non-negative integer");
      out.push_back(i->integer);
    }
    return out;
  }

  const PyValue* reduce(const PyValue* callee, const PyValue* args) {
    if (!callee->is(PyKind::global)) fail("REDUCE of a " + std::string(callee->kind_name()) + ", not a function");
    if (!args->is(PyKind::tuple)) fail("REDUCE of " + callee->text + " with arguments that are not a tuple");
    const std::vector<const PyValue*>& a = args->items;
    auto want = [&](bool ok) {
      if (!ok) fail(callee->text + " with arguments ds does not read");
    };
    switch (allowed_globals().at(callee->text).what) {
      case Allowed::rebuild_tensor: {  // (storage, offset, size, stride, requires_grad, hooks[, metadata])
        want((a.size() == 6 || a.size() == 7) && a[0]->is(PyKind::storage) && a[1]->is(PyKind::integer) && a[1]->integer >= 0);
        PyValue* t = make(PyKind::tensor);
        t->storage = a[0];
        t->dtype = a[0]->dtype;
        t->offset = a[1]->integer;
        t->shape = ints(a[2], "a tensor's size");
        t->stride = ints(a[3], "a tensor's stride");
        want(t->shape.size() == t->stride.size());
        // The last element a view reaches must lie inside its storage (an empty view reaches none).
        int64_t numel = 1, last = t->offset;
        bool empty = false;
        for (size_t i = 0; i < t->shape.size(); ++i) {
          if (t->shape[i] == 0) empty = true;
          if (t->shape[i] > 0 && numel > (int64_t{1} << 62) / t->shape[i]) fail("a tensor of more than 2^62 elements");
          numel *= t->shape[i];
          if (t->shape[i] > 0 && t->stride[i] > 0 && (t->shape[i] - 1) > ((int64_t{1} << 62) - last) / t->stride[i])
            fail("a tensor view beyond 2^62 elements");
          if (t->shape[i] > 0) last += (t->shape[i] - 1) * t->stride[i];
        }
        if (!empty && last >= a[0]->storage_numel)
          fail("a tensor view reaching element " + std::to_string(last) + " of storage '" + a[0]->storage_key + "', which holds " +
               std::to_string(a[0]->storage_numel));
        return t;
      }
      case Allowed::rebuild_parameter:  // (tensor, requires_grad, hooks)
        want(a.size() >= 1 && a[0]->is(PyKind::tensor));
        return a[0];
      case Allowed::ordered_dict: {  // () or ([(k, v), ...],)
        PyValue* d = make(PyKind::dict);
        if (a.empty()) return d;
        want(a.size() == 1 && a[0]->is(PyKind::list));
        refs(2 * a[0]->items.size());
        for (const PyValue* kv : a[0]->items) {
          want(kv->is(PyKind::tuple) && kv->items.size() == 2);
          d->entries.emplace_back(kv->items[0], kv->items[1]);
        }
        return d;
      }
      case Allowed::torch_size: {
        want(a.size() == 1);
        PyValue* t = make(PyKind::tuple);
        refs(a[0]->items.size());
        for (int64_t d : ints(a[0], "a torch.Size")) {
          PyValue* i = make(PyKind::integer);
          i->integer = d;
          t->items.push_back(i);
        }
        return t;
      }
      case Allowed::set: {
        want(a.size() <= 1 && (a.empty() || a[0]->is(PyKind::list)));
        PyValue* s = make(PyKind::set);
        if (!a.empty()) {
          refs(a[0]->items.size());
          s->items = a[0]->items;
        }
        return s;
      }
      case Allowed::getattr: {  // getattr(ZeroStageEnum, 'gradients'): the stage's number
        want(a.size() == 2 && a[0]->is(PyKind::global) && a[1]->is(PyKind::string) &&
             allowed_globals().at(a[0]->text).what == Allowed::zero_stage_enum);
        static const std::map<std::string, int64_t> stages = {
            {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 4}};
        auto it = stages.find(a[1]->text);
        if (it == stages.end()) fail("ZeroStageEnum." + a[1]->text + ", which no DeepSpeed release defines");
        PyValue* i = make(PyKind::integer);
        i->integer = it->second;
        return i;
      }
      case Allowed::codecs_encode: {  // protocol 2's spelling of bytes: encode(str, 'latin1')
        want(a.size() == 2 && a[0]->is(PyKind::string) && a[1]->is(PyKind::string) && a[1]->text == "latin1");
        PyValue* b = make(PyKind::bytes);
        b->text = a[0]->text;  // the code points below 256, as UTF-8: kept as given
        return b;
      }
      case Allowed::torch_device: {
        want(a.size() >= 1 && a[0]->is(PyKind::string));
        PyValue* s = make(PyKind::string);
        s->text = a[0]->text;
        return s;
      }
      case Allowed::storage_class:
      case Allowed::zero_stage_enum:
      case Allowed::record_class: break;
    }
    fail("a call of " + callee->text + ", which ds reads only as a type");
  }

  Pickle& out_;
  const std::string& p_;
  size_t at_ = 0, op_at_ = 0;
  std::vector<PyValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValue*> memo_;
  std::map<std::string, PyValue*> storages_;
  size_t references_ = 0;
};

Pickle::Pickle(const std::string& bytes, const std::string& source) : source_(source) {
  PickleMachine m(*this, bytes);
  m.run();
}

std::vector<const PyValue*> Pickle::storages() const {
  std::vector<const PyValue*> out;
  for (const auto& v : values_)
    if (v->is(PyKind::storage)) out.push_back(v.get());
  return out;
}

namespace {
// `budget` bounds the values visited: shared references could otherwise make a small pickle a huge tree.
nlohmann::json to_json(const PyValue& v, const std::string& source, int depth, int64_t& budget) {
  if (depth > 64) throw UserError("'" + source + "': a value nested deeper than 64 levels", "");
  if (--budget < 0) throw UserError("'" + source + "': a value of more than a million parts", "");
  switch (v.kind) {
    case PyKind::none: return nullptr;
    case PyKind::boolean: return v.boolean;
    case PyKind::integer: return v.integer;
    case PyKind::real: return v.real;
    case PyKind::string: return v.text;
    case PyKind::list:
    case PyKind::tuple:
    case PyKind::set: {
      nlohmann::json a = nlohmann::json::array();
      for (const PyValue* i : v.items) a.push_back(to_json(*i, source, depth + 1, budget));
      return a;
    }
    case PyKind::dict: {
      nlohmann::json o = nlohmann::json::object();
      for (const auto& [k, x] : v.entries) {
        std::string key = k->is(PyKind::string) ? k->text
                          : k->is(PyKind::integer) ? std::to_string(k->integer)
                                                   : std::string("<") + k->kind_name() + ">";
        o[key] = to_json(*x, source, depth + 1, budget);
      }
      return o;
    }
    case PyKind::object: return "<" + v.text + ">";
    case PyKind::global: return "<" + v.text + ">";
    case PyKind::bytes:
    case PyKind::storage:
    case PyKind::tensor: return std::string("<") + v.kind_name() + ">";
  }
  return nullptr;
}
}  // namespace

nlohmann::json pickle_to_json(const PyValue& v, const std::string& source) {
  int64_t budget = 1'000'000;
  return to_json(v, source, 0, budget);
}

}  // namespace ds
