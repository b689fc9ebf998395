sf_add_test(test_forward_golden SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_forward_golden.cpp LABELS golden LIBS sf_model
            TIMEOUT 1200)
sf_add_test(test_model_unit SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_model_unit.cpp LABELS unit LIBS sf_model)
sf_add_test(test_sparse_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sparse_config.cpp LABELS unit LIBS sf_model)
