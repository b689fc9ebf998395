# NCCL all-gather bandwidth, the device CP exchange's two paths (bench/comm_bench.cpp). Built
# wherever MPI is: without NCCL it compiles and reports the missing backend at run time.
if(SF_MPI)
  add_executable(sf_bench_comm ${CMAKE_CURRENT_LIST_DIR}/comm_bench.cpp)
  target_link_libraries(sf_bench_comm PRIVATE sf_comm)
  target_compile_options(sf_bench_comm PRIVATE ${SF_WARN})
endif()
