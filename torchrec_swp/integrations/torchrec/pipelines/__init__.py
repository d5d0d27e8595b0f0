"""Drop-in subclasses of TorchRec's pipelines whose ``progress()`` is the engine running a plan.

Change one import line and training is identical; pass the engine's options (``plan=``,
``thread_map=``, ``loads=``, ``lookahead=``: ``engine_options.EngineOptions``, applied in that order)
to change the schedule without changing code or numbers::

    from torchrec_swp import TrainPipelineSparseDist
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    pipeline.plan.print_schedule(5)
    pipeline = TrainPipelineSparseDist(model, optimizer, device, thread_map="io", loads=2, lookahead=2)

One module per upstream family; ``_driven`` holds what they share, ``engine_options`` the options,
``training_tasks`` the task functions several families run the same way.
"""

from torchrec_swp import EXPERIMENTAL_PIPELINES
from torchrec_swp.integrations.torchrec.compat import installed

TORCHREC = installed()  # ImportError naming the supported versions if another is installed

# The experimental pipelines (upstream's experimental_pipelines.py, in TorchRec 1.8.0 and 1.9.2
# alike) are imported ``X as X``: __all__ names them through EXPERIMENTAL_PIPELINES, which a
# linter cannot read, and torchrec_swp.__getattr__ takes them from this module.
from torchrec_swp.integrations.torchrec.pipelines.backward_optimizer import (  # noqa: E402
    TrainPipelineSparseDistBwdOpt as TrainPipelineSparseDistBwdOpt,
)
from torchrec_swp.integrations.torchrec.pipelines.base import TrainPipelineBase  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.compiled import (  # noqa: E402
    TrainPipelinePT2,
    TrainPipelineSparseDistCompAutograd,
)
from torchrec_swp.integrations.torchrec.pipelines.cpu_sparse import (  # noqa: E402
    EvalPipelineCPUSparse as EvalPipelineCPUSparse,
)
from torchrec_swp.integrations.torchrec.pipelines.eval import EvalPipelineSparseDist  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.fused import (  # noqa: E402
    EvalPipelineFusedSparseDist,
    TrainPipelineFusedSparseDist,
)
from torchrec_swp.integrations.torchrec.pipelines.lite import TrainPipelineSparseDistLite  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.prefetch import PrefetchTrainPipelineSparseDist  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.semi_sync import TrainPipelineSemiSync  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.staged import StagedTrainPipeline  # noqa: E402
from torchrec_swp.integrations.torchrec.pipelines.stashing import (  # noqa: E402
    TrainPipelinePrefetchEMS as TrainPipelinePrefetchEMS,
)
from torchrec_swp.integrations.torchrec.pipelines.stashing import (  # noqa: E402
    TrainPipelineSparseDistEmbStash as TrainPipelineSparseDistEmbStash,
)
from torchrec_swp.integrations.torchrec.pipelines.stashing import (  # noqa: E402
    TrainPipelineSparseDistOptStash as TrainPipelineSparseDistOptStash,
)
from torchrec_swp.integrations.torchrec.pipelines.threaded_copy import (  # noqa: E402
    TrainPipelineSparseDistT as TrainPipelineSparseDistT,
)
from torchrec_swp.integrations.torchrec.pipelines.train_eval_hybrid import (  # noqa: E402
    TrainEvalHybridPipelineBase as TrainEvalHybridPipelineBase,
)

if TORCHREC.has_pec:
    from torchrec_swp.integrations.torchrec.pipelines.pec import TrainPipelinePEC  # noqa: E402, F401

__all__ = [
    "EvalPipelineFusedSparseDist",
    "EvalPipelineSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "StagedTrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePT2",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelineSparseDistLite",
    *(["TrainPipelinePEC"] if TORCHREC.has_pec else []),
    *EXPERIMENTAL_PIPELINES,
]
