# Sparse vs dense CPU attention kernel: time per computed 64x64 block at several densities.
add_executable(sf_bench_sparse ${CMAKE_CURRENT_LIST_DIR}/sparse_kernel_bench.cpp)
target_link_libraries(sf_bench_sparse PRIVATE sf_kernels)
target_compile_options(sf_bench_sparse PRIVATE ${SF_WARN})
