# Quality gate on the real model (label `quality`): the shipped searched config at 2K tokens.
if(TARGET sf_eval)
  sf_add_test(test_quality SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quality.cpp LABELS quality
              LIBS sf_eval sf_model TIMEOUT 900)
endif()
