"""The replay mechanics shared by sim, pp and the DAG list scheduler (``torchrec_swp.solve.replay``)."""

from __future__ import annotations

from torchrec_swp.solve.replay import peak_held, sweep


def test_peak_held_frees_before_it_holds_at_the_same_instant() -> None:
    assert peak_held([]) == 0
    assert peak_held([(0, 1), (1, -1), (1, 1), (2, -1)]) == 1  # back to back: never two at once
    assert peak_held([(0, 2), (0.5, 3), (1, -2), (3, -3)]) == 5
    assert peak_held([(0, 1), (float("inf"), -1), (4, 1)]) == 2  # never freed: held to the end


def test_sweep_goes_round_until_a_round_takes_no_step() -> None:
    def replay(programs: dict[str, list[tuple[str, str | None]]]) -> tuple[list[str], dict[str, int]]:
        """Each lane's steps in order: (name, the step it waits for)."""
        done: list[str] = []
        at = dict.fromkeys(programs, 0)

        def step(lane: str) -> bool:
            if at[lane] == len(programs[lane]):
                return False
            name, needs = programs[lane][at[lane]]
            if needs is not None and needs not in done:
                return False
            done.append(name)
            at[lane] += 1
            return True

        sweep(list(programs), step)
        return done, at

    # a0 waits for b0, b1 for a0: a second round runs them
    assert replay({"a": [("a0", "b0")], "b": [("b0", None), ("b1", "a0")]}) == (["b0", "a0", "b1"], {"a": 1, "b": 2})
    # a circle: no step runs, both lanes keep theirs (the caller reports the deadlock)
    assert replay({"a": [("a0", "b0")], "b": [("b0", "a0")]}) == ([], {"a": 0, "b": 0})
