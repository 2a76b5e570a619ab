"""Chapter 11's flowchart: every "yes" and "no" stands beside its arrow, not on it (a learner found question 2's
"yes" written over its line)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from coursetools.drawings import ch11  # noqa: E402


def _crosses(box, start, end, steps: int = 200) -> bool:
    """Whether the segment start-end passes through the box (display coordinates), sampled."""
    for i in range(steps + 1):
        t = i / steps
        x, y = start[0] + t * (end[0] - start[0]), start[1] + t * (end[1] - start[1])
        if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1:
            return True
    return False


def test_no_edge_label_sits_on_its_arrow():
    fig = plt.figure(figsize=(10, 6))
    try:
        ch11.draw_decision_flowchart(fig)
        ax = fig.axes[0]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        arrows = [(ax.transData.transform(a.xyann), ax.transData.transform(a.xy)) for a in ax.texts
                  if isinstance(a, Annotation)]
        labels = [t for t in ax.texts if not isinstance(t, Annotation) and t.get_text() in ("yes", "no")]
        assert len(arrows) == 8 and len(labels) >= 6
        for label in labels:
            box = label.get_window_extent(renderer)
            assert not any(_crosses(box, start, end) for start, end in arrows), label.get_text()
    finally:
        plt.close(fig)
