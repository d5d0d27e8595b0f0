"""TorchRec 1.9's Maglev pipeline-parallel schedules as programs on the engine.

* ``pipelines``: drop-in subclasses of ``MaglevPipelineBase``, ``Maglev1F1B`` and
  ``Maglev1F1BRecvAhead`` (same constructors, plus keyword-only options defined in
  ``program_options``) whose ``progress()`` is ``ProgramEngine.run_program`` of the builder's
  program for the rank.
* ``pipeline_rank``: ``PipelineRank``, a rank holding several stages (interleaved, V schedules) of the
  same authored model.
* ``runtime``: the bindings of every action kind (``RankRuntime``) and the two wires.
* ``cpu``: what Maglev needs to run on the CPU (an input driver over gloo), a small model and
  its data.

``torchrec.distributed.maglev`` is new in TorchRec 1.9: with 1.8 importing this package raises
an ImportError that says so.
"""

from torchrec_swp.integrations.torchrec.compat import installed

TORCHREC = installed()  # ImportError naming the supported versions if another is installed
if not TORCHREC.has_maglev:
    raise ImportError(
        f"torchrec_swp's Maglev pipelines need torchrec.distributed.maglev, new in TorchRec 1.9; torchrec "
        f"{TORCHREC.text} is installed (pip install --no-deps torchrec==1.9.2)"
    )

# after the version check: on TorchRec 1.8 the ImportError above names 1.9, not a missing module
from torchrec_swp.integrations.torchrec.maglev.pipeline_rank import PipelineRank  # noqa: E402
from torchrec_swp.integrations.torchrec.maglev.pipelines import (  # noqa: E402
    Maglev1F1B,
    Maglev1F1BRecvAhead,
    MaglevPipelineBase,
)

__all__ = ["Maglev1F1B", "Maglev1F1BRecvAhead", "MaglevPipelineBase", "PipelineRank"]
