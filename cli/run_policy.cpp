#include "cli/run_policy.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/json_depth.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "schema/json_diff.hpp"
#include "schema/schema_walk.hpp"

namespace ds {
namespace fs = std::filesystem;

namespace {

// The first non-empty line of a file (at most 64 KiB of it).
std::string first_line(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) return line.substr(0, 65536);
  return "";
}

int64_t count_lines(const fs::path& file) {
  std::ifstream in(file);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// A JSON object file of at most 16 MiB, or null (not JSON, too deep for a file ds writes, too large).
nlohmann::json small_json_object(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec) || fs::file_size(file, ec) > (16u << 20)) return nullptr;
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (json_nesting_exceeded_at(text, kMaxJsonNesting) != std::string_view::npos) return nullptr;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() ? j : nlohmann::json(nullptr);
}

// Each file ds writes into a run directory, recognised by its content, not its name alone: a Hugging Face
// export's config.json or a user's notes in metrics.jsonl are not ds's. An empty file under one of these
// names is taken as ds's (a run stopped while starting leaves them so), as there is nothing in it to lose.
bool is_empty_file(const fs::path& file) {
  std::error_code ec;
  return fs::file_size(file, ec) == 0 && !ec;
}
bool is_ds_metrics(const fs::path& file) {
  const std::string line = first_line(file);
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  // A first line cut short by a kill mid-write still starts as every line ds writes there.
  return (j.is_object() && j.contains("step") && j.contains("loss")) || line.rfind("{\"step\": ", 0) == 0;
}
bool is_ds_config(const fs::path& file) {
  const nlohmann::json j = small_json_object(file);
  return j.is_object() && j.contains("train") && j["train"].is_object() && j["train"].contains("output_dir");
}
bool is_ds_plan(const fs::path& file) { return looks_like_plan_record(small_json_object(file)); }
bool is_ds_log(const fs::path& file) {  // train.log: every line starts with a local timestamp, 2026-11-26T09:30:00
  const std::string l = first_line(file);
  static const char* shape = "dddd-dd-ddTdd:dd:dd ";
  if (l.size() < 20) return false;
  for (size_t i = 0; i < 20; ++i)
    if (shape[i] == 'd' ? !std::isdigit(static_cast<unsigned char>(l[i])) : l[i] != shape[i]) return false;
  return true;
}

