# KV-export interop: sparsefill's --export-kv output must drive Hugging Face generation unchanged.
# Needs the pinned reference stack in ${PROJECT_SOURCE_DIR}/.venv-ref; skips (77) without it.
if(TARGET sparsefill)
  add_test(NAME interop_kv_export
           COMMAND ${PROJECT_SOURCE_DIR}/tests/interop/run_interop.sh $<TARGET_FILE:sparsefill>
                   ${PROJECT_SOURCE_DIR})
  set_tests_properties(interop_kv_export PROPERTIES LABELS interop SKIP_RETURN_CODE 77 TIMEOUT 900)
  # The checker on fabricated exports: clean ones pass, perturbed ones (a key moved, a NaN key, a
  # stale checksum, another RoPE layout) must fail.
  add_test(NAME interop_kv_checker_self_check
           COMMAND ${PROJECT_SOURCE_DIR}/tests/interop/run_interop.sh $<TARGET_FILE:sparsefill>
                   ${PROJECT_SOURCE_DIR} --self-check)
  set_tests_properties(interop_kv_checker_self_check PROPERTIES LABELS interop SKIP_RETURN_CODE 77
                       TIMEOUT 600)
endif()
