sf_add_test(test_cpu_kernels SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cpu_kernels.cpp LABELS unit LIBS sf_kernels)