bool is_step_name(const std::string& n) {
  if (n.size() <= 5 || n.size() > 5 + 18 || n.rfind("step_", 0) != 0) return false;
  return std::all_of(n.begin() + 5, n.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool is_rank_log(const std::string& n) {
  if (n.rfind("rank_", 0) != 0 || n.size() <= 9 || n.compare(n.size() - 4, 4, ".log") != 0) return false;
  return std::all_of(n.begin() + 5, n.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
}

// The names ds writes at the top of a run directory, and the temporary names it writes them through.
constexpr const char* kRunFiles[] = {"config.json", "plan.json", "metrics.jsonl", "train.log"};
bool is_run_file_temporary(const std::string& n) { return n == "config.json.partial" || n == "plan.json.partial"; }

// Under one of ds's names only: a user's empty .gitkeep or marker file is theirs.
bool is_ds_run_file(const fs::path& file) {
  const std::string n = file.filename().string();
  if (is_run_file_temporary(n)) return true;
  if (std::find(std::begin(kRunFiles), std::end(kRunFiles), n) == std::end(kRunFiles)) return false;
  if (is_empty_file(file)) return true;
  return (n == "config.json" && is_ds_config(file)) || (n == "plan.json" && is_ds_plan(file)) ||
         (n == "metrics.jsonl" && is_ds_metrics(file)) || (n == "train.log" && is_ds_log(file));
}

struct RunDirContents {
  std::vector<fs::path> ours;         // files --overwrite removes
  std::vector<fs::path> checkpoints;  // checkpoint directories: --overwrite removes ds's files in them
  std::vector<fs::path> foreign;      // what ds did not write (relative names for messages)
  std::vector<std::string> collisions;  // foreign files under a name ds writes
  std::vector<std::string> links;       // symbolic links where ds writes (relative names)
};

// What ds wrote under checkpoints/: step_N directories holding a checkpoint's files (a user's files inside
// one are theirs), the hidden partial saves, `latest` and its temporary. Everything else there is the user's.
void survey_checkpoints(const fs::path& root, RunDirContents& c) {
  std::error_code ec;
  const fs::path rel("checkpoints");
  for (const auto& k : fs::directory_iterator(root / rel, ec)) {
    const std::string n = k.path().filename().string();
    const bool partial = n.size() > 9 && n[0] == '.' && n.compare(n.size() - 8, 8, ".partial") == 0 && is_step_name(n.substr(1, n.size() - 9));
    // A link under a name ds writes is refused (ds never writes through one); a user's own link (best ->
    // step_00000500) is theirs, kept.
    if (k.is_symlink(ec)) {
      const bool ds_name = n == "latest" || n == ".latest.tmp" || is_step_name(n) || partial;
      (ds_name ? c.links.push_back((rel / n).string()) : c.foreign.push_back(rel / n));
      continue;
    }
    if ((n == "latest" || n == ".latest.tmp") && k.is_regular_file(ec)) {
      c.ours.push_back(k.path());
    } else if ((is_step_name(n) || partial) && k.is_directory(ec)) {
      bool any_ds_file = false;
      for (const auto& f : fs::directory_iterator(k.path(), ec)) {
        const std::string fn = f.path().filename().string();
        if (f.is_symlink(ec) && is_checkpoint_file_name(fn)) c.links.push_back((rel / n / fn).string());
        else if (is_checkpoint_file_name(fn) && !f.is_symlink(ec) && f.is_regular_file(ec)) any_ds_file = true;
        else c.foreign.push_back(rel / n / fn);
      }
      if (any_ds_file || partial || fs::is_empty(k.path(), ec)) c.checkpoints.push_back(k.path());
    } else {
      c.foreign.push_back(rel / n);
    }
  }
}

RunDirContents survey(const fs::path& root) {
  RunDirContents c;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    const bool writes_here = std::find(std::begin(kRunFiles), std::end(kRunFiles), n) != std::end(kRunFiles) || n == "checkpoints" ||
                             n == "logs" || n == ".ds.lock" || is_run_file_temporary(n);
    if (e.is_symlink(ec)) {
      if (writes_here) c.links.push_back(n);
      else c.foreign.push_back(n);
      continue;
    }
    if (n == ".ds.lock") continue;  // the lock stays: it is held while this run lives
    if (n == "checkpoints" && e.is_directory(ec)) {
      survey_checkpoints(root, c);
      continue;
    }
    if (n == "logs" && e.is_directory(ec)) {
      for (const auto& k : fs::directory_iterator(e.path(), ec)) {
        const std::string kn = k.path().filename().string();
        if (k.is_symlink(ec) && is_rank_log(kn)) c.links.push_back((fs::path(n) / kn).string());  // the launcher writes these
        else if (is_rank_log(kn) && k.is_regular_file(ec)) c.ours.push_back(k.path());
        else c.foreign.push_back(fs::path(n) / kn);
      }
      continue;
    }
    if (e.is_regular_file(ec) && is_ds_run_file(e.path())) {
      c.ours.push_back(e.path());
    } else {
      c.foreign.push_back(n);
      if (writes_here) c.collisions.push_back(n);
    }
  }
  std::sort(c.ours.begin(), c.ours.end());
  std::sort(c.checkpoints.begin(), c.checkpoints.end());
  std::sort(c.foreign.begin(), c.foreign.end());
  std::sort(c.links.begin(), c.links.end());
  return c;
}

std::string name_some(const std::vector<fs::path>& names, size_t most = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i].string();
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}

fs::path resolved(const std::string& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

}  // namespace

bool path_within(const std::string& inner, const std::string& outer) {
  const fs::path in = resolved(inner), out = resolved(outer);
  auto i = in.begin();
  for (auto o = out.begin(); o != out.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == in.end() || *i != *o) return false;
  }
  return true;
}

bool same_path(const std::string& a, const std::string& b) { return path_within(a, b) && path_within(b, a); }

