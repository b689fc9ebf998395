# sparsefill-worker's options and fingerprints, its batch lines' checks, host K/V sizing and
# request summaries, without MPI (label unit).
if(TARGET sf_worker_job)
  sf_add_test(test_worker_options SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_worker_options.cpp
              LABELS unit LIBS sf_worker_job TIMEOUT 60)
  sf_add_test(test_worker_job SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_worker_job.cpp
              LABELS unit LIBS sf_worker_job TIMEOUT 60)
endif()
# sparsefill-worker under mpiexec (label mpi): batch with bad lines + resume, start-up errors,
# load failure on one rank, killed and stalled ranks, sharded vs gathered exports (tests/worker/worker_cases.sh says what each
# checks). Each has a ctest TIMEOUT well above its own bound, so a hang fails instead of blocking.
if(SF_MPI AND TARGET sparsefill-worker)
  foreach(case batch world flags tp load hosts group_fail killed stalled stalled_group sharded retention prefix overlap freeing stream dry_run)
    add_test(NAME worker_${case}
             COMMAND ${PROJECT_SOURCE_DIR}/tests/worker/worker_cases.sh ${case} ${MPIEXEC_EXECUTABLE}
                     $<TARGET_FILE:sparsefill-worker> ${CMAKE_BINARY_DIR}/worker-test-tmp/${case})
    # The bounds catch hangs only: a case's own checks time what they mean to (deadlines, waits).
    # worker_retention runs nine jobs, worker_group_fail two (one with 36 s of deliberate
    # sleeps), worker_overlap sixteen (68 s on CI's 2 cores at 408754c, 100 s on another 2-core
    # machine, where 90 s cut it): twice or more their slowest time seen.
    if(case STREQUAL "retention" OR case STREQUAL "group_fail" OR case STREQUAL "overlap")
      set(t 300)
    else()
      set(t 180)
    endif()
    set_tests_properties(worker_${case} PROPERTIES LABELS mpi TIMEOUT ${t} ENVIRONMENT "${SF_MPI_TEST_ENV}")
  endforeach()
endif()
if(SF_MPI AND SF_HAVE_CUDA AND TARGET sparsefill-worker)
  # sparsefill-worker --device cuda on two GPUs against the CPU worker (label gpu; skips with
  # fewer than two GPUs). The binary runs mpiexec itself, so it is not started under one.
  add_executable(test_worker_gpu ${CMAKE_CURRENT_LIST_DIR}/test_worker_gpu.cpp)
  target_link_libraries(test_worker_gpu PRIVATE sf_model sf_decode sf_gtest_main CUDA::cudart_static)
  target_include_directories(test_worker_gpu PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_definitions(test_worker_gpu PRIVATE SF_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                             SF_WORKER_BIN="$<TARGET_FILE:sparsefill-worker>"
                             SF_MPIEXEC="${MPIEXEC_EXECUTABLE}")
  add_dependencies(test_worker_gpu sparsefill-worker)
  add_test(NAME test_worker_gpu COMMAND test_worker_gpu)
  set_tests_properties(test_worker_gpu PROPERTIES LABELS gpu TIMEOUT 300
                       ENVIRONMENT "${SF_MPI_TEST_ENV};NCCL_NVLS_ENABLE=0" SKIP_RETURN_CODE 77)
endif()
