# GPU TP x CP prefill benchmark under mpirun (bench/gpu/distributed.sh runs it on the GPU host).
# Built wherever MPI is: without CUDA it compiles and reports the missing backend at run time.
if(SF_MPI)
  add_executable(sf_bench_distributed ${CMAKE_CURRENT_LIST_DIR}/distributed_bench.cpp)
  target_link_libraries(sf_bench_distributed PRIVATE sf_runtime)
  target_compile_options(sf_bench_distributed PRIVATE ${SF_WARN})
endif()
