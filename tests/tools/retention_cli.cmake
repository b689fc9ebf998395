# Bad-input contract of `sparsefill eval --retention`, `prefill --retention` and sparsefill-decode,
# plus one end-to-end run: prefill --export-kv, then sparsefill-decode reproduces the dense
# continuation (--reference) from the verified export.
if(TARGET sparsefill AND TARGET sparsefill-decode)
  set(_rsf $<TARGET_FILE:sparsefill>)
  set(_rdec $<TARGET_FILE:sparsefill-decode>)
  set(_ref ${PROJECT_SOURCE_DIR}/tests/tools/expect_fail.sh)
  set(_rok ${PROJECT_SOURCE_DIR}/tests/tools/expect_ok.sh)
  set(_rtmp ${CMAKE_BINARY_DIR}/retention-cli-tmp)
  file(MAKE_DIRECTORY ${_rtmp})
  file(WRITE ${_rtmp}/short.txt "The lighthouse keeper climbed the stairs and looked out over the harbour, where")
  add_test(NAME cli_retention_budget_out_of_range
           COMMAND ${_ref} "^error: .*--budget '1.5' out of range" ${_rsf} eval --retention snapkv --budget 1.5)
  add_test(NAME cli_retention_unknown_policy
           COMMAND ${_ref} "^error: .*--retention 'h2o' is not" ${_rsf} eval --retention h2o)
  add_test(NAME cli_prefill_retention_budget_too_large
           COMMAND ${_ref} --stdout-lacks "time to first token" "^error: .*retention snapkv: budget 100000 tokens out of range"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/big --force
                   --retention snapkv:budget=100000)
  add_test(NAME cli_retention_eval_bad_span
           COMMAND ${_ref} "^error: .*--span '0' must be an integer in \\[1, 256\\]"
                   ${_rsf} eval --retention adakv --span 4,0)
  add_test(NAME cli_prefill_retention_bad_span
           COMMAND ${_ref} "^error: .*retention snapkv: span 300 out of range \\[1, 256\\]"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/span --force
                   --retention snapkv:budget=8,span=300)
  # moa: a bad spec or a config for another model fails before the prefill; bare `moa` uses the
  # shipped config scaled to the budget, and its record states the spans and the scale.
  file(WRITE ${_rtmp}/moa-2x3.json "{\"n_layers\": 2, \"n_kv_heads\": 3, \"layers\": [[{\"alpha\": 8, \"beta\": 0}, {\"alpha\": 8, \"beta\": 0}, {\"alpha\": 8, \"beta\": 0}], [{\"alpha\": 8, \"beta\": 0}, {\"alpha\": 8, \"beta\": 0}, {\"alpha\": 8, \"beta\": 0}]]}")
  add_test(NAME cli_retention_eval_moa_missing_config
           COMMAND ${_ref} "^error: .*cannot read moa config '/nonexistent/moa.json'"
                   ${_rsf} eval --retention snapkv,moa:config=/nonexistent/moa.json,sink=4)
  add_test(NAME cli_retention_eval_moa_wrong_model
           COMMAND ${_ref} "^error: .*retention moa: config \\('.*moa-2x3.json'\\) has 2 layers, the cache has 30"
                   ${_rsf} eval --retention moa:config=${_rtmp}/moa-2x3.json,sink=4,full)
  add_test(NAME cli_prefill_retention_moa_wrong_model
           COMMAND ${_ref} "^error: .*retention moa: config \\('.*moa-2x3.json'\\) has 2 layers, the cache has 30"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/moa --force
                   --retention moa:config=${_rtmp}/moa-2x3.json)
  add_test(NAME cli_prefill_retention_moa
           COMMAND ${_rok} "retention: moa config=.*smollm2-135m-instruct-moa.json,sink=4,heads=30x3, 100.0% of the tokens; K/V stored as f32, 100.0% of an F32 full cache's bytes"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/moa --force
                   --retention moa:config=${PROJECT_SOURCE_DIR}/configs/smollm2-135m-instruct-moa.json,sink=4)
  add_test(NAME cli_retention_eval_moa
           COMMAND ${_rok} "moa +0.50 +full +span 1 +f32 +kv 0\\.(49[0-9]|500) .*\"moa_scale\":[0-9.]+(E-[0-9]+)?,\"moa_spans\""
                   bash -c "set -e; '${_rsf}' eval --retention moa --budget 0.5 --length 256 --tokens 4 --no-passkey --out-dir '${_rtmp}/moa-eval'; grep -o '\"moa_scale\":[0-9][0-9.eE+-]*,\"moa_spans\":\\[\\[{' '${_rtmp}/moa-eval/retention-moa.json'")
  # KV encodings: bad names fail before any work; an int8 export decodes to the dense
  # continuation on this prompt, an int4 one loads and says what it stored.
  add_test(NAME cli_retention_eval_bad_kv_dtype
           COMMAND ${_ref} "^error: --kv-dtype: KV encoding 'fp8' is not f32, bf16, int8 or int4"
                   ${_rsf} eval --retention adakv --kv-dtype int8,fp8)
  add_test(NAME cli_prefill_kv_dtype_needs_export
           COMMAND ${_ref} "^error: .*--kv-dtype applies to --export-kv"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --kv-dtype int8)
  add_test(NAME cli_decode_int8_export
           COMMAND ${_rok} "K/V stored as int8: [0-9]+ of [0-9]+ KV bytes \\(100.0%\\).*first 16 of 16 tokens equal"
                   bash -c "set -e; '${_rsf}' prefill --model default --prompt-file '${_rtmp}/short.txt' --export-kv '${_rtmp}/e2e8' --kv-dtype int8 --force; '${_rdec}' --model default --kv '${_rtmp}/e2e8' --tokens 16 --reference")
  # Two tiers: HIGH+LOW pairs with a retention's high=TOKENS (each without the other fails before
  # the prefill); the eval's HIGH+LOW:SHARE keeps the bytes at the budget.
  add_test(NAME cli_prefill_two_tiers_need_high
           COMMAND ${_ref} "^error: .*--kv-dtype HIGH\\+LOW needs a --retention with high=TOKENS"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/t2 --force
                   --retention snapkv:budget=8 --kv-dtype int8+int4)
  add_test(NAME cli_prefill_two_tiers_low_narrower
           COMMAND ${_ref} "^error: .*the low tier must be narrower"
                   ${_rsf} prefill --model default --prompt-file ${_rtmp}/short.txt --export-kv ${_rtmp}/t2 --force
                   --retention snapkv:budget=12,window=4,high=8 --kv-dtype int4+int8)
  add_test(NAME cli_decode_two_tier_export
           COMMAND ${_rok} "retention snapkv:budget=12,window=4,pool=7,high=8, K/V stored as int8\\+int4"
                   bash -c "set -e; '${_rsf}' prefill --model default --prompt-file '${_rtmp}/short.txt' --export-kv '${_rtmp}/e2e-t2' --retention snapkv:budget=12,window=4,high=8 --kv-dtype int8+int4 --force; '${_rdec}' --model default --kv '${_rtmp}/e2e-t2' --tokens 4")
  add_test(NAME cli_retention_eval_two_tiers_need_scores
           COMMAND ${_ref} "^error: .*two tiers need a scored policy"
                   ${_rsf} eval --retention streaming --kv-dtype int8+int4:0.6)
  add_test(NAME cli_decode_missing_export
           COMMAND ${_ref} "^error: .*no manifest.json in '/nonexistent/kv'" ${_rdec} --kv /nonexistent/kv)
  # The options parse as the sparsefill CLI's (common/args.h): a repeat and a value that is an
  # option are refused, --key=VALUE is a value.
  add_test(NAME cli_decode_option_twice
           COMMAND ${_ref} "^error: option --kv is given twice$" ${_rdec} --kv /nonexistent/a --kv /nonexistent/b)
  add_test(NAME cli_decode_value_is_an_option
           COMMAND ${_ref} "^error: option --kv needs a value \\(got option '--reference'" ${_rdec} --kv --reference)
  add_test(NAME cli_decode_inline_value
           COMMAND ${_ref} "^error: .*no manifest.json in '/nonexistent/kv'" ${_rdec} --kv=/nonexistent/kv)
  # The device step's flags parse on any build (the export check comes after them).
  add_test(NAME cli_decode_device_flags
           COMMAND ${_ref} "^error: .*no manifest.json in '/nonexistent/kv'" ${_rdec} --kv /nonexistent/kv
                   --no-cuda-graph --no-fused-step)
  # --device cuda: on a machine without a GPU one line saying so (before the model loads); with
  # one, the missing export.
  add_test(NAME cli_decode_cuda_without_gpu
           COMMAND ${_ref} "^error: (--device cuda: .+|--kv: no manifest.json in '/nonexistent/kv'.*)$" ${_rdec} --kv /nonexistent/kv
                   --device cuda)
  add_test(NAME cli_decode_bad_attention
           COMMAND ${_ref} "^error: .*decode attention 'topk' is not" ${_rdec} --kv /nonexistent/kv --attention topk)
  add_test(NAME cli_decode_reproduces_dense
           COMMAND ${_rok} "first 16 of 16 tokens equal"
                   bash -c "set -e; '${_rsf}' prefill --model default --prompt-file '${_rtmp}/short.txt' --export-kv '${_rtmp}/e2e' --force; '${_rdec}' --model default --kv '${_rtmp}/e2e' --tokens 16 --reference")
  # Lists: an empty one or an empty item is refused before the model loads (it used to run every
  # window and then rewrite the results file with no records); --psa with no one-tier encoding to
  # decode is refused (it used to be dropped).
  add_test(NAME cli_retention_eval_empty_list
           COMMAND ${_ref} "^error: --kv-dtype is empty$" ${_rsf} eval --retention snapkv --kv-dtype=
                   --out-dir ${_rtmp}/never)
  add_test(NAME cli_retention_eval_empty_item
           COMMAND ${_ref} "^error: --budget: '0.1,,0.5' has an empty item$" ${_rsf} eval --retention snapkv
                   --budget 0.1,,0.5 --out-dir ${_rtmp}/never)
  add_test(NAME cli_retention_eval_psa_two_tiers_only
           COMMAND ${_ref} "^error: --psa decodes the full cache in a one-tier --kv-dtype" ${_rsf} eval
                   --retention snapkv --kv-dtype int8+int4 --psa 0.9 --out-dir ${_rtmp}/never)
  # Numbers are plain decimals: a hex float is not read as one.
  add_test(NAME cli_retention_eval_hex_budget
           COMMAND ${_ref} "^error: .*--budget '0x1p-2' out of range" ${_rsf} eval --retention snapkv
                   --budget 0x1p-2 --out-dir ${_rtmp}/never)
  set_tests_properties(cli_retention_eval_empty_list cli_retention_eval_empty_item
                       cli_retention_eval_psa_two_tiers_only cli_retention_eval_hex_budget
                       PROPERTIES LABELS unit TIMEOUT 60)
  set_tests_properties(cli_retention_budget_out_of_range cli_retention_unknown_policy
                       cli_prefill_retention_budget_too_large cli_decode_missing_export
                       cli_decode_option_twice cli_decode_value_is_an_option cli_decode_inline_value
                       cli_decode_device_flags cli_decode_cuda_without_gpu cli_decode_bad_attention
                       cli_decode_reproduces_dense cli_retention_eval_moa_missing_config
                       cli_retention_eval_moa_wrong_model cli_prefill_retention_moa_wrong_model
                       cli_prefill_retention_moa cli_retention_eval_moa cli_retention_eval_bad_span
                       cli_prefill_retention_bad_span cli_retention_eval_bad_kv_dtype
                       cli_prefill_kv_dtype_needs_export cli_decode_int8_export
                       cli_prefill_two_tiers_need_high cli_prefill_two_tiers_low_narrower
                       cli_decode_two_tier_export cli_retention_eval_two_tiers_need_scores
                       PROPERTIES LABELS unit TIMEOUT 120)
endif()
