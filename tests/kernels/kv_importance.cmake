sf_add_test(test_kv_importance SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_importance.cpp LABELS unit
            LIBS sf_model sf_kernels)
