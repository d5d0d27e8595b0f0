"""What the tuner says (``tuner.py`` decides when): its lines, made from its options and its
decisions, and where they go (``send``: ``Autotune.report`` on rank 0 only; a headline to the
default report's stdout as well). The trial's per-plan lines are ``trial.tried_line``."""

from __future__ import annotations

from torchrec_swp.autotune.agreement import world
from torchrec_swp.autotune.decision import Decision
from torchrec_swp.autotune.options import Autotune, PrintedReport
from torchrec_swp.autotune.trial import describe
from torchrec_swp.plan import PipelinePlan


def send(options: Autotune, line: str, headline: bool = False) -> None:
    """One line to ``options.report``, on rank 0 only; a headline to the default report's
    ``headline`` (stdout too)."""
    report = options.report
    if report is None or world()[0] != 0:
        return
    if headline and isinstance(report, PrintedReport):
        report.headline(line)
    else:
        report(line)


def opening(owner: str, options: Autotune, depth: int) -> str:
    """The first line, said as the pipeline is built: how many steps tuning takes at most from a
    starting plan of ``depth`` batches (``Autotune.tuning_bound``) and what they are spent on, so
    that a user knows before the first step how long a run must be."""
    o = options
    rounds = f"{o.rounds} round{'s' if o.rounds != 1 else ''}"
    trial = f", each measuring up to {o.candidates} plans against the running one" if o.candidates else ""
    limit = f"at most {o.search_s:g} s a round" if o.search_s is not None else "no time limit"
    searching = ""
    if o.background:
        searching = f", and the steps that train while it searches in a process of its own ({limit})"
    return (
        f"autotune {owner}: tunes within {o.tuning_bound(depth)} steps at most (a warm-up of {o.warmup}, a profile "
        f"of {o.steps}, {rounds} of search{trial}, a verification of {o.verify}){searching}; it trains on its "
        "starting plan meanwhile, with the same results" + budget(o)
    )


def budget(o: Autotune) -> str:
    """The first line's last words: what tuning may cost the job at most (``autotune.budget``)."""
    given = []
    if o.budget_steps is not None:
        given.append(f"{o.budget_steps} of that plan's steps (Autotune.budget_steps)")
    if o.budget_s is not None:
        given.append(f"{o.budget_s:g} s (Autotune.budget_s)")
    if not given:
        return ""
    return f"; it stops once it has cost the job as much as {' or '.join(given)}"


def decision_lines(
    owner: str, d: Decision, round_: int, round_name: str, profiled: int
) -> tuple[str, list[str]]:
    """What one round's decision ``d`` says: the headline (what it does, and for a plan kept in
    the first round, why), then the reasons. ``round_name``: how a later round is named
    (``"second round"``, ``"re-tune 1"``); ``profiled``: the steps a first round profiles."""
    who = f"autotune {owner}"
    reasons = list(d.why)
    measured = f" ({1e3 * d.measured_start_s:.2f} ms per step measured)" if d.measured_start_s is not None else ""
    trial = next((line for line in reasons if line.startswith("tried ") and " plans over " in line), None)
    if trial is not None:
        head = f"{who}: {trial}"
        if round_ > 1:
            head = f"{who}: {round_name}: {trial}"
        reasons.remove(trial)
    elif round_ == 1:
        head = f"{who}: profiled {profiled} steps{measured}"
    else:
        head = f"{who}: {round_name}: profiled the chosen plan as it runs{measured}"
    if d.switched:
        found = PipelinePlan.from_text(d.plan)  # type: ignore[arg-type]  # a decision that switches has a plan text
        head += f"; switches to {describe(found)}" + (", the input dist in its own comm group" if d.own_group else "")
        if d.predicted_s is not None and d.baseline_s is not None and d.predicted_s > 0:
            head += f": predicted {1e3 * d.predicted_s:.2f} ms per step (x{d.baseline_s / d.predicted_s:.2f})"
        if d.tried:
            won = next(x for x in d.tried if x.verdict == "best")
            if won.measured_s is not None:
                head += f", measured {1e3 * won.measured_s:.2f} ms"
    elif round_ > 1 and d.baseline_s is not None and trial is None:
        head += f"; keeps it: predicted {1e3 * d.baseline_s:.2f} ms per step from its own profile"
    elif reasons and reasons[-1].startswith("keeps the plan"):
        head += f"; {reasons.pop()}"
    prefix = "" if round_ == 1 else f"{round_name}: "
    if trial is not None:  # the search's reasons were said when the trial began
        reasons = [line for line in reasons if line.startswith("tried ")]
    return head, [f"{who}: {prefix}{line}" for line in reasons]


def verified_line(owner: str, d: Decision, steps: int) -> str:
    """The verification's line: the measured step with the chosen plan over ``steps`` steps, beside
    the prediction, and which way the prediction missed (``missed``); a plan without one (the plan
    the tuning started from, tried again in a later round and measured best) says so."""
    assert d.measured_s is not None
    if d.predicted_s is None:
        against = "no prediction: the trial measured it best"
    else:
        against = f"predicted {1e3 * d.predicted_s:.2f} ms: {missed(d.predicted_s, d.measured_s)}"
    return (
        f"autotune {owner}: measured {1e3 * d.measured_s:.2f} ms per step over {steps} steps "
        f"with the chosen plan ({against})"
    )


def missed(predicted: float, measured: float) -> str:
    """Which way a measured step missed its prediction, in words: ``ran 56% slower than
    predicted`` (measured 17.39 ms where 11.12 were predicted), ``ran 12% faster than predicted``,
    ``as predicted`` (within half a percent)."""
    off = 100 * (measured / predicted - 1)
    if abs(off) < 0.5:
        return "as predicted"
    return f"ran {abs(off):.0f}% {'slower' if off > 0 else 'faster'} than predicted"
