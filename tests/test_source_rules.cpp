// Rules the source holds itself to, checked on the tree rather than left to review:
//  * no function in cli/, schema/ or engine/ longer than 100 lines (the runtime's rule, for the whole tree):
//    a long one is split into named steps;
//  * "am I a rank?" is answered by the topology (engine/plan/topology.*), never by reading RANK elsewhere;
//  * the device is asked in its own files: which kind a run has, where a tensor is, what this build has
//    (engine/runtime/device/, engine/plan/device_traits.*, and the topology, which chooses the kind).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "test_helpers.hpp"

namespace ds {
namespace {

namespace fs = std::filesystem;

constexpr int kMostLines = 100;

// The text with comments, string and character literals blanked (newlines kept), so braces and
// parentheses are the code's own.
std::string code_only(const std::string& s) {
  std::string out = s;
  size_t i = 0;
  auto blank = [&](size_t from, size_t to) {
    for (size_t k = from; k < to && k < out.size(); ++k)
      if (out[k] != '\n') out[k] = ' ';
  };
  while (i < s.size()) {
    if (s.compare(i, 2, "//") == 0) {
      const size_t e = s.find('\n', i);
      blank(i, e == std::string::npos ? s.size() : e);
      i = e == std::string::npos ? s.size() : e;
    } else if (s.compare(i, 2, "/*") == 0) {
      const size_t e = s.find("*/", i + 2);
      const size_t end = e == std::string::npos ? s.size() : e + 2;
      blank(i, end);
      i = end;
    } else if (s[i] == 'R' && i + 1 < s.size() && s[i + 1] == '"' && (i == 0 || !std::isalnum(static_cast<unsigned char>(s[i - 1])))) {
      const size_t open = s.find('(', i);
      const std::string close = ")" + s.substr(i + 2, open - i - 2) + "\"";
      const size_t e = s.find(close, open);
      const size_t end = e == std::string::npos ? s.size() : e + close.size();
      blank(i, end);
      i = end;
    } else if (s[i] == '"' || (s[i] == '\'' && !(i > 0 && std::isxdigit(static_cast<unsigned char>(s[i - 1]))))) {
      const char q = s[i];
      size_t k = i + 1;
      while (k < s.size() && s[k] != q && s[k] != '\n') k += s[k] == '\\' ? 2 : 1;
      blank(i, k + 1);
      i = k + 1;
    } else {
      ++i;
    }
  }
  return out;
}

struct Function {
  std::string name;
  int line = 0, lines = 0;
};

// Functions defined at namespace scope: a line at column 0 that is not a type, namespace or preprocessor
// line, whose first '{' (before any ';') opens a body; its length runs to the brace that closes it.
std::vector<Function> functions_in(const std::string& text) {
  const std::string code = code_only(text);
  std::vector<size_t> starts{0};
  for (size_t i = 0; i < code.size(); ++i)
    if (code[i] == '\n') starts.push_back(i + 1);
  auto line_of = [&](size_t at) { return static_cast<int>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin()); };
  std::vector<Function> out;
  for (size_t li = 0; li < starts.size(); ++li) {
    const size_t b = starts[li];
    const size_t e = code.find('\n', b);
    const std::string line = code.substr(b, (e == std::string::npos ? code.size() : e) - b);
    if (line.empty() || !(std::isalpha(static_cast<unsigned char>(line[0])) || line[0] == '_' || line[0] == '~')) continue;
    bool skip = false;
    for (const char* k : {"namespace", "struct", "class", "enum", "union", "template", "using", "typedef", "static_assert", "extern", "#"})
      if (line.rfind(k, 0) == 0) skip = true;
    if (skip || line.find('(') == std::string::npos) continue;
    const size_t brace = code.find('{', b), semi = code.find(';', b);
    if (brace == std::string::npos || (semi != std::string::npos && semi < brace)) continue;
    int depth = 0;
    size_t k = brace;
    for (; k < code.size(); ++k) {
      if (code[k] == '{') ++depth;
      if (code[k] == '}' && --depth == 0) break;
    }
    const std::string head = line.substr(0, line.find('('));
    const size_t name_at = head.find_last_of(" *&") == std::string::npos ? 0 : head.find_last_of(" *&") + 1;
    out.push_back({head.substr(name_at), static_cast<int>(li) + 1, line_of(k) - static_cast<int>(li)});
    while (li + 1 < starts.size() && starts[li + 1] <= k) ++li;  // past the body
  }
  return out;
}

std::vector<std::string> sources() {
  std::vector<std::string> files;
  for (const char* dir : {"cli", "schema", "engine"})
    for (const auto& e : fs::recursive_directory_iterator(std::string(DS_SOURCE_DIR) + "/" + dir)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".cpp" || ext == ".hpp" || ext == ".cu"))
        files.push_back(fs::relative(e.path(), DS_SOURCE_DIR).string());
    }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(SourceRules, TheScannerMeasuresFunctionsAsWritten) {
  const std::string text =
      "// a comment with { and (\n"
      "int one(int a) { return a; }\n"
      "std::string two(const char* s,\n"
      "                int n) {\n"
      "  const char* t = \"}\";\n"
      "  auto f = [&](int x) {\n"
      "    return x + '}';\n"
      "  };\n"
      "  return R\"x(})x\";\n"
      "}\n"
      "void declared(int);\n"
      "struct S {\n"
      "  void inline_member() {}\n"
      "};\n";
  const std::vector<Function> f = functions_in(text);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].name, "one");
  EXPECT_EQ(f[0].lines, 1);
  EXPECT_EQ(f[1].name, "two");
  EXPECT_EQ(f[1].line, 3);
  EXPECT_EQ(f[1].lines, 8);
}

