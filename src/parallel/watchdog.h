// The watchdog ends a job that stops making progress instead of letting it hang for ever: a rank
// that died, a peer stuck outside any collective, or an NCCL collective that never completes all
// leave the other ranks blocked. While armed (the trainer arms it for each step), every collective
// and every micro-batch marks progress; when none comes for parallel.timeout_s, or NCCL reports an
// asynchronous error, the watchdog prints one line naming the rank and what it was waiting for, and
// exits the process with code 124. The launcher (mpirun, srun) then ends the other ranks.
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
