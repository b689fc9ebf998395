# `sparsefill prefill --device cuda` with sparse attention and a scored retention export, against
# the same command on the CPU (label gpu). GTEST_SKIPs where there is none (exit 77, sf_add_test).
if(SF_HAVE_CUDA AND TARGET sparsefill AND TARGET sparsefill-decode)
  sf_add_test(test_cli_gpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cli_gpu.cpp LABELS gpu
              LIBS sf_model sf_decode TIMEOUT 300)
  target_compile_definitions(test_cli_gpu PRIVATE SF_CLI_BIN="$<TARGET_FILE:sparsefill>"
                             SF_DECODE_BIN="$<TARGET_FILE:sparsefill-decode>")
  target_link_libraries(test_cli_gpu PRIVATE CUDA::cudart_static)
  add_dependencies(test_cli_gpu sparsefill sparsefill-decode)
  # One of its cases fills the device's memory: no other test may run beside it.
  set_tests_properties(test_cli_gpu PROPERTIES RUN_SERIAL TRUE)
endif()
