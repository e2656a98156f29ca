// The frame of a check that runs under mpirun (tests/tools/*_check.cpp): MPI up, the check on the
// whole job's group, and on an error the rank's sentence and FAIL on stderr while the job ends
// (one failing rank must not leave the others waiting in a collective).
#pragma once
#include <cstdio>

#include "parallel/comm.h"
#include "parallel/process.h"

namespace marrow {

// Runs check(world) on every rank of the job; returns main's exit code.
template <typename Check> int run_mpi_check(int argc, char** argv, Check check) {
  process::start(&argc, &argv);
  int code = 0;
  try {
    check(Comm::world(Device::cpu));
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\nFAIL\n", process::rank(), e.what());
    code = 1;
    if (process::size() > 1) process::abort_job(1);
  }
  process::finish();
  return code;
}

}  // namespace marrow
