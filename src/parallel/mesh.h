// The device mesh (DESIGN.md §5): the job's processes arranged on four axes, outer to inner
// PP × DP × CP × EP, so that expert-parallel (and context-parallel) traffic, the most frequent,
// stays between neighbouring ranks (one machine, NVLink). World rank
//   r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * ep + ep_rank,
// and DP is what remains of the world size. Each group is one Comm (comm.h).
#pragma once
#include <cstdint>
#include <string>

#include "parallel/comm.h"

namespace marrow {

struct MeshShape {
  int64_t pp = 1, dp = 1, cp = 1, ep = 1;
  // FSDP shards over groups of dp_shard consecutive dp ranks (one machine) and replicates over the
  // dp / dp_shard groups (HSDP).
  int64_t dp_shard = 1;
  int64_t world() const { return pp * dp * cp * ep; }
  int64_t dp_replicas() const { return dp / dp_shard; }
  // Processes that see different data: each trains on its own share of the global batch.
  int64_t data_parallel() const { return dp * ep; }
  std::string describe() const;  // "pp 1 x dp 4 x cp 1 x ep 2 (dp: shards over 2, 2 replicas)"
};

// The shape for world_size processes and the [parallel] sizes (dp_shard 0: all of dp); one
// sentence for an impossible layout.
MeshShape mesh_shape(int64_t world_size, int64_t pp, int64_t cp, int64_t ep, int64_t dp_shard = 0);

struct Mesh {
  MeshShape shape;
  int64_t pp_rank = 0, dp_rank = 0, cp_rank = 0, ep_rank = 0;
  Comm world;
  Comm ep;           // same pp, dp, cp: the expert all-to-alls
  Comm cp;           // same pp, dp, ep: the members sharing each sequence (ring attention, ring_attention.h)
  Comm data;         // same pp (dp x cp x ep): non-expert gradients, losses, routing statistics
  Comm pipeline;     // same dp, cp, ep (the pp ranks in order): activations and their gradients
  // Fully sharded data parallelism (sharded_params.h): the dp ranks are replicas r of shard
  // position s, dp_rank = r * dp_shard + s.
  int64_t shard_rank = 0, replica_rank = 0;
  Comm shard;         // same pp and replica (dp_shard x cp x ep): shards of the non-expert weights
  Comm expert_shard;  // same pp, replica and ep (dp_shard x cp): shards of this rank's experts' weights
  Comm replicas;      // same pp, shard position, cp and ep: the ranks holding the same shards (HSDP)
  // The rank among the data-parallel processes (dp x ep), whose share of each global batch it takes.
  int64_t data_rank() const { return dp_rank * shape.ep + ep_rank; }
  std::string who() const;  // "rank 3 of 4 (pp 0, dp 1, cp 0, ep 1)"

  // Splits the job (process.h) into the groups; with device = cuda each group also gets NCCL.
  static Mesh create(const MeshShape& shape, Device device);
};

}  // namespace marrow
