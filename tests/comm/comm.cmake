sf_add_test(test_comm_self SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_comm_self.cpp LABELS unit LIBS sf_comm)
if(SF_MPI)
  # ~3 s of the 60: the deadline test waits 2.5 s on purpose.
  sf_add_mpi_test(test_comm_mpi NP 4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_comm_mpi.cpp TIMEOUT 60)
endif()
