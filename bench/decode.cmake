# Decode attention on a GPU host: the device kernel and the host reference on one paged cache.
if(SF_HAVE_CUDA AND TARGET sf_decode)
  add_executable(sf_bench_decode ${CMAKE_CURRENT_LIST_DIR}/decode_bench.cpp)
  target_link_libraries(sf_bench_decode PRIVATE sf_decode CUDA::cudart_static)
  target_compile_options(sf_bench_decode PRIVATE ${SF_WARN})
endif()
# The decode node's step (DeviceDecodeSession) per token: eager and graph, unfused and fused.
if(SF_HAVE_CUDA AND TARGET sf_decode)
  add_executable(sf_bench_decode_session ${CMAKE_CURRENT_LIST_DIR}/decode_session_bench.cpp)
  target_link_libraries(sf_bench_decode_session PRIVATE sf_decode CUDA::cudart_static)
  target_compile_options(sf_bench_decode_session PRIVATE ${SF_WARN})
endif()
# The decode step's one-row linears (gemv, gemv_parts, gemv_swiglu) against a copy of their bytes.
if(SF_HAVE_CUDA AND TARGET sf_kernels)
  add_executable(sf_bench_gemv ${CMAKE_CURRENT_LIST_DIR}/gemv_bench.cpp)
  target_link_libraries(sf_bench_gemv PRIVATE sf_kernels CUDA::cudart_static)
  target_compile_options(sf_bench_gemv PRIVATE ${SF_WARN})
endif()
