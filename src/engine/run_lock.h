// One run per output directory. Two trainers appending to one metrics.jsonl and saving into one
// directory corrupt both, so a run holds an exclusive lock on <output.dir>/.lock for its whole
// life. flock() locks die with their process, so a crashed or SIGKILLed run never leaves a stale
// lock behind; the file itself only names the holder (pid, host, start time) for the message.
// The file stays after the run (only the lock dies), so listings of an output.dir include .lock.
#pragma once
#include <string>

namespace marrow {

class RunLock {
 public:
  // Creates out_dir (an Error naming it when that fails) and takes its lock when `take` (a job's
  // world rank 0; the other processes of the job share the lock through it). A lock held by
  // another process is an Error naming that process.
  RunLock(const std::string& out_dir, bool take = true);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

// Creates a directory and its parents, with one sentence when it cannot (a file in the way, a
// read-only mount, no permission).
void create_output_dir(const std::string& dir, const std::string& what);

}  // namespace marrow
