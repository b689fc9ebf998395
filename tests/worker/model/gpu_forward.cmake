# The CUDA prefill forward vs the CPU forward; label gpu. Each case GTEST_SKIPs where there is no
# device; a run where all skipped exits 77, a CTest "skipped" (sf_add_test).
if(SF_HAVE_CUDA)
  sf_add_test(test_gpu_forward SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gpu_forward.cpp LABELS gpu
              LIBS sf_model sf_kvstore)
endif()
