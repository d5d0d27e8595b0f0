"""torchrec_swp: TorchRec's training pipelines as declarative plans on one shared engine.

``torchrec_swp.plan``, ``.compile`` and ``.sim`` are pure Python; the pipeline classes
(importable from here) need torch and the supported TorchRec version, and are loaded on
first use so that the pure layers import without them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The upstream pipelines (also those upstream exports only from train_pipelines, and
# TrainPipelinePEC, which exists from TorchRec 1.9).
_PIPELINES = (
    "TrainPipelineBase",
    "TrainPipelinePT2",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "StagedTrainPipeline",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelinePEC",
)

__all__ = ["__version__", *_PIPELINES]


def __getattr__(name: str) -> Any:
    if name in _PIPELINES:
        from torchrec_swp.integrations.torchrec import pipelines

        if not hasattr(pipelines, name):
            raise ImportError(
                f"{name} is new in TorchRec 1.9; torchrec {pipelines.TORCHREC.text} is installed "
                "(pip install --no-deps torchrec==1.9.2)"
            )
        return getattr(pipelines, name)
    raise AttributeError(f"module 'torchrec_swp' has no attribute {name!r}")
