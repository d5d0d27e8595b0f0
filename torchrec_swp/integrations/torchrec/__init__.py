"""The TorchRec plugin: plans of the upstream pipelines and their drop-in subclasses.

``plans`` is pure data. ``pipelines`` imports TorchRec (after checking its version).

Plugin boundary: TorchRec owns the model rewrite (``_rewrite_model``), input dist, the pipeline
state (``batches``, ``contexts``, ...) and every helper a task calls; torchrec_swp owns the
schedule (which helper runs when, on which thread and stream) and its execution. TorchRec private
names relied on: ``TrainPipelineSparseDist._init_pipelined_modules``, ``_set_module_context``,
``_wait_for_batch``, ``_backward``, ``_optimizer_step``, ``_model_fwd``, ``_pipelined_modules``,
``_memcpy_stream``, ``_data_dist_stream``, ``_execute_all_batches``,
``_enqueue_batch_after_forward``, ``_clear_data_dist_inputs``, ``_dmp_collection_sync_interval_batches``;
``TrainPipelineBase._next_batch``, ``_copy_batch_to_gpu``, ``_wait_for_batch``, ``_backward``,
``_cur_batch``, ``_connected``, ``_data_iter_stopped``, ``_batch_count``.
"""