std::string checkpoint_run_dir(const std::string& checkpoint) {
  const fs::path parent = resolved(checkpoint).parent_path();
  return parent.filename() == "checkpoints" ? parent.parent_path().string() : std::string();
}

bool holds_run(const std::string& dir) {
  std::error_code ec;
  return !find_latest_checkpoint(dir).empty() || (fs::is_regular_file(fs::path(dir) / "metrics.jsonl", ec) && is_ds_metrics(fs::path(dir) / "metrics.jsonl"));
}

std::vector<ConfigIssue> prepare_run_dir(const RunDirRequest& q) {
  std::vector<ConfigIssue> warnings;
  std::error_code ec;
  const std::string& dir = q.dir;
  const fs::path root(dir);
  if (fs::exists(root, ec) && !fs::is_directory(root, ec))
    throw UserError("train.output_dir '" + dir + "' is a file, not a directory", "choose another train.output_dir");
  if (!fs::exists(root, ec)) return warnings;
  if (fs::exists(root / "checkpoints", ec) && !fs::is_directory(root / "checkpoints", ec) && !fs::is_symlink(root / "checkpoints", ec))
    throw UserError("'" + (root / "checkpoints").string() + "' is a file; ds keeps its checkpoints in a directory of that name",
                    "move the file away, or choose another train.output_dir");
  const RunDirContents c = survey(root);
  if (!c.links.empty())
    throw UserError("'" + (root / c.links.front()).string() + "' is a symbolic link; ds never writes through links into other places",
                    "remove the link (or replace it with a copy of what it points to), or choose another train.output_dir");
  for (const auto& name : unreadable_checkpoint_names(dir))
    warnings.push_back({"", "skipping " + (root / "checkpoints" / name).string() + ": not a step number", ""});

  const bool has_run = holds_run(dir);
  // A run continued in its own directory (DIR/checkpoints/step_N): nothing to check beyond the links. A
  // checkpoint of another run that merely lies further inside (DIR/runA/checkpoints/...) is not this one's.
  if (q.resume && !q.resume_from.empty() && same_path(checkpoint_run_dir(q.resume_from), dir)) return warnings;
  // --resume with no checkpoint to continue starts fresh, into a directory that must be fit for a run; a
  // run that never saved (its metrics.jsonl alone) is continued as asked.
  const bool continues_unsaved = q.resume && q.resume_from.empty();

  if (!c.collisions.empty())
    throw UserError("'" + (root / c.collisions.front()).string() + "' was not written by ds, and a run writes a file of that name",
                    "train.output_dir is the run's own directory: choose a new or empty one (e.g. train.output_dir=" + dir + "-run)");
  if (!has_run && !c.foreign.empty())
    throw UserError("train.output_dir '" + dir + "' is not a run directory: it holds " + name_some(c.foreign) + ", which ds did not write",
                    "choose a new or empty directory (e.g. train.output_dir=" + dir + "-run); ds refuses to mix a run into other files");
  if (!has_run || continues_unsaved) return warnings;

  const std::string latest = find_latest_checkpoint(dir);
  std::string what;
  if (!latest.empty()) what = "checkpoint " + fs::path(latest).filename().string();
  const int64_t metric_lines = fs::exists(root / "metrics.jsonl", ec) ? count_lines(root / "metrics.jsonl") : 0;
  if (metric_lines > 0) what += (what.empty() ? "" : ", ") + std::string("metrics.jsonl with ") + std::to_string(metric_lines) + " steps";
  if (!q.overwrite) {
    if (q.resume)
      throw UserError("train.output_dir '" + dir + "' holds a run (" + what + "); resuming " + q.resume_from +
                          " into it would replace its checkpoints and mix its metrics",
                      "continue that checkpoint in its own run directory, or into a new one (e.g. train.output_dir=" + dir +
                          "-2); --overwrite deletes the run here first");
    throw UserError("train.output_dir '" + dir + "' holds a run (" + what + "); a fresh run would overwrite it",
                    "continue it with --resume; start over with --overwrite (deletes its checkpoints, metrics.jsonl "
                    "and train.log); or choose another directory, e.g. train.output_dir=" + dir + "-2");
  }
  for (const std::string& source : q.sources)
    if (!source.empty() && path_within(source, dir))
      throw UserError("--overwrite would delete the run in '" + dir + "', but this command reads '" + source + "' from inside it",
                      "write to another directory (e.g. " + dir + "-2), or copy what it reads out of '" + dir + "' first");
  // Checkpoints first (each loses its DONE before anything else), then the files: a removal that fails
  // half-way leaves a run directory ds can still overwrite.
  for (const fs::path& p : c.checkpoints) {
    try {
      remove_checkpoint(p.string());
    } catch (const std::exception& e) {
      throw UserError(std::string("--overwrite: ") + e.what(), "");
    }
  }
  for (const fs::path& p : c.ours) {
    fs::remove(p, ec);
    if (ec) throw UserError("--overwrite: cannot remove '" + p.string() + "': " + ec.message(), "");
  }
  for (const char* sub : {"checkpoints", "logs"})
    if (fs::is_directory(root / sub, ec) && fs::is_empty(root / sub, ec)) fs::remove(root / sub, ec);
  std::vector<fs::path> removed;
  for (const fs::path& p : c.checkpoints) removed.push_back(p.lexically_relative(root));
  for (const fs::path& p : c.ours) removed.push_back(p.lexically_relative(root));
  warnings.push_back({"", "--overwrite: removed the previous run from " + dir + ": " + name_some(removed, 1000) +
                              (c.foreign.empty() ? "" : "; kept what ds did not write: " + name_some(c.foreign, 1000)),
                      ""});
  return warnings;
}

