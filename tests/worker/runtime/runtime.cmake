sf_add_test(test_runtime_unit SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_runtime_unit.cpp LABELS unit LIBS sf_runtime)
if(SF_MPI)
  # TP x CP on a synthetic model, every grid with np <= 4, dense and sparse (shared index).
  sf_add_mpi_test(test_parallel_prefill_mpi NP 4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_parallel_prefill_mpi.cpp
                  LIBS sf_runtime TIMEOUT 120)
endif()
if(SF_MPI)
  # The default model: CP 2 (two groups) and CP 4 on np 4, TP 3 on np 3 (skips what np cannot hold).
  sf_add_mpi_test(test_parallel_default_mpi NP 4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_parallel_default_mpi.cpp
                  LIBS sf_runtime TIMEOUT 180 ARGS --gtest_filter=*Cp*)
  sf_add_mpi_run(test_parallel_default_mpi_tp3 test_parallel_default_mpi 3 TIMEOUT 180 ARGS --gtest_filter=*Tp3*)
endif()
