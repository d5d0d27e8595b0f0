"""Known schedules as plans, pure data (no torch): ``catalog.torchrec``, TorchRec's pipelines;
``catalog.transforms``, the plan transforms that change only where and when work runs
(``catalog.torchrec`` imports them, never the reverse); ``catalog.accumulation``, gradient
accumulation as phases.

Below the engine and the auto-scheduler in the layering, so both may use them; the drop-in
pipelines (``integrations.torchrec``) bind these plans' tasks to TorchRec's helpers.
"""
