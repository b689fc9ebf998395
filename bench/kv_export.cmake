# KV export and load throughput on the host (CPU; any build with the decode library).
if(TARGET sf_kvstore AND TARGET sf_decode)
  add_executable(sf_bench_kv_export ${CMAKE_CURRENT_LIST_DIR}/kv_export_bench.cpp)
  target_link_libraries(sf_bench_kv_export PRIVATE sf_decode sf_kvstore)
  target_compile_options(sf_bench_kv_export PRIVATE ${SF_WARN})
endif()
