"""``make gpu-check``: what can only be checked on a CUDA device, in four parts (see docs/gpu_check.md).

``env`` (standard library only) finds a CUDA torch and prepares ``.venv-gpu``; ``run`` runs the
parts in it: ``streams`` (a), ``parity`` (b), ``bench`` (c), ``trace`` (d) with ``overlap``;
``report`` writes and renders the results. The entry point is ``benchmarks/gpu_check.py``.
"""
