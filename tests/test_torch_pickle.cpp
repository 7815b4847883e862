// torch.save files read without running them (engine/runtime/io/torch_zip, pickle_reader, torch_file) and
// DeepSpeed's checkpoint folders (deepspeed_checkpoint): files built byte by byte here, the real DeepSpeed
// checkpoints of ../shared/data, and hostile variants of both.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/io/deepspeed_checkpoint.hpp"
#include "engine/runtime/io/torch_file.hpp"
#include "kernels/cpu/adam.hpp"
#include "test_helpers.hpp"

namespace fs = std::filesystem;
using namespace ds;

namespace {

std::string scratch_dir() {
  const fs::path d = fs::temp_directory_path() / ("ds_tp_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d.string();
}

// --- a pickle, opcode by opcode (protocol 2, as torch.save writes it) ---
struct P {
  std::string b = "\x80\x02";
  P& op(char c) { b += c; return *this; }
  P& global(const std::string& module, const std::string& name) { b += 'c' + module + "\n" + name + "\n"; return *this; }
  P& str(const std::string& s) {
    b += 'X';
    for (int i = 0; i < 4; ++i) b += static_cast<char>((s.size() >> (8 * i)) & 0xff);
    b += s;
    return *this;
  }
  P& int1(int v) { b += 'K'; b += static_cast<char>(v); return *this; }
  P& int4(int32_t v) {
    b += 'J';
    for (int i = 0; i < 4; ++i) b += static_cast<char>((static_cast<uint32_t>(v) >> (8 * i)) & 0xff);
    return *this;
  }
  // _rebuild_tensor_v2(('storage', <cls>, key, 'cpu', numel), offset, size, stride, False, OrderedDict())
  P& tensor(const std::string& cls, const std::string& key, int numel, int offset, std::vector<int> size, std::vector<int> stride) {
    global("torch._utils", "_rebuild_tensor_v2").op('(');
    op('(').str("storage").global("torch", cls).str(key).str("cpu").int4(numel).op('t').op('Q');
    int4(offset);
    op('(');
    for (int s : size) int4(s);
    op('t').op('(');
    for (int s : stride) int4(s);
    op('t').op(static_cast<char>(0x89));
    global("collections", "OrderedDict").op(')').op('R');
    return op('t').op('R');
  }
  std::string done() { return b + "."; }
};

// --- a zip as torch.save lays it out: stored members under "<record>/" with a central directory ---
struct Member {
  std::string name, data;
  uint16_t method = 0;
};
void put(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
}
std::string zip(const std::vector<Member>& members) {
  std::string out, cd;
  for (const Member& m : members) {
    const uint64_t at = out.size();
    put(out, 0x04034b50, 4); put(out, 20, 2); put(out, 0, 2); put(out, m.method, 2); put(out, 0, 4); put(out, 0, 4);
    put(out, m.data.size(), 4); put(out, m.data.size(), 4); put(out, m.name.size(), 2); put(out, 0, 2);
    out += m.name + m.data;
    put(cd, 0x02014b50, 4); put(cd, 20, 2); put(cd, 20, 2); put(cd, 0, 2); put(cd, m.method, 2); put(cd, 0, 4); put(cd, 0, 4);
    put(cd, m.data.size(), 4); put(cd, m.data.size(), 4); put(cd, m.name.size(), 2); put(cd, 0, 2); put(cd, 0, 2); put(cd, 0, 2);
    put(cd, 0, 2); put(cd, 0, 4); put(cd, at, 4);
    cd += m.name;
  }
  const uint64_t cd_at = out.size();
  out += cd;
  put(out, 0x06054b50, 4); put(out, 0, 4); put(out, members.size(), 2); put(out, members.size(), 2); put(out, cd.size(), 4);
  put(out, cd_at, 4); put(out, 0, 2);
  return out;
}

// A literal's bytes, NULs included.
template <size_t N>
std::string B(const char (&s)[N]) {
  return std::string(s, N - 1);
}

std::string floats(const std::vector<float>& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4); }

TorchFile open_bytes(const std::string& bytes) {
  return TorchFile(memory_reader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "test.pt"));
}

