// The MPI start of a benchmark run under mpirun: MPI initialized and the world communicator, or
// null (after a message) when MPI did not initialize; a world that cannot be made aborts the job.
#pragma once
#include <cstdio>
#include <memory>

#include "comm/mpi_communicator.h"

namespace sf::bench {

inline std::unique_ptr<comm::Communicator> mpi_world(int* argc, char*** argv) {
  if (!comm::mpi_init(argc, argv).is_ok()) {
    std::fprintf(stderr, "error: MPI did not initialize (run under mpirun)\n");
    return nullptr;
  }
  auto wr = comm::make_mpi_world();
  if (!wr.is_ok()) {
    std::fprintf(stderr, "error: %s\n", wr.status().message().c_str());
    comm::mpi_abort_job(1);
  }
  return std::move(wr).value();
}

}  // namespace sf::bench
