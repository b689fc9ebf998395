if(SF_MPI)
  # TP x CP on a synthetic model, every grid with np <= 4, dense and sparse (shared index).
  sf_add_mpi_test(test_parallel_prefill_mpi NP 4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_parallel_prefill_mpi.cpp
                  LIBS sf_runtime TIMEOUT 120)
endif()
