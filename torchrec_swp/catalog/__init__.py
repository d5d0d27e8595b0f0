"""Known schedules as plans, pure data (no torch): ``catalog.torchrec``, TorchRec's pipelines.

Below the engine and the auto-scheduler in the layering, so both may use them; the drop-in
pipelines (``integrations.torchrec``) bind these plans' tasks to TorchRec's helpers.
"""