TEST(SourceRules, NoFunctionIsLongerThanAHundredLines) {
  size_t measured = 0;
  for (const std::string& file : sources())
    for (const Function& f : functions_in(test::read_text(std::string(DS_SOURCE_DIR) + "/" + file))) {
      ++measured;
      EXPECT_LE(f.lines, kMostLines) << file << ":" << f.line << " " << f.name << " is " << f.lines << " lines: split it into named steps";
    }
  EXPECT_GT(measured, 500u) << "the scanner found too few functions to be reading the tree";
}

TEST(SourceRules, OnlyTheTopologyReadsRank) {
  for (const std::string& file : sources()) {
    if (file.rfind("engine/plan/topology.", 0) == 0) continue;
    const std::string text = test::read_text(std::string(DS_SOURCE_DIR) + "/" + file);
    EXPECT_EQ(text.find("getenv(\"RANK\")"), std::string::npos)
        << file << " reads RANK: ask started_as_rank() before the plan, the plan's topology.rank after it";
  }
}

// The ways code asks about the device, in code (comments and literals blanked): a tensor's place, LibTorch's
// CUDA, a test of the plan's device kind, the build's macros.
std::vector<std::string> device_questions_in(const std::string& text) {
  const std::string code = code_only(text);
  std::vector<std::string> found;
  for (const char* q : {"is_cuda(", "is_cpu(", "kCPU", "kCUDA", "DeviceType", "torch::cuda::", "== DeviceKind::", "!= DeviceKind::",
                        "DeviceKind::cpu ==", "DeviceKind::cuda ==", "case DeviceKind::", "DS_TORCH_CUDA", "DS_CUDA_KERNELS", "DS_WITH_CUDA"})
    if (code.find(q) != std::string::npos) found.push_back(q);
  return found;
}

TEST(SourceRules, TheDeviceFinderSeesQuestionsInCodeOnly) {
  EXPECT_TRUE(device_questions_in("// x.is_cuda() in a comment\nconst char* s = \"torch::kCPU\";\n").empty());
  EXPECT_EQ(device_questions_in("if (x.is_cpu()) f();\n"), std::vector<std::string>{"is_cpu("});
  EXPECT_EQ(device_questions_in("#ifdef DS_WITH_CUDA_KERNELS\n#endif\n"), std::vector<std::string>{"DS_WITH_CUDA"});
  EXPECT_EQ(device_questions_in("bool g = t.device == DeviceKind::cuda;\n"), std::vector<std::string>{"== DeviceKind::"});
  EXPECT_TRUE(device_questions_in("t.device = DeviceKind::cpu;\n").empty());  // naming a kind is not asking
  EXPECT_EQ(device_questions_in("switch (k) {\n  case DeviceKind::cuda: break;\n}\n"), std::vector<std::string>{"case DeviceKind::"});
  EXPECT_EQ(device_questions_in("if (d.type() == at::kCUDA) g();\n"), std::vector<std::string>{"kCUDA"});
}

TEST(SourceRules, TheDeviceIsAskedInItsOwnFiles) {
  size_t allowed = 0;
  std::vector<std::string> files = sources();
  for (const auto& e : fs::recursive_directory_iterator(std::string(DS_SOURCE_DIR) + "/common"))
    if (e.is_regular_file()) files.push_back(fs::relative(e.path(), DS_SOURCE_DIR).string());
  for (const std::string& file : files) {
    const std::vector<std::string> found = device_questions_in(test::read_text(std::string(DS_SOURCE_DIR) + "/" + file));
    if (file.rfind("engine/runtime/device/", 0) == 0 || file.rfind("engine/plan/device_traits.", 0) == 0 ||
        file.rfind("engine/plan/topology.", 0) == 0) {
      allowed += found.size();
      continue;
    }
    for (const std::string& q : found)
      ADD_FAILURE() << file << " asks `" << q << "`: ask the plan's device traits (engine/plan/device_traits.hpp), "
                    << "kernel_route/on_host (engine/runtime/device/kernel_route.hpp) or build_support()";
  }
  EXPECT_GT(allowed, 3u) << "the device's own files ask nothing: is the finder reading the tree?";
}

}  // namespace
}  // namespace ds
