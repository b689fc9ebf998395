# sparsefill-worker under mpiexec (label mpi): batch with bad lines + resume, start-up errors,
# load failure on one rank, killed and stalled ranks, sharded vs gathered exports (tests/worker/worker_cases.sh says what each
# checks). Each has a ctest TIMEOUT well above its own bound, so a hang fails instead of blocking.
if(SF_MPI AND TARGET sparsefill-worker)
  foreach(case batch world flags tp load killed stalled sharded)
    add_test(NAME worker_${case}
             COMMAND ${PROJECT_SOURCE_DIR}/tests/worker/worker_cases.sh ${case} ${MPIEXEC_EXECUTABLE}
                     $<TARGET_FILE:sparsefill-worker> ${CMAKE_BINARY_DIR}/worker-test-tmp/${case})
    set_tests_properties(worker_${case} PROPERTIES LABELS mpi TIMEOUT 90 ENVIRONMENT "${SF_MPI_TEST_ENV}")
  endforeach()
endif()
