// Shared by the mpi-label GoogleTest binaries (main in mpi_test_main.cpp): the world
// communicator and one seed for the whole job, drawn on rank 0, broadcast and printed.
#pragma once
#include <cstdint>

#include "comm/communicator.h"

namespace sf::testing {

comm::Communicator& test_world();
uint64_t test_seed();

}  // namespace sf::testing
