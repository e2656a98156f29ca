#include "parallel/process.h"

#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace marrow::process {

namespace {

bool g_launched = false;
int g_rank = 0, g_size = 1, g_local_rank = 0, g_local_size = 1;

// Variables that mpirun (Open MPI, MPICH/Hydra) or srun (PMI/PMIx) set in each process they start.
bool started_by_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(name)) return true;
  const char* tasks = std::getenv("SLURM_NTASKS");
  return std::getenv("SLURM_PROCID") && tasks && std::atoi(tasks) > 1;
}

// Each process on this machine gets its share of the cores for the CPU path's OpenMP loops, as
// torchrun does (OpenMP's spinning barriers would take the cores from the ranks that compute);
// OMP_NUM_THREADS, when set, wins.
void share_cores(int local_size) {
  if (local_size <= 1 || std::getenv("OMP_NUM_THREADS")) return;
  omp_set_num_threads(std::max(1, omp_get_num_procs() / local_size));
}

}  // namespace

void start(int* argc, char*** argv) {
  if (!started_by_launcher()) return;
  int provided = 0;
  // MPI_THREAD_MULTIPLE is not needed: only the main thread calls MPI (the watchdog thread exits
  // the process instead of calling MPI_Abort).
  // Before MPI's error strings and marrow's errors are usable: the code and a diagnosis, at file:line.
  if (const int code = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided); code != MPI_SUCCESS) {
    std::fprintf(stderr, "marrow: %s:%d: MPI_Init_thread failed with code %d: the launcher's MPI does not match this build's (Open MPI)\n",
                 __FILE__, __LINE__, code);
    std::exit(1);
  }
  g_launched = true;
  // Until the error handler is set below, MPI_ERRORS_ARE_FATAL holds: a failing call here ends the job
  // with MPI's own message, so these calls need no check of their own.
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  // The processes sharing this machine's memory, ordered by world rank: local rank r drives GPU r.
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &g_local_rank);
  MPI_Comm_size(local, &g_local_size);
  MPI_Comm_free(&local);
  share_cores(g_local_size);
  // MPI errors come back as codes that comm.cpp turns into marrow::Error naming the call.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

void finish() {
  if (g_launched) MPI_Finalize();
  g_launched = false;
}

bool launched() { return g_launched; }
int rank() { return g_rank; }
int size() { return g_size; }
int local_rank() { return g_local_rank; }
int local_size() { return g_local_size; }

void abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (g_launched && g_size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace marrow::process
