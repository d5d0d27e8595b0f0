"""The TorchRec plugin: the drop-in subclasses of the upstream pipelines.

Their plans are pure data in ``torchrec_swp.catalog.torchrec``. ``compat`` checks the TorchRec
version (1.8.x or 1.9.x) and holds what differs between them; ``pipelines`` imports TorchRec.

Plugin boundary. TorchRec owns the model rewrite (``_rewrite_model``), input dist, embedding
lookup and prefetch, the pipeline state user code reads (``batches``, ``contexts``, ...) and
every helper a task calls. torchrec_swp owns the schedule: which helper runs when, for which
batch, on which thread and stream, and its execution by the engine. torchrec_swp never patches
TorchRec; where upstream cannot run on CPU, our subclasses (``pipelines/cpu_safe.py``, the
device-aware forwards of ``fused`` and ``semi_sync``) do the CPU-correct thing.

TorchRec private names relied on (all of ``train_pipelines.py``, in 1.8 and 1.9, unless stated),
so a TorchRec upgrade must be checked against this list (``make upstream-suite`` runs upstream's
own pipeline tests with our classes swapped in):

* pipeline state: ``_model``, ``_optimizer``, ``_device``, ``_model_fwd``, ``_model_attached``,
  ``_state``, ``_batch_count``, ``_next_index``, ``_context``, ``_cur_batch``, ``_connected``,
  ``_data_iter_stopped``, ``_dataloader_exhausted``, ``_pipelined_modules``,
  ``_pipelined_forward_type``, ``_stream_context``, ``_memcpy_stream``, ``_data_dist_stream``,
  ``_prefetch_stream``, ``_default_stream``, ``_compute_stream``, ``_emb_lookup_stream``;
* options read back: ``_execute_all_batches``, ``_enqueue_batch_after_forward``,
  ``_clear_data_dist_inputs``, ``_enable_inplace_copy_batch``, ``_dmp_collection_sync_interval_batches``,
  ``_embedding_lookup_after_data_dist``, ``_enable_embedding_lookup_prefetch``, ``_start_batch``,
  ``_stash_gradients``;
* helpers called: ``_next_batch``, ``_copy_batch_to_gpu``, ``_wait_for_batch``, ``_backward``,
  ``_optimizer_step``, ``_create_context``, ``_set_module_context``, ``_init_pipelined_modules``,
  ``_prefetch``, ``_validate_optimizer``, ``_grad_swap``, ``_mlp_forward``,
  ``_mlp_optimizer_step``; ``utils._wait_for_batch``, ``utils._to_device``;
* TrainPipelinePT2: ``_iter``, ``_compile_configs``, ``_pre_compile_fn``, ``_post_compile_fn``,
  ``_input_transformer``; CompAutograd: ``get_compiled_autograd_ctx``,
  ``compiled_autograd_options``; StagedTrainPipeline: ``_pipeline_stages``, ``_num_steps``,
  ``_initialized``, ``_flushing``;
* TrainPipelinePEC (1.9, ``pec_train_pipeline.py``): ``_pec_modules``, ``_input_dist_event``,
  ``_overlap_dist_event``, ``_pec_overlap_dist``, ``_pec_ol_compute``, ``_pec_nol_compute``,
  ``_compute_and_output_dist``, ``_start_deferred_nol_grad``, ``_defer_nol_grad``,
  ``_start_pec_ol_grad``, ``_wait_pec_grad``, ``_record_stream_forward_ctx``,
  ``_record_stream_backward_ctx``; ``_async_inplace_copy`` (1.9's mixin, left off);
* SparseDataDistUtil (``pipeline_stage.py``): ``_pipelined_forward``, ``initialized``, ``_device``;
* GradientAccumulationWrapper (``gradient_accumulation.py``, 1.8 and 1.9): ``_pipeline``, ``_model``,
  ``_config``, ``_optimizer_wrapper`` (its ``_needs_zero_grad``), ``_advance_state``,
  ``_get_ddp_modules``; it sets the pipeline's ``_optimizer``;
* torch (CompAutograd on CPU): DDP's ``_use_python_reducer``, ``_remove_autograd_hooks``,
  ``_register_accum_grad_hook``, ``_bucket_config``; ``torch._inductor.config._fuse_ddp_*``;
  ``torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST``.
"""
