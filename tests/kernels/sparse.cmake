sf_add_test(test_sparse SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sparse.cpp LABELS unit LIBS sf_kernels)
