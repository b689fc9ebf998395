# The CUDA prefill forward vs the CPU forward; label gpu. Each case GTEST_SKIPs with "no CUDA
# device: ..." where there is no device, and the regex turns that into a CTest "skipped".
if(SF_HAVE_CUDA)
  sf_add_test(test_gpu_forward SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gpu_forward.cpp LABELS gpu
              LIBS sf_model sf_kvstore)
  set_tests_properties(test_gpu_forward PROPERTIES SKIP_REGULAR_EXPRESSION "no CUDA device: ")
endif()
