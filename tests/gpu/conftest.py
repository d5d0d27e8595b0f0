"""tests/gpu: CUDA-only tests (marker ``cuda``), skipped where torch sees no CUDA device."""

from tests.gpu.cuda_race import cuda  # noqa: F401  (the fixture, for every module here)
