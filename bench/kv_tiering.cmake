# KV block pool demotion bandwidth against the pinned D2H ceiling (GPU hosts only).
if(SF_HAVE_CUDA AND TARGET sf_kvstore)
  add_executable(sf_bench_kv_tiering ${CMAKE_CURRENT_LIST_DIR}/kv_tiering_bench.cpp)
  target_link_libraries(sf_bench_kv_tiering PRIVATE sf_kvstore CUDA::cudart_static)
  target_compile_options(sf_bench_kv_tiering PRIVATE ${SF_WARN})
endif()
# The device sink's cost to a Llama-3-8B-shaped prefill (GPU hosts only).
if(SF_HAVE_CUDA AND TARGET sf_kvstore AND TARGET sf_model)
  add_executable(sf_bench_kv_tiering_prefill ${CMAKE_CURRENT_LIST_DIR}/kv_tiering_prefill_bench.cpp)
  target_link_libraries(sf_bench_kv_tiering_prefill PRIVATE sf_kvstore sf_model)
  target_compile_options(sf_bench_kv_tiering_prefill PRIVATE ${SF_WARN})
endif()
# The prefix cache on the device against full prefills (GPU hosts only).
if(SF_HAVE_CUDA AND TARGET sf_kvstore AND TARGET sf_model)
  add_executable(sf_bench_prefix_device ${CMAKE_CURRENT_LIST_DIR}/prefix_device_bench.cpp)
  target_link_libraries(sf_bench_prefix_device PRIVATE sf_kvstore sf_model)
  target_compile_options(sf_bench_prefix_device PRIVATE ${SF_WARN})
endif()
