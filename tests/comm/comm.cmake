sf_add_test(test_comm_self SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_comm_self.cpp LABELS unit LIBS sf_comm)
if(SF_MPI)
  # ~3 s of the 60: the deadline test waits 2.5 s on purpose.
  sf_add_mpi_test(test_comm_mpi NP 4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_comm_mpi.cpp TIMEOUT 60)
endif()
if(SF_MPI AND SF_HAVE_NCCL)
  # Two GPUs, one per rank; skips (exit 77) where there are fewer. Label gpu, run through mpiexec.
  add_executable(test_comm_nccl ${CMAKE_CURRENT_LIST_DIR}/test_comm_nccl.cpp ${CMAKE_CURRENT_LIST_DIR}/mpi_test_main.cpp)
  target_link_libraries(test_comm_nccl PRIVATE sf_comm GTest::gtest)
  target_include_directories(test_comm_nccl PRIVATE ${PROJECT_SOURCE_DIR})
  add_test(NAME test_comm_nccl COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe -np 2 $<TARGET_FILE:test_comm_nccl>)
  set_tests_properties(test_comm_nccl PROPERTIES LABELS gpu TIMEOUT 120 ENVIRONMENT "${SF_MPI_TEST_ENV}"
                       SKIP_RETURN_CODE 77)
endif()
