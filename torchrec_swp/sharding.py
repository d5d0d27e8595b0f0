"""The sharding types of a TorchRec plan, and the check a resume on another world size needs.

TorchRec's planner (``EmbeddingShardingPlanner``) may give a table another sharding type on
another number of ranks: ``data_parallel`` on 2 and ``table_wise`` on 1 for a small table, say.
DCP (``torch.distributed.checkpoint``) reshards a table's weights and optimizer state between
plans that shard it the same way on other ranks (tested for ``table_wise`` and ``row_wise``,
``tests/dist/test_checkpoint_resize.py``), but across types the saved state may be laid out
otherwise: a ``data_parallel`` table's optimizer state lives in the dense optimizer, a sharded
one's in TorchRec's fused optimizer, and the load fails deep inside DCP with ``Missing key in
checkpoint state_dict: optim.state.<table's weight>...`` (``tests/dist/test_resize_own_loop.py``;
between two sharded types the load is not tested, and not let through). So: record the types with the
checkpoint (``sharding_types(plan)``, a small dict of strings), and before any load on the new
world compare them with the new plan's (``check_sharding_types``), which names the first table
that changed and how to pin it. A table may change its ranks, not its type.

Pure: it reads a ``ShardingPlan``'s fields and imports neither torch nor TorchRec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The fix ``check_sharding_types`` names by default: TorchRec's planner, told the type.
PIN_WITH_PLANNER = (
    'pin its type on every world size: EmbeddingShardingPlanner(..., constraints={{"{table}": '
    'ParameterConstraints(sharding_types=["{old}"])}})'
)


def sharding_types(plan: Any) -> dict[str, str]:
    """``{table: sharding type}`` of every table (parameter) a TorchRec ``ShardingPlan`` shards,
    e.g. ``{"t0": "table_wise", "t2": "data_parallel"}``; JSON- and pickle-friendly, to be saved
    with the checkpoint (``DistributedModelParallel.plan`` is the plan a model was sharded with).

    Keyed by table name, as the planner's ``constraints`` are; ValueError where two modules of
    the plan shard tables of the same name (a constraint could not pin them apart)."""
    found: dict[str, str] = {}
    where: dict[str, str] = {}
    for module, tables in plan.plan.items():
        for table, sharding in tables.items():
            if table in found:
                raise ValueError(
                    f"sharding_types(): modules {where[table]} and {module} both shard a table {table!r}; "
                    "the planner's constraints, keyed by table name, cannot tell them apart"
                )
            found[table], where[table] = str(sharding.sharding_type), module
    return found


def check_sharding_types(saved: Mapping[str, str], new: Mapping[str, str], *, pin: str = PIN_WITH_PLANNER) -> None:
    """ValueError, in one line, naming the first table of ``new`` (``sharding_types`` of the plan
    of this run) whose sharding type is not the one ``saved`` recorded (``sharding_types`` of the
    plan the checkpoint was written with), both types, and how to pin it (``pin``, formatted with
    ``table``, ``old``, ``new``; by default the planner's constraint); or the first table only one
    of the plans holds. Call it before loading anything: DCP would fail later, less clearly."""
    for table, now in new.items():
        if table not in saved:
            raise ValueError(
                f"table {table} is in the new sharding plan and not in the checkpoint's ({', '.join(sorted(saved))}): "
                "another model?"
            )
        old = saved[table]
        if now != old:
            why = (
                "which DCP cannot load (a data_parallel table's optimizer state is in the dense optimizer, a "
                "sharded table's in the fused one)"
                if "data_parallel" in (old, now)
                else "and a resize keeps each table's type (DCP reshards a table's state between plans of one "
                "type; across types its layout may differ)"
            )
            raise ValueError(
                f"table {table} is {old} in the checkpoint's sharding plan and {now} in the new one, {why}: "
                f"{pin.format(table=table, old=old, new=now)}"
            )
    missing = sorted(set(saved) - set(new))
    if missing:
        raise ValueError(
            f"table {missing[0]} is in the checkpoint's sharding plan and not in the new one: another model?"
        )
