# Bad-input contract of `sparsefill prefill`: one clear error line and a non-zero exit.
if(TARGET sparsefill)
  set(_sf $<TARGET_FILE:sparsefill>)
  set(_ef ${PROJECT_SOURCE_DIR}/tests/tools/expect_fail.sh)
  set(_ok ${PROJECT_SOURCE_DIR}/tests/tools/expect_ok.sh)
  set(_tmp ${CMAKE_BINARY_DIR}/cli-test-tmp)
  set(_doc ${PROJECT_SOURCE_DIR}/data/long_document.txt)
  file(MAKE_DIRECTORY ${_tmp}/nonempty)
  file(MAKE_DIRECTORY ${_tmp}/pm)
  file(WRITE ${_tmp}/nonempty/keep "x")
  file(WRITE ${_tmp}/empty.txt "")
  file(WRITE ${_tmp}/short.txt "The lighthouse keeper climbed the stairs and")
  add_test(NAME cli_missing_model COMMAND ${_ef} "^error: model '/nonexistent/m.gguf' does not exist$"
           ${_sf} prefill --model /nonexistent/m.gguf --prompt hi)
  add_test(NAME cli_not_a_model COMMAND ${_ef} "^error: gguf: bad magic"
           ${_sf} prefill --model ${PROJECT_SOURCE_DIR}/data/long_document.txt --prompt hi)
  add_test(NAME cli_unknown_arch COMMAND ${_ef} "^error: unknown architecture 'gpt2'"
           ${_sf} prefill --model ${PROJECT_SOURCE_DIR}/tests/data/unknown_arch.gguf --prompt hi)
  add_test(NAME cli_empty_prompt COMMAND ${_ef} "^error: the prompt is empty$"
           ${_sf} prefill --model default --prompt-file ${_tmp}/empty.txt)
  add_test(NAME cli_unreadable_prompt COMMAND ${_ef} "^error: cannot read prompt file '/nonexistent/p.txt'"
           ${_sf} prefill --model default --prompt-file /nonexistent/p.txt)
  add_test(NAME cli_export_dir_not_empty COMMAND ${_ef} "^error: export dir .* exists and is not empty \\(use --force"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/nonempty)
  # --force replaces an earlier export only; "." or a trailing "/" must not reach remove_all.
  add_test(NAME cli_export_force_not_an_export COMMAND ${_ef}
           "^error: export dir .* is not empty and holds no manifest.json, so it is not a KV export"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/nonempty --force)
  file(MAKE_DIRECTORY ${_tmp}/dotdir)
  file(WRITE ${_tmp}/dotdir/keep "x")
  add_test(NAME cli_export_dir_dot COMMAND ${_ef} "^error: export dir '.' names no directory of its own"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv . --force)
  set_tests_properties(cli_export_dir_dot PROPERTIES WORKING_DIRECTORY ${_tmp}/dotdir)
  # Numbers are read whole: "64k" is not 64, "2k" not 2.
  add_test(NAME cli_chunk_not_an_integer COMMAND ${_ef} "^error: --chunk: '64k' is not an integer in \\[1, "
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --chunk 64k)
  add_test(NAME cli_bench_lengths_not_integers COMMAND ${_ef} "^error: --lengths: '2k' is not an integer >= 1$"
           ${_sf} bench prefill --lengths 512,2k)
  add_test(NAME cli_prompt_too_long COMMAND ${_ef} "^error: prompt has [0-9]+ tokens, more than the model context of 8192"
           ${_sf} prefill --model default --prompt-file ${_tmp}/long3x.txt)
  add_test(NAME cli_unknown_option COMMAND ${_ef} "^error: unknown option --frobnicate$"
           ${_sf} prefill --frobnicate)
  add_test(NAME cli_unknown_attention COMMAND ${_ef} "^error: unknown attention mode 'bogus'"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --attention bogus)
  # --kv-pool: spec and directory are checked before the model load; a tiny host budget puts
  # most blocks (one per layer for this short prompt) on disk.
  add_test(NAME cli_kv_pool_bad_spec COMMAND ${_ef} "^error: --kv-pool host: '64Q' is not a size"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool host=64Q,disk=${_tmp}/kvp)
  # The device forward scores importance by its LSE pass only: the estimator's source is refused
  # before anything loads (so this runs on machines without a GPU too).
  add_test(NAME cli_cuda_importance_estimator COMMAND ${_ef} "^error: --importance estimator runs on the CPU forward"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/cuda-imp
           --importance estimator --device cuda)
  set_tests_properties(cli_cuda_importance_estimator PROPERTIES LABELS unit TIMEOUT 60)
  # --help after a command prints the usage (every option of every command) on stdout, exit 0.
  add_test(NAME cli_command_help COMMAND ${_ok} "--prompt-tokens F.*--kv-dtype.*--dump-attention.*--kv-pool device=BYTES,host=BYTES.*--kv-ref-dtype" ${_sf} prefill --help)
  set_tests_properties(cli_command_help PROPERTIES LABELS unit TIMEOUT 30)
  # ... but "-h" as a valued option's value is that value: the prompt "-h" is prefilled.
  add_test(NAME cli_help_as_a_value COMMAND ${_ok} "prompt tokens: [0-9]+.*first token" ${_sf} prefill --model default --prompt -h)
  # ... and after --key=value it is a help request again (that option has its value).
  add_test(NAME cli_help_after_key_value COMMAND ${_ok} "^usage: sparsefill" ${_sf} prefill --prompt=hello -h)
  # ... and after a command's flag (each command's own parse knows which options take values).
  add_test(NAME cli_help_after_flag COMMAND ${_ok} "^usage: sparsefill" ${_sf} search --share-group -h)
  set_tests_properties(cli_help_as_a_value cli_help_after_key_value cli_help_after_flag PROPERTIES
                       LABELS unit TIMEOUT 60)
  add_test(NAME cli_kv_pool_device_on_cpu COMMAND ${_ef} "^error: --kv-pool device= needs --device cuda"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool device=64M,host=64M)
  add_test(NAME cli_kv_pool_no_host COMMAND ${_ef} "^error: --kv-pool: host=BYTES is required"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool disk=${_tmp}/kvp)
  add_test(NAME cli_kv_pool_bad_dir COMMAND ${_ef} "^error: --kv-pool: disk directory '/dev/null/kv' cannot be created"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool host=64M,disk=/dev/null/kv)
  add_test(NAME cli_kv_pool COMMAND ${_ok} "kv pool: host 10 blocks 983040 bytes \\(budget 983040\\); disk 20 blocks 1966080 bytes.*the forward held at most [0-9]+ bytes of KV" ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt
           --kv-pool host=1M,disk=${_tmp}/kvp)
  # --metrics-file: the pool's counters in Prometheus text, the same counts as the printed line;
  # without --kv-pool, or in a missing directory, refused before the model loads.
  add_test(NAME cli_kv_pool_metrics COMMAND ${PROJECT_SOURCE_DIR}/tests/tools/pool_metrics.sh ${_sf}
           ${_tmp}/short.txt ${_tmp}/kv-pool-metrics)
  add_test(NAME cli_metrics_file_needs_pool COMMAND ${_ef} "^error: --metrics-file writes the --kv-pool tiers' counters; give --kv-pool"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --metrics-file ${_tmp}/m.prom)
  add_test(NAME cli_metrics_file_bad_dir COMMAND ${_ef} "^error: --metrics-file '${_tmp}/no/such/m.prom': its directory '${_tmp}/no/such' does not exist"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool host=1M,disk=${_tmp}/kvp --metrics-file ${_tmp}/no/such/m.prom)
  # The host form's tiers too small for the prompt's KV: refused before the prefill (it used to
  # fail in the layer that did not fit).
  add_test(NAME cli_kv_pool_host_form_too_small COMMAND ${_ef} --stdout-lacks "time to first token"
           "^error: --kv-pool: tiered kv: the host and disk tiers hold 2 blocks of 98304 bytes; [0-9]+ tokens need 1 a layer, 30 for 30 layers"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --kv-pool host=98304,disk=${_tmp}/kvp-small:98304)
  set_tests_properties(cli_kv_pool_host_form_too_small PROPERTIES LABELS unit TIMEOUT 60)
  # eval --attention's --dump-nll is written during the first length's run: a path whose
  # directory is missing fails before the model loads.
  add_test(NAME cli_eval_dump_nll_bad_dir COMMAND ${_ef} --stdout-lacks "."
           "^error: --dump-nll '${_tmp}/no/such/nll-2048.tsv': its directory '${_tmp}/no/such' does not exist$"
           ${_sf} eval --attention a-shape --lengths 2048 --dump-nll ${_tmp}/no/such/nll --out ${_tmp}/eval.json)
  # A result printed on a stdout that cannot take it is a failure, not exit 0.
  add_test(NAME cli_stdout_full COMMAND ${_ef} "^error: writing the standard output failed: No space left on device$"
           bash -c "exec '${_sf}' bench prefill --model default --lengths 256 --reps 1 > /dev/full")
  set_tests_properties(cli_eval_dump_nll_bad_dir cli_stdout_full PROPERTIES LABELS unit TIMEOUT 120)
  set_tests_properties(cli_kv_pool_metrics cli_metrics_file_needs_pool cli_metrics_file_bad_dir
                       PROPERTIES LABELS unit TIMEOUT 120)
  # --kv-pool with --export-kv: the export is read from the pool (host and disk blocks), byte for
  # byte a plain run's, while the forward holds one layer's K/V at a time.
  add_test(NAME cli_kv_pool_export COMMAND ${PROJECT_SOURCE_DIR}/tests/tools/export_via_pool.sh ${_sf}
           ${_tmp}/export-via-pool)
  set_tests_properties(cli_kv_pool_export PROPERTIES LABELS unit TIMEOUT 180)
  # The same with a pool of 8 threads: 4 export threads, each reading its layer back from the pool
  # into its own buffers, write the same bytes.
  add_test(NAME cli_kv_pool_export_threads COMMAND ${PROJECT_SOURCE_DIR}/tests/tools/export_via_pool.sh
           ${_sf} ${_tmp}/export-via-pool-threads)
  set_tests_properties(cli_kv_pool_export_threads PROPERTIES LABELS unit TIMEOUT 180
                       ENVIRONMENT "SF_NUM_THREADS=8")
  set_tests_properties(cli_kv_pool_bad_spec cli_kv_pool_device_on_cpu cli_kv_pool_no_host cli_kv_pool_bad_dir cli_kv_pool
                       PROPERTIES LABELS unit TIMEOUT 120)
  # --dump-attention LAYER:FILE: bad specs fail before the slow part; a good one writes q, k, v
  # of that layer, which `bench attention --inputs` reads back (CUDA builds: it reports the file's
  # shape before it looks for a device, so this runs without a GPU: there its one error line, "no
  # usable CUDA device", is the accepted failure; on a GPU host the benchmark must exit 0).
  add_test(NAME cli_dump_attention_bad_spec COMMAND ${_ef} "^error: --dump-attention: expected LAYER:FILE, got '7'"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --dump-attention 7)
  # The layer is a whole number as every other (no sign or blank: strtoll took '+3').
  add_test(NAME cli_dump_attention_signed_layer COMMAND ${_ef} "^error: --dump-attention: expected LAYER:FILE, got '\\+3:"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --dump-attention +3:${_tmp}/att-signed.safetensors)
  add_test(NAME cli_dump_attention_bad_layer COMMAND ${_ef} "^error: --dump-attention: layer 30 of a 30-layer model"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --dump-attention 30:${_tmp}/att.safetensors)
  add_test(NAME cli_dump_attention COMMAND ${_ok} "attention inputs of layer 3: .*att.safetensors \\(q \\[[0-9]+, 9, 64\\], k and v \\[[0-9]+, 3, 64\\], F32\\)" ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt
           --dump-attention 3:${_tmp}/att.safetensors)
  set_tests_properties(cli_dump_attention PROPERTIES FIXTURES_SETUP dumped_attention)
  set_tests_properties(cli_dump_attention_bad_spec cli_dump_attention_signed_layer
                       cli_dump_attention_bad_layer cli_dump_attention PROPERTIES LABELS unit TIMEOUT 120)
  if(SF_HAVE_CUDA)
    # The planted inputs for the SDPA peer, written before any device is needed (one file a
    # length, BF16: 1024 x (32 + 2 x 8) x 128 x 2 bytes + header); without --seed, refused.
    add_test(NAME cli_bench_dump_inputs COMMAND ${_ok} "planted inputs of L=1024 \\(seed 5\\): .*planted-1024.safetensors \\(q \\[1024, 32, 128\\], k and v \\[1024, 8, 128\\], BF16\\).*planted inputs of L=2048"
             ${_sf} bench attention --lengths 1024 --sparse-lengths 2048 --seed 5 --dump-inputs ${_tmp}/planted)
    add_test(NAME cli_bench_dump_inputs_needs_seed COMMAND ${_ef} "^error: --dump-inputs needs --seed"
             ${_sf} bench attention --lengths 1024 --dump-inputs ${_tmp}/planted)
    set_tests_properties(cli_bench_dump_inputs cli_bench_dump_inputs_needs_seed PROPERTIES LABELS unit TIMEOUT 60)
    # An SDPA peer file of another shape is refused before any device is needed.
    file(WRITE ${_tmp}/sdpa-64heads.json "{\"shape\": {\"heads\": 64, \"kv_heads\": 8, \"head_dim\": 128}, \"results\": []}")
    add_test(NAME cli_bench_sdpa_other_shape COMMAND ${_ef}
             "^error: --sdpa: the peer's shape \\(heads 64, kv_heads 8, head_dim 128\\) is not this run's \\(32, 8, 128\\)"
             ${_sf} bench attention --lengths 1024 --sdpa ${_tmp}/sdpa-64heads.json)
    set_tests_properties(cli_bench_sdpa_other_shape PROPERTIES LABELS unit TIMEOUT 60)
    # Without a GPU the benchmark stops after reading the file, with one error line.
    add_test(NAME cli_bench_inputs_reads_dump COMMAND ${_ok} --or-error "^error: bench attention: no usable CUDA device"
             "inputs: .*att.safetensors \\(n [0-9]+, heads 9, kv heads 3, head_dim 64\\)"
             ${_sf} bench attention --inputs ${_tmp}/att.safetensors)
    set_tests_properties(cli_bench_inputs_reads_dump PROPERTIES FIXTURES_REQUIRED dumped_attention LABELS unit
                         TIMEOUT 60)
  endif()
  # The long prompt: the bundled document three times (> 8192 tokens).
  file(READ ${_doc} _doc_text)
  file(WRITE ${_tmp}/long3x.txt "${_doc_text}${_doc_text}${_doc_text}")
  # Successful paths: --allow-long on the same prompt is not run (slow); --force replaces a dir.
  add_test(NAME cli_export_force COMMAND ${_ok} "kv export: .*forced" ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt
           --export-kv ${_tmp}/forced --force)
  # A trailing "/" names the same directory (its temporary sibling must not land inside it).
  add_test(NAME cli_export_trailing_slash COMMAND ${_ok} "kv export: .*slashed" ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt
           --export-kv ${_tmp}/slashed/ --force)
  # Refused before the slow part (each `--stdout-lacks` the model line the load prints, or the
  # run's timing): arguments that would be misread, outputs that could not be written, inputs
  # that are not files.
  add_test(NAME cli_option_twice COMMAND ${_ef} "^error: option --prompt is given twice$"
           ${_sf} prefill --model default --prompt a --prompt b)
  add_test(NAME cli_value_is_an_option COMMAND ${_ef} "^error: option --export-kv needs a value \\(got option '--force'; use --export-kv=VALUE"
           ${_sf} prefill --model default --prompt a --export-kv --force)
  add_test(NAME cli_value_with_equals COMMAND ${_ef} "^error: --chunk: '--3' is not an integer"
           ${_sf} prefill --model default --prompt a --chunk=--3)
  add_test(NAME cli_prompt_file_is_a_directory COMMAND ${_ef} "^error: prompt file '${_tmp}' is a directory, not a file$"
           ${_sf} prefill --model default --prompt-file ${_tmp})
  add_test(NAME cli_dump_attention_layer_overflow COMMAND ${_ef} "^error: --dump-attention: expected LAYER:FILE, got '4294967296:"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --dump-attention 4294967296:${_tmp}/d.safetensors)
  add_test(NAME cli_dump_attention_missing_dir COMMAND ${_ef} --stdout-lacks "^model:" "^error: --dump-attention '${_tmp}/no/d.st': its directory '${_tmp}/no' does not exist"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --dump-attention 3:${_tmp}/no/d.st)
  add_test(NAME cli_importance_needs_export COMMAND ${_ef} "^error: --importance applies to --export-kv$"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --importance estimator)
  add_test(NAME cli_force_needs_export COMMAND ${_ef} "^error: --force applies to --export-kv$"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --force)
  add_test(NAME cli_pool_dir_inside_export COMMAND ${_ef} --stdout-lacks "^model:" "^error: --kv-pool disk='${_tmp}/pe/pool' and --export-kv '${_tmp}/pe/' overlap"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/pe/ --kv-pool host=1M,disk=${_tmp}/pe/pool)
  add_test(NAME cli_metrics_file_inside_export COMMAND ${_ef} --stdout-lacks "^model:" "^error: --metrics-file '${_tmp}/pm/m.prom' and --export-kv '${_tmp}/pm' overlap"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/pm --kv-pool host=1M,disk=${_tmp}/kvp-pm --metrics-file ${_tmp}/pm/m.prom)
  add_test(NAME cli_export_under_a_file COMMAND ${_ef} --stdout-lacks "^model:" "^error: --export-kv '${_tmp}/empty.txt/kv': '${_tmp}/empty.txt' exists and is not a directory"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --export-kv ${_tmp}/empty.txt/kv)
  add_test(NAME cli_attention_config_missing COMMAND ${_ef} --stdout-lacks "^model:" "^error: cannot read --attention config '/nonexistent/c.json'"
           ${_sf} prefill --model default --prompt-file ${_tmp}/short.txt --attention config:/nonexistent/c.json)
  add_test(NAME cli_search_out_dir_missing COMMAND ${_ef} "^error: --out '/nonexistent/c.json': its directory '/nonexistent' does not exist"
           ${_sf} search --calib ${_doc} --target-density 0.3 --out /nonexistent/c.json)
  add_test(NAME cli_search_dense_below_early COMMAND ${_ef} "^error: --dense-below: '1k' is not an integer"
           ${_sf} search --calib ${_doc} --target-density 0.3 --out ${_tmp}/c.json --dense-below 1k)
  add_test(NAME cli_moa_profile_density_too_low COMMAND ${_ef} "^error: --density 0.1 keeps 25 tokens a head at the shortest length 256, fewer than --sink \\+ --step \\(128\\)"
           ${_sf} moa-profile --out ${_tmp}/m.json --lengths 256 --density 0.1)
  add_test(NAME cli_moa_profile_out_dir_missing COMMAND ${_ef} "^error: --out '/nonexistent/m.json': its directory '/nonexistent' does not exist"
           ${_sf} moa-profile --out /nonexistent/m.json)
  add_test(NAME cli_bench_document_missing COMMAND ${_ef} "^error: cannot read document '/nonexistent/doc.txt'"
           ${_sf} bench prefill --lengths 256 --reps 1 --document /nonexistent/doc.txt)
  add_test(NAME cli_retention_eval_bad_name COMMAND ${_ef} "^error: --name '../up': 1-64 characters"
           ${_sf} eval --retention=full --name ../up)
  add_test(NAME cli_retention_eval_out_dir_under_file COMMAND ${_ef} "^error: --out-dir '${_tmp}/empty.txt/sub' cannot be created"
           ${_sf} eval --retention full --out-dir ${_tmp}/empty.txt/sub)
  # A sparse mode below its dense_below runs dense, and eval says so.
  add_test(NAME cli_eval_below_dense_below COMMAND ${_ok} "note: length 256 is below this mode's dense_below \\(1024\\): it runs dense there"
           ${_sf} eval --attention vertical-slash --lengths 256 --no-passkey --out ${_tmp}/eval-vs-256.json)
  set_tests_properties(cli_eval_below_dense_below PROPERTIES LABELS unit TIMEOUT 120)
  set_tests_properties(cli_option_twice cli_value_is_an_option cli_value_with_equals cli_prompt_file_is_a_directory
                       cli_dump_attention_layer_overflow cli_dump_attention_missing_dir cli_importance_needs_export
                       cli_force_needs_export cli_pool_dir_inside_export cli_metrics_file_inside_export
                       cli_export_under_a_file
                       cli_attention_config_missing cli_search_out_dir_missing cli_search_dense_below_early
                       cli_moa_profile_density_too_low cli_moa_profile_out_dir_missing cli_bench_document_missing
                       cli_retention_eval_bad_name cli_retention_eval_out_dir_under_file
                       PROPERTIES LABELS unit TIMEOUT 60)
  set_tests_properties(cli_missing_model cli_not_a_model cli_unknown_arch cli_empty_prompt cli_unreadable_prompt
                       cli_export_dir_not_empty cli_prompt_too_long cli_unknown_option cli_export_force cli_unknown_attention
                       cli_export_force_not_an_export cli_export_dir_dot cli_export_trailing_slash
                       cli_chunk_not_an_integer cli_bench_lengths_not_integers
                       PROPERTIES LABELS unit TIMEOUT 120)
endif()
