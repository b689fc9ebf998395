sf_add_test(test_retention SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_retention.cpp LABELS unit LIBS sf_kvstore)
sf_add_test(test_kv_quant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_quant.cpp LABELS unit LIBS sf_kvstore)
# Also gpu: its device-tier cases run (not skip) only on a GPU host's CUDA build.
sf_add_test(test_block_pool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_block_pool.cpp LABELS unit gpu
            LIBS sf_kvstore TIMEOUT 60)
sf_add_test(test_prefix_cache SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_prefix_cache.cpp LABELS unit
            LIBS sf_kvstore TIMEOUT 60)
# The same contract on the default model.
sf_add_test(test_prefix_cache_model SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_prefix_cache_model.cpp
            LABELS quality LIBS sf_kvstore TIMEOUT 300)
sf_add_test(test_tiered_kv SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tiered_kv.cpp LABELS unit
            LIBS sf_kvstore TIMEOUT 120)
sf_add_test(test_position_runs SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_position_runs.cpp LABELS unit
            LIBS sf_kvstore TIMEOUT 60)
