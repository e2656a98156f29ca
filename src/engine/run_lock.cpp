#include "engine/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/errors.h"

namespace fs = std::filesystem;

namespace marrow {

namespace {

std::string holder_line() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return fmt::format("process {} on {} since {}", ::getpid(), host, when);
}

std::string read_holder(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "a process that has not yet written its name" : s;
}

}  // namespace

void create_output_dir(const std::string& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MARROW_CHECK(!ec, "cannot create {} {}: {}", what, dir, ec.message());
  MARROW_CHECK(fs::is_directory(dir, ec), "cannot use {} {}: it exists and is not a directory", what, dir);
}

RunLock::RunLock(const std::string& out_dir, bool take) {
  if (!take) return;
  create_output_dir(out_dir, "output.dir");
  const std::string path = out_dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MARROW_CHECK(fd_ >= 0, "cannot create the run lock {}: {}", path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    MARROW_CHECK(err != EWOULDBLOCK, "output.dir {} is in use by another run ({}, see {}): wait for it to end or choose another output.dir",
                 out_dir, read_holder(path), path);
    fail("cannot lock {}: {}", path, std::strerror(err));
  }
  const std::string line = holder_line() + "\n";
  const bool written = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, line.data(), line.size(), 0) == ssize_t(line.size());
  MARROW_CHECK(written, "cannot write the run lock {}: {}", path, std::strerror(errno));
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock; the file stays, naming the last holder
}

}  // namespace marrow
