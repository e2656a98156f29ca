// The watchdog ends a job that stops making progress (a dead rank, a stuck peer, an NCCL collective
// that never completes) instead of letting it hang. While armed (each step), every collective and
// micro-batch marks progress; when none comes for parallel.timeout_s, or NCCL reports an
// asynchronous error, it prints one line naming the rank and what it waited for and exits with
// code 124, and the launcher ends the other ranks.
#pragma once
#include <functional>
#include <string>

namespace marrow::watchdog {

// Starts the watchdog thread (idempotent; the timeout of the latest call wins). who names this
// process in the message, e.g. "rank 3 of 8". poll returns a non-empty message for an asynchronous
// communication error (NCCL), checked about once a second.
void start(double timeout_s, std::string who, std::function<std::string()> poll = {});
void stop();
// Armed: the timeout counts. Arming marks progress.
void arm(bool armed);
// Progress: what the process does now, e.g. "all_to_all_v dispatch (ep group)".
void progress(const char* what);

}  // namespace marrow::watchdog
