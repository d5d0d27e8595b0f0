"""Drop-in subclasses of TorchRec's pipelines whose ``progress()`` is the engine running a plan.

Change one import line and training is identical; pass the engine's options (``plan=``,
``thread_map=``, ``loads=``, ``lookahead=``: ``engine_options.EngineOptions``, applied in that order)
to change the schedule without changing code or numbers::

    from torchrec_swp import TrainPipelineSparseDist
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    pipeline.plan.print_schedule(5)
    pipeline = TrainPipelineSparseDist(model, optimizer, device, thread_map="io", loads=2, lookahead=2)

One module per upstream family; ``_driven`` holds what they share, ``engine_options`` the options,
``training_tasks`` the task functions several families run the same way, ``protocol`` what a
drop-in declares (``@task``) and its check when the class is defined; ``torchrec_swp.drop_ins`` lists
them (``docs/adding_a_pipeline.md``).
"""

import importlib

from torchrec_swp import drop_ins
from torchrec_swp.integrations.torchrec.compat import installed

TORCHREC = installed()  # ImportError naming the supported versions if another is installed

#: The drop-ins the installed TorchRec has (``torchrec_swp.drop_ins``: TrainPipelinePEC from 1.9),
#: each imported from its module (``pipelines.X`` and ``from ...pipelines import X`` work as before).
__all__ = list(drop_ins.names(TORCHREC.series))
globals().update(
    {name: getattr(importlib.import_module(drop_ins.DROP_INS[name].module_path), name) for name in __all__}
)
