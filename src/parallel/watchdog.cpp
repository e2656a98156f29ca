#include "parallel/watchdog.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

namespace marrow::watchdog {

namespace {

struct State {
  std::mutex mutex;
  std::condition_variable wake;
  std::thread thread;
  bool running = false;
  double timeout_s = 600;
  std::string who = "rank 0";
  std::function<std::string()> poll;
  std::atomic<bool> armed{false};
  std::atomic<int64_t> last_progress_ns{0};
  std::atomic<const char*> doing{"starting"};
};

State& state() {
  static State s;
  return s;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void end_job(const std::string& message) {
  std::fprintf(stderr, "marrow: %s: %s; ending the job\n", state().who.c_str(), message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  _exit(124);
}

void watch() {
  State& s = state();
  std::unique_lock lock(s.mutex);
  while (s.running) {
    s.wake.wait_for(lock, std::chrono::seconds(1));
    if (!s.running) break;
    if (s.poll) {
      const std::string error = s.poll();
      if (!error.empty()) end_job(error);
    }
    const double idle_s = double(now_ns() - s.last_progress_ns.load()) * 1e-9;
    if (s.armed.load() && idle_s > s.timeout_s)
      end_job(fmt::format("no progress for {:.0f} s (parallel.timeout_s = {:g}) while in {}: a peer rank died or hangs", idle_s,
                          s.timeout_s, s.doing.load()));
  }
}

}  // namespace

void start(double timeout_s, std::string who, std::function<std::string()> poll) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.timeout_s = timeout_s;
  s.who = std::move(who);
  s.poll = std::move(poll);
  s.last_progress_ns = now_ns();
  if (s.running) return;
  s.running = true;
  s.thread = std::thread(watch);
}

void stop() {
  State& s = state();
  {
    std::lock_guard lock(s.mutex);
    if (!s.running) return;
    s.running = false;
  }
  s.wake.notify_all();
  s.thread.join();
}

void arm(bool armed) {
  state().last_progress_ns = now_ns();
  state().armed = armed;
}

void progress(const char* what) {
  state().doing = what;
  state().last_progress_ns = now_ns();
}

}  // namespace marrow::watchdog
