sf_add_test(test_kv_client SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_client.cpp LABELS unit LIBS sf_decode)
sf_add_test(test_decode SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_decode.cpp LABELS unit LIBS sf_decode)
# The default model end to end: prefill -> export -> load -> decode equals the dense continuation.
sf_add_test(test_decode_model SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_decode_model.cpp LABELS quality
            LIBS sf_decode TIMEOUT 1200)
# The decode node on a CUDA device vs the host reference; label gpu, skips without a device.
if(SF_HAVE_CUDA)
  sf_add_test(test_device_decode SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_device_decode.cpp
              LABELS gpu LIBS sf_decode)
endif()
