sf_add_test(test_tokenizer SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.cpp LABELS golden
            LIBS sf_model)