namespace {

// The holder's description, the first line of .ds.lock ("host H, pid P, started T"); its second line is
// the run's token ("run TOKEN"), which the ranks a launcher starts are given in DS_RUN_LOCK.
struct LockText {
  std::string holder, token;
};
LockText read_lock_text(int fd) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  LockText t;
  const size_t nl = text.find('\n');
  t.holder = text.substr(0, nl);
  if (nl != std::string::npos && text.compare(nl + 1, 4, "run ") == 0) {
    t.token = text.substr(nl + 5);
    t.token = t.token.substr(0, t.token.find('\n'));
  }
  while (!t.holder.empty() && (t.holder.back() == '\0' || t.holder.back() == '\r')) t.holder.pop_back();
  return t;
}

std::string draw_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[12] = {};
  in.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  static const char* hex = "0123456789abcdef";
  std::string t;
  for (unsigned char b : bytes) t += hex[b >> 4], t += hex[b & 15];
  // /dev/urandom unreadable: the clock and pid still tell two runs apart.
  if (!in) t = std::to_string(std::time(nullptr)) + "-" + std::to_string(::getpid());
  return t;
}

// The holder's pid when it ran on this host and is gone: its ranks (or their children) still hold the lock.
bool holder_gone_from_this_host(const std::string& holder) {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string prefix = std::string("host ") + host + ", pid ";
  if (holder.rfind(prefix, 0) != 0) return false;
  const long pid = std::strtol(holder.c_str() + prefix.size(), nullptr, 10);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

RunDirLock::RunDirLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec))
    throw UserError("train.output_dir '" + dir + "' cannot be created: " + (ec ? ec.message() : std::string("it is not a directory")),
                    "choose a directory you can write, e.g. train.output_dir=runs/NAME");
  path_ = (fs::path(dir) / ".ds.lock").string();
  // Two locks, both held for the run's life: the directory's own (a .ds.lock removed by hand does not free
  // it) and the file's (where a filesystem cannot lock directories). Both close on exec, except into the
  // launcher's local ranks (inheritable_fds), so a launcher killed with -9 leaves the directory locked until
  // its last rank has finished saving, and no other child (nvidia-smi, say) ever holds it.
  dir_fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int err = errno;
    release();
    throw UserError("cannot open the run directory's lock '" + path_ + "': " + std::strerror(err),
                    "train.output_dir must be a writable directory");
  }
  // Held elsewhere: EWOULDBLOCK. Any other failure (a filesystem without flock on directories, Lustre's
  // noflock) means that lock cannot be had here, and the other one does the work.
  enum class Got { yes, held, unsupported };
  const auto take = [](int fd) {
    if (fd < 0) return Got::unsupported;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return Got::yes;
    return errno == EWOULDBLOCK ? Got::held : Got::unsupported;
  };
  const Got on_dir = take(dir_fd_);
  const Got on_file = on_dir == Got::held ? Got::held : take(fd_);  // a held directory settles it
  if (on_dir == Got::unsupported && dir_fd_ >= 0) {
    ::close(dir_fd_);
    dir_fd_ = -1;
  }
  if (on_dir == Got::unsupported && on_file == Got::unsupported)
    note_ = "the filesystem of " + dir + " supports no locks (flock): ds cannot keep a second run out of this directory";
  if (on_dir == Got::held || on_file == Got::held) {
    const LockText held = read_lock_text(fd_);
    // A rank of ds's launcher runs under the launcher's lock: DS_RUN_LOCK names this lock and the token the
    // holder wrote. A DS_RUN_LOCK without that token (copied, or set by hand) does not unlock anything.
    if (const char* inherited = std::getenv("DS_RUN_LOCK")) {
      const std::string v = inherited;
      const size_t colon = v.find(':');
      if (colon != std::string::npos && !held.token.empty() && v.substr(0, colon) == held.token &&
          path_within(v.substr(colon + 1), path_) && path_within(path_, v.substr(colon + 1))) {
        release();
        path_.clear();
        return;
      }
    }
    release();
    std::string holder = held.holder.empty() ? "holder unknown: its .ds.lock was removed or emptied" : held.holder;
    if (holder_gone_from_this_host(held.holder))
      holder += "; that process has ended, but a process it started still holds the lock: its ranks are finishing (saving a checkpoint)";
    throw UserError("train.output_dir '" + dir + "' is in use by another ds run (" + holder + ")",
                    "wait for it to finish or stop it, or choose another train.output_dir; two runs in one directory would "
                    "mix their metrics and checkpoints");
  }
  const LockText previous = read_lock_text(fd_);
  if (!previous.holder.empty())
    note_ += (note_.empty() ? "" : "; ") + std::string("took over the lock of ") + dir + " from a run that ended without releasing it (" +
             previous.holder + ")";
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", std::localtime(&now));
  const std::string token = draw_token();
  const std::string me = std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", started " + when + "\nrun " + token + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    // Holding the lock is what matters; the text only names the holder.
  }
  ::setenv("DS_RUN_LOCK", (token + ":" + path_).c_str(), 1);  // the ranks this process starts run under this lock
}

