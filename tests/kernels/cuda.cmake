# CUDA backend vs the CPU reference; label gpu. Each case GTEST_SKIPs with "no CUDA device: ..."
# where there is no device, and the regex turns that into a CTest "skipped" instead of "passed".
if(SF_HAVE_CUDA)
  sf_add_test(test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.cpp LABELS gpu LIBS sf_kernels)
  target_link_libraries(test_cuda_ops PRIVATE CUDA::cudart_static)
  set_tests_properties(test_cuda_ops PROPERTIES SKIP_REGULAR_EXPRESSION "no CUDA device: ")
endif()
if(SF_HAVE_CUDA)
  sf_add_test(test_cuda_estimators SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_estimators.cpp LABELS gpu LIBS sf_kernels)
  target_link_libraries(test_cuda_estimators PRIVATE CUDA::cudart_static)
  set_tests_properties(test_cuda_estimators PROPERTIES SKIP_REGULAR_EXPRESSION "no CUDA device: ")
endif()
