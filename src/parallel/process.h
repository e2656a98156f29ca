// This process within its job. A job is one process per GPU started by a launcher (mpirun, or
// srun under SLURM), or one process started directly. MPI is initialised only when a launcher
// started us, so a single process never needs MPI; MPI bootstraps NCCL (comm.h) and carries the
// CPU path's collectives.
#pragma once

namespace marrow::process {

// Initialises MPI when a launcher's environment is present; call once at program start.
void start(int* argc, char*** argv);
// Finalises MPI after a clean run.
void finish();
// Whether MPI was initialised (launched by mpirun or srun, even with one process).
bool launched();
int rank();        // in the job, 0 when alone
int size();        // processes in the job, 1 when alone
int local_rank();  // among the job's processes on this machine: the GPU this process uses
int local_size();  // the job's processes on this machine; each runs its share of the cores' OpenMP threads
// Ends every process of the job at once with this exit code (MPI_Abort), or this process alone.
[[noreturn]] void abort_job(int code);

}  // namespace marrow::process