// The error a pickle's bytes raise (empty when they are read without one).
std::string pickle_error(const std::string& bytes) {
  try {
    Pickle p(bytes, "test.pkl");
    (void)pickle_to_json(p.root(), "test.pkl");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string zip_error(const std::string& bytes) {
  try {
    (void)open_bytes(bytes);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TorchFile, AStateDictBuiltByteByByteReadsItsTensorsAndViews) {
  // {"w": a 2x3 view at offset 1 of a 7-element fp32 storage, "h": 4 bf16 values}
  const std::vector<float> w = {9, 1, 2, 3, 4, 5, 6};
  const std::vector<uint16_t> h = {kernels::float_to_bf16(1.5f), kernels::float_to_bf16(-2.0f), kernels::float_to_bf16(0.25f),
                                   kernels::float_to_bf16(3.0f)};
  P p;
  p.global("collections", "OrderedDict").op(')').op('R').op('(');
  p.str("w").tensor("FloatStorage", "0", 7, 1, {2, 3}, {3, 1});
  p.str("h").tensor("BFloat16Storage", "1", 4, 0, {4}, {1});
  p.op('u');
  const std::string file = zip({{"archive/data.pkl", p.done()}, {"archive/data/0", floats(w)},
                                {"archive/data/1", std::string(reinterpret_cast<const char*>(h.data()), 8)}, {"archive/version", "3\n"}});
  const TorchFile f = open_bytes(file);
  const PyValue* t = f.root().get("w");
  ASSERT_TRUE(t && t->is(PyKind::tensor));
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> out(6);
  f.read_f32(*t, 0, 6, out.data());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  f.read_f32(*t, 4, 2, out.data());  // a range within it
  EXPECT_EQ(out[0], 5);
  EXPECT_EQ(out[1], 6);
  std::vector<float> hb(4);
  f.read_f32(*f.root().get("h"), 0, 4, hb.data());
  EXPECT_EQ(hb, (std::vector<float>{1.5f, -2.0f, 0.25f, 3.0f}));
}

TEST(TorchFile, GlobalsOutsideACheckpointsAreRefusedByNameBeforeAnythingRuns) {
  for (const auto& [module, name] : std::vector<std::pair<std::string, std::string>>{
           {"os", "system"}, {"posix", "system"}, {"builtins", "eval"}, {"__builtin__", "exec"}, {"subprocess", "Popen"},
           {"torch", "load"}, {"numpy.core.multiarray", "_reconstruct"}}) {
    P p;
    p.global(module, name).op('(').str("echo pwned").op('t').op('R');
    const std::string e = pickle_error(p.done());
    EXPECT_NE(e.find("names " + module + "." + name + ", which ds never runs"), std::string::npos) << e;
  }
  // getattr is read for DeepSpeed's ZeroStageEnum only, never as a way to reach another attribute.
  P g;
  g.global("builtins", "getattr").op('(').global("torch", "FloatStorage").str("__init__").op('t').op('R');
  EXPECT_NE(pickle_error(g.done()).find("arguments ds does not read"), std::string::npos);
  P z;
  z.global("builtins", "getattr").op('(').global("deepspeed.runtime.zero.config", "ZeroStageEnum").str("gradients").op('t').op('R');
  const Pickle zp(z.done(), "z");
  EXPECT_EQ(zp.root().integer, 2);
  // A class read as a record is never called.
  P r;
  r.global("deepspeed.runtime.fp16.loss_scaler", "LossScaler").op(')').op('R');
  EXPECT_NE(pickle_error(r.done()).find("which ds reads only as a type"), std::string::npos);
}

TEST(TorchFile, HostilePicklesAreErrorsNamingTheOffsetNeverCrashes) {
  EXPECT_NE(pickle_error(B("\x80\x02N")).find("without STOP"), std::string::npos);
  EXPECT_NE(pickle_error(B("\x80\x02h\x05.")).find("never stored"), std::string::npos);     // BINGET of nothing
  EXPECT_NE(pickle_error(B("\x80\x02X\xff\xff\xff\x7f")).find("ends inside"), std::string::npos);  // a 2 GB string
  EXPECT_NE(pickle_error(std::string("\x80\x02\x8a\x09", 4) + std::string(9, '\1') + ".").find("more than 64 bits"), std::string::npos);
  EXPECT_NE(pickle_error(std::string("\x80\x02", 2) + std::string(5000, '(') + ".").find("nesting deeper"), std::string::npos);
  EXPECT_NE(pickle_error(B("\x80\x02s.")).find("empty stack"), std::string::npos);
  EXPECT_NE(pickle_error(B("\x80\x02\xff.")).find("opcode 0xff"), std::string::npos);
  EXPECT_NE(pickle_error(B("\x80\x02X\x02\x00\x00\x00\xc3(.")).find("not UTF-8"), std::string::npos);  // found by fuzzing
  EXPECT_EQ(pickle_error(B("\x80\x02X\x05\x00\x00\x00\xc3\xa9\xe2\x82\xac.")), "");  // "é€" is read
  EXPECT_NE(pickle_error(B("\x80\x02K\x00K\x01K\x02s.")).find("SETITEM to a int"), std::string::npos);
  // A list holding itself: read (the memo makes it cheap), and walked only to a bounded depth.
  EXPECT_NE(pickle_error(B("\x80\x02]q\x00h\x00" "a.")).find("deeper than 64"), std::string::npos);
  // Each list holding the one before it twice, 40 times over: 2^40 paths through 41 values, refused by the
  // walk's budget instead of walked.
  std::string dag = B("\x80\x02]q\x00");
  for (int i = 0; i < 40; ++i) dag += B("](h\x00h\x00" "eq\x00");
  EXPECT_NE(pickle_error(dag + ".").find("more than a million parts"), std::string::npos) << pickle_error(dag + ".");
  // Sets copying one list of 1,000 references 20,000 times: 20M references from 190 KB, refused by budget.
  std::string sets = B("\x80\x02]q\x00(");
  for (int i = 0; i < 1000; ++i) sets += B("h\x00");
  sets += B("e" "c__builtin__\nset\nq\x01");
  for (int i = 0; i < 20000; ++i) sets += B("h\x01(h\x00tR0");
  EXPECT_NE(pickle_error(sets + "N.").find("more than 16777216 references"), std::string::npos) << pickle_error(sets + "N.");
  // Protocol 0's text opcodes are not torch.save's: refused by name.
  EXPECT_NE(pickle_error(B("\x80\x02(l.")).find("opcode 0x6c"), std::string::npos);
  // A tensor view reaching past its storage.
  P v;
  v.tensor("FloatStorage", "0", 4, 2, {2, 2}, {2, 1});
  EXPECT_NE(pickle_error(v.done()).find("reaching element 5 of storage '0', which holds 4"), std::string::npos);
  // The same storage key described twice, differently.
  P twice;
  twice.op('(').tensor("FloatStorage", "0", 4, 0, {4}, {1}).tensor("HalfStorage", "0", 4, 0, {4}, {1}).op('t');
  EXPECT_NE(pickle_error(twice.done()).find("described twice"), std::string::npos);
}

TEST(TorchFile, DamagedZipsAreRefusedNamingWhatIsWrong) {
  P p;
  p.tensor("FloatStorage", "0", 2, 0, {2}, {1});
  const std::string pkl = p.done(), data = floats({1, 2});
  EXPECT_EQ(zip_error(zip({{"a/data.pkl", pkl}, {"a/data/0", data}})), "");
  EXPECT_NE(zip_error(zip({{"a/data.pkl", pkl, 8}, {"a/data/0", data}})).find("is compressed (method 8)"), std::string::npos);
  EXPECT_NE(zip_error(zip({{"a/other", pkl}})).find("no data.pkl"), std::string::npos);
  EXPECT_NE(zip_error("PK\3\4 not really a zip at all, just words").find("no zip end record"), std::string::npos);
  std::string cut = zip({{"a/data.pkl", pkl}, {"a/data/0", data}});
  EXPECT_NE(zip_error(cut.substr(0, cut.size() / 2) + cut.substr(cut.size() - 22)).find("central directory"), std::string::npos);
  // A member whose size runs past the end of the file.
  std::string big = zip({{"a/data.pkl", pkl}, {"a/data/0", data}});
  const size_t cd = big.find(std::string("PK\1\2", 4), 0);
  const size_t second = big.find(std::string("PK\1\2", 4), cd + 4);
  big[second + 24] = '\xff';  // the uncompressed size's low byte
  big[second + 20] = '\xff';
  big[second + 25] = '\xff';
  big[second + 21] = '\xff';
  EXPECT_NE(zip_error(big).find("runs past the end"), std::string::npos);
  // A storage member shorter than its pickle says, or missing: refused on opening, before any tensor is sized.
  EXPECT_NE(zip_error(zip({{"a/data.pkl", pkl}, {"a/data/0", data.substr(0, 4)}})).find("holds 4 bytes, less than its 2 elements"),
            std::string::npos);
  EXPECT_NE(zip_error(zip({{"a/data.pkl", pkl}})).find("lacks the member data/0"), std::string::npos);
  // A storage claiming 2^62 elements: numel x width would wrap to 0 in 64 bits; refused all the same.
  P huge;
  huge.tensor("FloatStorage", "0", 1, 0, {1}, {1});
  std::string hp = huge.done();
  const size_t at = hp.find(std::string("J\x01\x00\x00\x00", 5));  // the storage's numel
  ASSERT_NE(at, std::string::npos);
  hp.replace(at, 5, std::string("\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40", 10));  // LONG1 2^62
  EXPECT_NE(zip_error(zip({{"a/data.pkl", hp}, {"a/data/0", data}})).find("less than its 4611686018427387904 elements"), std::string::npos)
      << zip_error(zip({{"a/data.pkl", hp}, {"a/data/0", data}}));
}

// --- DeepSpeed's own checkpoints (DeepSpeed 0.14.4, ../shared/data/deepspeed-checkpoints) ---
namespace {
const std::string kDs = std::string(DS_SHARED_DIR) + "/data/deepspeed-checkpoints/";

// A copy of a case's checkpoint folder to damage.
std::string copy_case(const std::string& c, const std::string& name) {
  const std::string dst = scratch_dir() + "/" + name;
  fs::remove_all(dst);
  fs::copy(kDs + c + "/ckpt", dst, fs::copy_options::recursive);
  for (const auto& e : fs::recursive_directory_iterator(dst)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  fs::permissions(dst, fs::perms::owner_write, fs::perm_options::add);
  return dst;
}

std::string ds_error(const std::string& path, const std::string& tag = "") {
  try {
    DeepSpeedCheckpoint c(path, tag);
  } catch (const UserError& e) {
    return std::string(e.what()) + " | " + e.hint();
  }
  return "";
}
}  // namespace

TEST(DeepSpeedCheckpoint, EachStageIsReadAsDeepSpeedSavedIt) {
  DS_REQUIRE_SHARED_DATA();
  const DeepSpeedCheckpoint z2(kDs + "llama-z2-w2-fp32/ckpt");
  EXPECT_EQ(z2.stage(), 2);
  EXPECT_EQ(z2.world_size(), 2);
  EXPECT_EQ(z2.step(), 5);
  EXPECT_EQ(z2.tag(), "global_step5");
  EXPECT_TRUE(z2.has_master());
  EXPECT_TRUE(z2.has_moments());
  EXPECT_EQ(z2.config()["zero_optimization"]["stage"], 2);
  ASSERT_EQ(z2.params().size(), 21u);
  int64_t n = 0;
  for (const DeepSpeedParam& p : z2.params()) n += p.numel;
  EXPECT_EQ(n, 106816);  // as the case's README says
  // Stage 2's fp32 master equals the module's fp32 weights in this fp32 run: two ways of reading one value.
  for (const DeepSpeedParam& p : z2.params()) {
    std::vector<float> master(static_cast<size_t>(p.numel)), module(static_cast<size_t>(p.numel));
    z2.read(p, false, master.data());
    z2.read(p, true, module.data());
    EXPECT_EQ(std::memcmp(master.data(), module.data(), master.size() * 4), 0) << p.name;
  }
  const DeepSpeedCheckpoint z3(kDs + "llama-z3-w2-fp32/ckpt");
  EXPECT_EQ(z3.stage(), 3);
  EXPECT_EQ(z3.params().size(), 21u);
  const DeepSpeedCheckpoint z0(kDs + "llama-z0-w1-fp32/ckpt/global_step5");  // a tag folder given directly
  EXPECT_EQ(z0.stage(), 0);
  EXPECT_FALSE(z0.has_master());
  const DeepSpeedCheckpoint gpt2(kDs + "gpt2-z2-w2-fp32/ckpt");
  ASSERT_EQ(gpt2.tied().size(), 1u);
  EXPECT_EQ(gpt2.tied()[0].first, "lm_head.weight");
  EXPECT_EQ(gpt2.tied()[0].second, "transformer.wte.weight");
  EXPECT_EQ(gpt2.find("lm_head.weight"), nullptr);
}

TEST(DeepSpeedCheckpoint, MissingSurplusAndMismatchedFilesAreRefusedNamingTheFile) {
  DS_REQUIRE_SHARED_DATA();
  std::string d = copy_case("llama-z2-w2-fp32", "ds-missing");
  fs::remove(d + "/global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  std::string e = ds_error(d);
  EXPECT_NE(e.find("lacks zero_pp_rank_1_mp_rank_00_optim_states.pt: the checkpoint was saved by 2 ranks"), std::string::npos) << e;

  d = copy_case("llama-z2-w2-fp32", "ds-surplus");
  fs::copy_file(d + "/global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt", d + "/global_step5/zero_pp_rank_2_mp_rank_00_optim_states.pt");
  e = ds_error(d);
  EXPECT_NE(e.find("zero_pp_rank_2_mp_rank_00_optim_states.pt' is rank 2's, but the checkpoint was saved by 2 ranks"), std::string::npos) << e;

  d = copy_case("llama-z2-w2-fp32", "ds-latest");
  std::ofstream(d + "/latest") << "global_step9";
  e = ds_error(d);
  EXPECT_NE(e.find("'latest' in '" + d + "' names 'global_step9', which is not a folder there"), std::string::npos) << e;
  EXPECT_NE(e.find("the checkpoints there: global_step5"), std::string::npos) << e;
  EXPECT_EQ(ds_error(d, "global_step5"), "");  // --tag reads the one that is there

  // Another save's optimizer file (ZeRO-3's rank files of another case) beside these: the sizes disagree.
  d = copy_case("llama-z2-w2-fp32", "ds-mixed");
  fs::copy_file(kDs + "gpt2-z2-w2-fp32/ckpt/global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                d + "/global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt", fs::copy_options::overwrite_existing);
  e = ds_error(d);
  EXPECT_NE(e.find("parameter group 0 has 106,496 elements by param_shapes, but its partitions hold 112,640"), std::string::npos) << e;

  d = copy_case("llama-z2-w2-fp32", "ds-tp");
  fs::copy_file(d + "/global_step5/mp_rank_00_model_states.pt", d + "/global_step5/mp_rank_01_model_states.pt");
  e = ds_error(d);
  EXPECT_NE(e.find("is tensor-parallel rank 01's"), std::string::npos) << e;

  // ZeRO-3: a rank's model file from another step.
  d = copy_case("llama-z3-w2-fp32", "ds-z3");
  fs::remove(d + "/global_step5/zero_pp_rank_1_mp_rank_00_model_states.pt");
  e = ds_error(d);
  EXPECT_NE(e.find("lacks zero_pp_rank_1_mp_rank_00_model_states.pt"), std::string::npos) << e;
}

TEST(DeepSpeedCheckpoint, ADsRunsCheckpointsFolderIsNotTakenForDeepSpeeds) {
  const std::string d = scratch_dir() + "/ds-own";
  fs::create_directories(d + "/step_00000005");
  std::ofstream(d + "/latest") << "step_00000005";
  EXPECT_FALSE(is_deepspeed_checkpoint(d));
  std::ofstream(d + "/latest", std::ios::trunc) << "global_step5";
  EXPECT_TRUE(is_deepspeed_checkpoint(d));  // DeepSpeed's name: a missing folder is then reported by the reader
}
