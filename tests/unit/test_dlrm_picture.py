"""The DLRM example's timeline picture (``make run``'s ``out/run/timeline.png``): its legend sits
below the x-axis label and its tick labels, inside the figure, overlapping neither."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.dlrm.picture import StepRecorder, gantt_figure, save_gantt

TASKS = ["WaitBatch", "InputDistStart", "H2D", "Forward", "InputDistWait", "Backward", "OptimizerStep", "ZeroGrad"]


def _recorder(threads: tuple[str, ...]) -> StepRecorder:
    """Four steps of ``TASKS``, one after the other, spread over ``threads``."""
    recorder = StepRecorder(keep=4)
    t = 0.0
    for step in range(4):
        start = t
        for k, task in enumerate(TASKS):
            recorder.on_run(task, step, threads[k % len(threads)], step, t, t + 0.002)
            t += 0.002
        recorder.step(start, t)
    return recorder


@pytest.mark.parametrize("threads", [("default",), ("default", "io", "bwd")])
def test_the_legend_overlaps_neither_the_axis_label_nor_the_ticks(threads: tuple[str, ...]) -> None:
    import matplotlib.pyplot as plt

    fig = gantt_figure(_recorder(threads), "a title")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        (ax,) = fig.axes
        label = ax.xaxis.label.get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert ticks and label.width > 0
        for other in (label, *ticks):
            assert not box.overlaps(other), (box, other)
        assert box.y1 <= label.y0  # below the label
        figure = fig.bbox
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0  # all of it in the picture
        assert [t.get_text() for t in legend.get_texts()] == TASKS
    finally:
        plt.close(fig)


def test_save_gantt_writes_a_png_and_refuses_an_empty_recording(tmp_path: Path) -> None:
    path = save_gantt(_recorder(("default",)), tmp_path / "sub" / "timeline.png", "a title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no task run was recorded"):
        save_gantt(StepRecorder(), tmp_path / "empty.png", "a title")
