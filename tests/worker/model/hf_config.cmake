sf_add_test(test_hf_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_hf_config.cpp LABELS unit
            LIBS sf_model)