std::vector<int> RunDirLock::inheritable_fds() const {
  std::vector<int> fds;
  for (int fd : {fd_, dir_fd_})
    if (fd >= 0) fds.push_back(fd);
  return fds;
}

void RunDirLock::release() {
  if (fd_ >= 0) ::close(fd_);
  if (dir_fd_ >= 0) ::close(dir_fd_);
  fd_ = dir_fd_ = -1;
}

RunDirLock::~RunDirLock() {
  if (fd_ < 0) return;
  if (::ftruncate(fd_, 0) != 0) {  // released cleanly: the next run has nothing to take over
  }
  // Closing releases this process's hold; ranks that still run (they share the locks) keep the directory.
  release();
}

RunDirLock::RunDirLock(RunDirLock&& o) noexcept : fd_(o.fd_), dir_fd_(o.dir_fd_), path_(std::move(o.path_)), note_(std::move(o.note_)) {
  o.fd_ = o.dir_fd_ = -1;
}

RunDirLock& RunDirLock::operator=(RunDirLock&& o) noexcept {
  if (this != &o) {
    this->~RunDirLock();
    fd_ = o.fd_;
    dir_fd_ = o.dir_fd_;
    path_ = std::move(o.path_);
    note_ = std::move(o.note_);
    o.fd_ = o.dir_fd_ = -1;
  }
  return *this;
}

