# Bad-input contract of `sparsefill eval --retention`, `prefill --retention` and sparsefill-decode,
# plus one end-to-end run: prefill --export-kv, then sparsefill-decode reproduces the dense
# continuation (--reference) from the verified export.
if(TARGET sparsefill AND TARGET sparsefill-decode)
  set(_rsf $<TARGET_FILE:sparsefill>)
  set(_rdec $<TARGET_FILE:sparsefill-decode>)
  set(_ref ${PROJECT_SOURCE_DIR}/tests/tools/expect_fail.sh)
  set(_rtmp ${CMAKE_BINARY_DIR}/retention-cli-tmp)
  file(MAKE_DIRECTORY ${_rtmp})
  file(WRITE ${_rtmp}/short.txt "The lighthouse keeper climbed the stairs and looked out over the harbour, where")
  add_test(NAME cli_retention_budget_out_of_range
           COMMAND ${_ref} "^error: .*--budget '1.5' out of range" ${_rsf} eval --retention snapkv --budget 1.5)
  add_test(NAME cli_retention_unknown_policy
           COMMAND ${_ref} "^error: .*--retention 'h2o' is not" ${_rsf} eval --retention h2o)
  add_test(NAME cli_prefill_retention_budget_too_large
           COMMAND ${_ref} "^error: .*retention snapkv: budget 100000 tokens out of range"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/big --force
                   --retention snapkv:budget=100000)
  add_test(NAME cli_decode_missing_export
           COMMAND ${_ref} "^error: .*no manifest.json in '/nonexistent/kv'" ${_rdec} --kv /nonexistent/kv)
  add_test(NAME cli_decode_bad_attention
           COMMAND ${_ref} "^error: .*decode attention 'topk' is not" ${_rdec} --kv /nonexistent/kv --attention topk)
  add_test(NAME cli_decode_reproduces_dense
           COMMAND bash -c "set -e; '${_rsf}' prefill --model default --prompt-file '${_rtmp}/short.txt' --export-kv '${_rtmp}/e2e' --force; '${_rdec}' --model default --kv '${_rtmp}/e2e' --tokens 16 --reference")
  set_tests_properties(cli_decode_reproduces_dense PROPERTIES PASS_REGULAR_EXPRESSION "first 16 of 16 tokens equal")
  set_tests_properties(cli_retention_budget_out_of_range cli_retention_unknown_policy
                       cli_prefill_retention_budget_too_large cli_decode_missing_export cli_decode_bad_attention
                       cli_decode_reproduces_dense PROPERTIES LABELS unit TIMEOUT 120)
endif()
