# Sparsity-aware CP, pull vs push-or-pull, counted on a real prompt's indices (CPU; no MPI).
if(TARGET sf_eval)
  add_executable(sf_bench_cp_hybrid ${CMAKE_CURRENT_LIST_DIR}/cp_hybrid_bench.cpp)
  target_link_libraries(sf_bench_cp_hybrid PRIVATE sf_eval sf_runtime)
  target_compile_options(sf_bench_cp_hybrid PRIVATE ${SF_WARN})
endif()
