sf_add_test(test_safetensors SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_safetensors.cpp LABELS unit
            LIBS sf_common)
sf_add_test(test_metrics SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_metrics.cpp LABELS unit
            LIBS sf_common)
sf_add_test(test_file_io SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_file_io.cpp LABELS unit
            LIBS sf_common)
sf_add_test(test_thread_pool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_thread_pool.cpp LABELS unit
            LIBS sf_common)
sf_add_test(test_text SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_text.cpp LABELS unit
            LIBS sf_common)
sf_add_test(test_args SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_args.cpp LABELS unit
            LIBS sf_common)
