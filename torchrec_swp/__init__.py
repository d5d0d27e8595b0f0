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



def _available() -> tuple[str, ...]:
    """The pipelines the installed TorchRec has (TrainPipelinePEC from 1.9 on); all of them when
    none or an unsupported one is installed (using them then raises an ImportError saying why)."""
    from importlib import metadata

    from torchrec_swp.integrations.torchrec.compat import parse_version

    try:
        has_pec = parse_version(metadata.version("torchrec")).has_pec
    except (metadata.PackageNotFoundError, ValueError):
        return _PIPELINES
    return _PIPELINES if has_pec else tuple(p for p in _PIPELINES if p != "TrainPipelinePEC")


__all__ = ["__version__", *_available()]


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
