#include "parallel/mesh.h"

#include <fmt/format.h>

#include "parallel/process.h"

namespace marrow {

std::string MeshShape::describe() const {
  return fmt::format("pp {} x dp {} x cp {} x ep {}{}", pp, dp, cp, ep,
                     dp_shard < dp ? fmt::format(" (dp: shards over {}, {} replicas)", dp_shard, dp_replicas()) : "");
}

MeshShape mesh_shape(int64_t world_size, int64_t pp, int64_t cp, int64_t ep, int64_t dp_shard) {
  MARROW_CHECK(pp >= 1 && cp >= 1 && ep >= 1, "parallel.pp, parallel.cp and parallel.ep must be at least 1, got {}, {} and {}", pp, cp,
               ep);
  MARROW_CHECK(world_size % (pp * cp * ep) == 0,
               "the job has {} process{}, which parallel.pp x parallel.cp x parallel.ep = {} x {} x {} = {} does not divide{}", world_size,
               world_size == 1 ? "" : "es", pp, cp, ep, pp * cp * ep,
               world_size == 1 ? " (several processes: mpirun -np N marrow train ..., or marrow estimate --world N)" : "");
  const int64_t dp = world_size / (pp * cp * ep);
  if (dp_shard == 0) dp_shard = dp;
  MARROW_CHECK(dp_shard >= 1 && dp % dp_shard == 0, "parallel.dp_shard ({}) does not divide the {} data-parallel ranks of {} processes ({})",
               dp_shard, dp, world_size, MeshShape{pp, dp, cp, ep, dp}.describe());
  return {pp, dp, cp, ep, dp_shard};
}

std::string Mesh::who() const {
  return fmt::format("rank {} of {} (pp {}, dp {}, cp {}, ep {})", world.rank(), world.size(), pp_rank, dp_rank, cp_rank, ep_rank);
}

Mesh Mesh::create(const MeshShape& shape, Device device) {
  Mesh m;
  m.shape = shape;
  m.world = Comm::world(device);
  MARROW_CHECK(m.world.size() == shape.world(), "internal: mesh {} for a job of {} processes", shape.describe(), m.world.size());
  int64_t r = m.world.rank();
  m.ep_rank = r % shape.ep;
  r /= shape.ep;
  m.cp_rank = r % shape.cp;
  r /= shape.cp;
  m.dp_rank = r % shape.dp;
  m.pp_rank = r / shape.dp;
  const int64_t rank = m.world.rank();
  // Colors name the coordinates the members share; keys keep them in world order.
  m.ep = m.world.split(int((m.pp_rank * shape.dp + m.dp_rank) * shape.cp + m.cp_rank), int(rank));
  m.cp = m.world.split(int((m.pp_rank * shape.dp + m.dp_rank) * shape.ep + m.ep_rank), int(rank));
  m.data = m.world.split(int(m.pp_rank), int(rank));
  m.pipeline = m.world.split(int((m.dp_rank * shape.cp + m.cp_rank) * shape.ep + m.ep_rank), int(rank));
  m.shard_rank = m.dp_rank % shape.dp_shard;
  m.replica_rank = m.dp_rank / shape.dp_shard;
  const int64_t replica = m.pp_rank * shape.dp_replicas() + m.replica_rank;
  m.shard = m.world.split(int(replica), int(rank));
  m.expert_shard = m.world.split(int(replica * shape.ep + m.ep_rank), int(rank));
  m.replicas = m.world.split(int(((m.pp_rank * shape.dp_shard + m.shard_rank) * shape.cp + m.cp_rank) * shape.ep + m.ep_rank), int(rank));
  return m;
}

}  // namespace marrow