void check_resume_shapes(const std::string& checkpoint, const PlanRecord& old, const Plan& plan) {
  if (old.params.empty()) return;  // a record without a layout (older): the parameter count is still checked on load
  const std::vector<RecordedTensor>& theirs = old.params;
  const std::vector<ParamSlot> mine = plan.checkpoint_layout().params;
  auto shape_text = [](const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
    return t + "]";
  };
  const size_t n = std::min(theirs.size(), mine.size());
  for (size_t i = 0; i < n; ++i)
    if (theirs[i].name != mine[i].name || theirs[i].shape != mine[i].shape)
      throw UserError("checkpoint '" + checkpoint + "' holds " + theirs[i].name + " " + shape_text(theirs[i].shape) + " where this model has " +
                          mine[i].name + " " + shape_text(mine[i].shape),
                      "resume with the model the checkpoint was trained with (the config's model block; its plan.json says which), "
                      "or start a new run from its weights where they fit");
  if (theirs.size() != mine.size())
    throw UserError("checkpoint '" + checkpoint + "' holds " + std::to_string(theirs.size()) + " tensors where this model has " +
                        std::to_string(mine.size()),
                    "resume with the model the checkpoint was trained with");
}

std::string resume_checkpoint(const std::string& resume, const std::string& output_dir) {
  if (resume == "false") return "";
  if (resume == "auto") return find_latest_checkpoint(output_dir);
  return resolve_checkpoint_path(resume);
}

namespace {

// Whether the schema marks the key at dotted `path` of `doc`, or a block above it, with `annotation` true: one ds
// does not act on (x-ds-ignored: its change changes nothing; a default may even have changed to say what ds does),
// or one that changes nothing the run computes (x-ds-resume-neutral).
bool schema_marks(const std::string& path, const nlohmann::json& doc, const char* annotation) {
  const SchemaWalk walk(config_schema());
  std::vector<std::string> segments;
  for (size_t at = 0; at <= path.size();) {
    const size_t dot = std::min(path.find('.', at), path.size());
    segments.push_back(path.substr(at, dot - at));
    at = dot + 1;
  }
  for (size_t n = 1; n <= segments.size(); ++n) {
    const nlohmann::json* sub = walk.at(std::vector<std::string>(segments.begin(), segments.begin() + static_cast<std::ptrdiff_t>(n)), doc);
    if (!sub) return false;
    if (const nlohmann::json* marked = walk.annotation(*sub, annotation); marked && *marked == true) return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> config_changes_since(const std::string& checkpoint, const std::string& resolved_config_json,
                                              const KeptFromCheckpoint& kept) {
  const auto was_kept = [&](const std::string& path) {
    return std::any_of(kept.values.begin(), kept.values.end(), [&](const auto& v) { return v.first == path; });
  };
  const std::string then = read_checkpoint_text(checkpoint, "config_json");
  // The same global batch cut another way (another world size or mesh needs another micro batch or accumulation)
  // and the mesh and ZeRO stage themselves change how the run is laid out, not what it computes.
  const auto batch_of = [](const std::string& text) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    return j.is_object() && j.contains("train_batch_size") ? j["train_batch_size"] : nlohmann::json();
  };
  const nlohmann::json batch = batch_of(then);
  const bool same_batch = !batch.is_null() && batch == batch_of(resolved_config_json);
  static const std::set<std::string> layout_keys = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization.stage",
                                                    "tensor_parallel.autotp_size", "pipeline.stages", "pipeline.partition"};
  const nlohmann::json now = nlohmann::json::parse(resolved_config_json, nullptr, false);
  // A block the checkpoint never recorded (a DeepSpeed checkpoint's data): this run's is the first word on it.
  const nlohmann::json was = nlohmann::json::parse(then, nullptr, false);
  const auto unrecorded = [&](const std::string& p) { return was.is_object() && !was.contains(p.substr(0, p.find('.'))); };
  std::vector<std::string> changed;
  for (const auto& p : json_differences(then, resolved_config_json))
    if (p != "train.resume" && p != "train.steps" && p.rfind("scheduler.params.", 0) != 0 && !was_kept(p) &&
        !(same_batch && layout_keys.count(p)) && !schema_marks(p, now, "x-ds-ignored") &&
        !schema_marks(p, now, "x-ds-resume-neutral") && !unrecorded(p))
      changed.push_back(p);
  return changed;
}

}  // namespace ds
