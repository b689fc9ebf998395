# CUDA backend vs the CPU reference; label gpu. Each case GTEST_SKIPs where there is no device;
# a run where all skipped exits 77, a CTest "skipped" instead of "passed" (sf_add_test).
if(SF_HAVE_CUDA)
  sf_add_test(test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.cpp LABELS gpu LIBS sf_kernels)
  target_link_libraries(test_cuda_ops PRIVATE CUDA::cudart_static)
endif()
if(SF_HAVE_CUDA)
  sf_add_test(test_cuda_estimators SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_estimators.cpp LABELS gpu LIBS sf_kernels)
  target_link_libraries(test_cuda_estimators PRIVATE CUDA::cudart_static)
endif()
