"""One HTML file an instructor can show after a PBS job: a table of every run and the plots of their metrics.

``pbs/instructor_demo.pbs`` launches a chosen set of chapter scripts, each writing its metrics file, then::

    python -m coursetools.demo_report --out runs/<job>/instructor_demo.html --title "..." \\
        LABEL=EXIT_CODE=METRICS.json [LABEL=EXIT_CODE=METRICS.json ...]

The file is self-contained (plots embedded as PNG): a table (run, script, result, ranks, device, checks
passed, last loss, step time, tokens/s, MFU where a peak is known), the losses per step of every run, the
communication measured against its formula per run, and the measured pipeline Gantt chart of each run that
recorded a timeline. Every figure is read from the metrics files; nothing is recomputed. The same table is
printed as text for the job's log. Pure parts (:func:`parse_run`, :func:`summary_rows`, :func:`text_table`)
are unit-tested; the plots need matplotlib only.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path

COLUMNS = ("run", "script", "result", "ranks", "device", "checks", "last loss", "step time", "tokens/s", "MFU")


def parse_run(spec: str) -> dict:
    """``LABEL=EXIT_CODE=PATH`` -> ``{"label", "exit_code", "path", "metrics"}`` (metrics None if no file)."""
    label, code, path = spec.split("=", 2)
    file = Path(path)
    metrics = json.loads(file.read_text()) if file.is_file() else None
    return {"label": label, "exit_code": int(code), "path": str(file), "metrics": metrics}


def result_of(run: dict) -> str:
    """ok, FAILED (exit code) or skipped (no metrics and exit 0: DISTLAB_ONLY left it out, or a dry run)."""
    if run["exit_code"] != 0:
        return f"FAILED ({run['exit_code']})"
    return "ok" if run["metrics"] is not None else "skipped"


def summary_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        m = run["metrics"] or {}
        checks = m.get("checks") or []
        throughput = m.get("throughput") or {}
        losses = m.get("losses") or []
        step, tokens, mfu = throughput.get("step_seconds"), throughput.get("tokens_per_s"), throughput.get("mfu")
        rows.append({"run": run["label"], "script": m.get("script", "-"), "result": result_of(run),
                     "ranks": m.get("world_size", "-"), "device": m.get("device", "-"),
                     "checks": f"{sum(bool(c['passed']) for c in checks)}/{len(checks)}" if m else "-",
                     "last loss": f"{losses[-1]:.4f}" if losses else "-",
                     "step time": f"{step * 1e3:.1f} ms" if step else "-",
                     "tokens/s": f"{tokens:,.0f}" if tokens else "-",
                     "MFU": f"{100 * mfu:.1f}%" if mfu is not None else "-"})
    return rows


def text_table(rows: list[dict]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _plots(runs: list[dict]) -> list[str]:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # a batch job has no display
    import matplotlib.pyplot as plt

    from distlab import gantt

    measured = [r for r in runs if r["metrics"]]
    parts = []
    with_losses = [r for r in measured if r["metrics"].get("losses")]
    if with_losses:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for r in with_losses:
            ax.plot(range(len(r["metrics"]["losses"])), r["metrics"]["losses"], marker="o", label=r["label"])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("losses per step (each run also compares with its single-device run: see its checks)")
        ax.legend(fontsize=7)
        parts += ["<h2>Losses</h2>", _png(fig)]
    with_comm = [r for r in measured if r["metrics"].get("comm")]
    if with_comm:
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(with_comm)))
        labels = [r["label"] for r in with_comm]
        measured_bytes = [sum(c["measured_bytes"] for c in r["metrics"]["comm"]) for r in with_comm]
        analytic_bytes = [sum(c["analytic_bytes"] for c in r["metrics"]["comm"]) for r in with_comm]
        positions = range(len(with_comm))
        ax.barh([p + 0.2 for p in positions], measured_bytes, height=0.4, label="measured")
        ax.barh([p - 0.2 for p in positions], analytic_bytes, height=0.4, label="formula")
        ax.set_yticks(list(positions), labels)
        ax.set_xscale("log")
        ax.set_xlabel("bytes per step (payload of every collective counted)")
        ax.set_title("communication: measured against the formula")
        ax.legend(fontsize=7)
        parts += ["<h2>Communication</h2>", _png(fig)]
    for r in measured:
        if r["metrics"].get("timeline"):
            ax = gantt.plot_gantt(r["metrics"]["timeline"], title=f"{r['label']}: measured pipeline timeline")
            parts += [f"<h2>Pipeline of {html.escape(r['label'])}</h2>", _png(ax.figure)]
    return parts


def write_report(runs: list[dict], out: str | Path, title: str = "distlab instructor demo") -> Path:
    """Write the HTML file and return its path."""
    rows = summary_rows(runs)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    failed = [r["run"] for r in rows if r["result"].startswith("FAILED")]
    verdict = f"<p><b>{len(failed)} run(s) failed:</b> {html.escape(', '.join(failed))}</p>" if failed else \
        "<p>Every run that ran passed its checks.</p>"
    page = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
            "td:first-child,td:nth-child(2){text-align:left}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>", verdict, f"<table><tr>{head}</tr>{body}</table>", *_plots(runs),
            "</body></html>"]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(page))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=EXIT_CODE=METRICS.json")
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.add_argument("--title", default="distlab instructor demo")
    options = parser.parse_args(argv)
    runs = [parse_run(spec) for spec in options.runs]
    print(text_table(summary_rows(runs)))
    path = write_report(runs, options.out, options.title)
    print(f"instructor summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
