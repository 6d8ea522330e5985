"""``purine-caffe plot``: training curves of Caffe and purine-caffe logs (read by
training_log): the charts of Caffe's plot_training_log.py, or one figure of the losses, the
other net outputs and the learning rate; several logs on one chart. Drawn headless (Agg)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from purine.converters import ConvertError, flag, run_main
from purine.converters.training_log import TrainingLog, outputs, read_training_log
from purine.errors import PurineError

X_AXES = {"iters": ("NumIters", "Iters"), "seconds": ("Seconds", "Seconds")}
# name -> (rows, the output names it takes: those containing this, its title); the order
# is plot_training_log.py's, whose chart numbers 0-7 are these four vs. Iters, vs. Seconds
CHARTS = {
    "test_accuracy": ("test", "acc", "Test accuracy"),
    "test_loss": ("test", "loss", "Test loss"),
    "train_lr": ("train", "LearningRate", "Train learning rate"),
    "train_loss": ("train", "loss", "Train loss"),
}
CAFFE_CHARTS = [(name, x) for name in CHARTS for x in X_AXES]
DPI = 100
FEW_POINTS = 30  # a line of at most this many points gets a marker on each
CHART_SIZE, FIGURE_SIZE = (8.0, 5.0), (8.0, 8.0)  # inches: 800x500 and 800x800 pixels


@dataclass
class Line:
    label: str
    x: list[float]
    y: list[float]


@dataclass
class Panel:
    ylabel: str
    lines: list[Line] = field(default_factory=list)


def _line(label: str, rows: list[dict[str, float]], x: str, column: str) -> Line | None:
    pts = [(r[x], r[column]) for r in rows if column in r and not math.isnan(r[column])]
    return Line(label, [p[0] for p in pts], [p[1] for p in pts]) if pts else None


def _names(logs: Sequence[TrainingLog]) -> list[str]:
    """Legend names: the file names, or the paths as given when two file names agree."""
    names = [log.name for log in logs]
    return names if len(set(names)) == len(names) else [log.path for log in logs]


def chart_panel(logs: Sequence[TrainingLog], chart: str, x: str = "iters") -> Panel:
    """One of plot_training_log.py's charts: a line per log (named by the file) and, when a
    log has several matching outputs (``loss``, ``loss_aux``), per output."""
    kind, key, title = CHARTS[chart]
    panel = Panel(title)
    for log, log_name in zip(logs, _names(logs)):
        rows = getattr(log, kind)
        names = ["LearningRate"] if key == "LearningRate" else [
            n for n in outputs(rows) if key in n.lower()]
        if not names:
            have = ", ".join(outputs(rows)) or "none"
            raise ConvertError(f"{log.path}: no {kind} output named like '{key}' for chart "
                               f"{chart} ({kind} outputs: {have})")
        for name in names:
            label = log_name if len(names) == 1 else f"{log_name} {name}"
            line = _line(label, rows, X_AXES[x][0], name)
            if line is not None:
                panel.lines.append(line)
    if not panel.lines:
        raise ConvertError(f"{logs[0].path}: chart {chart} has no values to draw")
    return panel


def figure_panels(logs: Sequence[TrainingLog], x: str = "iters") -> list[Panel]:
    """The default figure: the losses (train and test), the other outputs (accuracy ...),
    the learning rate; a panel without values is left out."""
    loss, other, lr = Panel("loss"), Panel("output"), Panel("learning rate")
    column = X_AXES[x][0]
    other_names = set()
    for log, log_name in zip(logs, _names(logs)):
        prefix = f"{log_name}: " if len(logs) > 1 else ""
        for kind in ("train", "test"):
            rows = getattr(log, kind)
            for name in outputs(rows):
                line = _line(f"{prefix}{kind} {name}", rows, column, name)
                if line is None:
                    continue
                if "loss" in name.lower():
                    loss.lines.append(line)
                else:
                    other.lines.append(line)
                    other_names.add(name.lower())
        line = _line(f"{prefix}lr", log.train or log.test, column, "LearningRate")
        if line is not None:
            lr.lines.append(line)
    if other_names and all("acc" in n for n in other_names):
        other.ylabel = "accuracy"
    panels = [p for p in (loss, other, lr) if p.lines]
    if not panels:
        raise ConvertError(f"{logs[0].path}: no values to draw")
    return panels


def _matplotlib():
    """matplotlib, imported when a chart is drawn: it is an extra, not a dependency."""
    try:
        import matplotlib
        import matplotlib.ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PurineError("plot needs matplotlib: pip install 'purine-caffe[plot]'") from None
    return matplotlib, Figure, FigureCanvasAgg


def draw(panels: Sequence[Panel], out: str | os.PathLike, x: str = "iters",
         title: str | None = None) -> Any:
    """``panels`` stacked over one x axis, written to ``out`` (.png, .svg, .pdf ...); returns
    the matplotlib Figure. A short log stays readable: markers on lines of few points, whole
    iterations on the x axis, and a single value (or point in time) gets a range around it."""
    matplotlib, Figure, FigureCanvasAgg = _matplotlib()
    out = os.fspath(out)
    size = CHART_SIZE if len(panels) == 1 else FIGURE_SIZE
    # SVG text stays text (searchable, and what the tests read); ids do not change per run
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "purine-caffe"}):
        fig = Figure(figsize=size, dpi=DPI, layout="constrained")
        canvas = FigureCanvasAgg(fig)  # no pyplot: no GUI backend, no global figure state
        fmt = os.path.splitext(out)[1][1:].lower()
        if not fmt:
            raise ConvertError(f"{out}: name the image with a suffix, such as .png or .svg")
        if fmt not in canvas.get_supported_filetypes():
            known = ", ".join(sorted(canvas.get_supported_filetypes()))
            raise ConvertError(f"{out}: cannot write '.{fmt}' images; use one of {known}")
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, panel in zip(axes, panels):
            for line in panel.lines:
                few = len(line.x) <= FEW_POINTS  # markers show where the sparse points are
                ax.plot(line.x, line.y, label=line.label, linewidth=1.0,
                        marker="o" if few else None, markersize=3 if len(line.x) > 3 else 6)
            ax.set_ylabel(panel.ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best", fontsize="small")
            flat = _flat([v for line in panel.lines for v in line.y])
            if flat is not None:  # one value: a range around it, not matplotlib's +-5%
                ax.set_ylim(*flat)
        xs = [v for panel in panels for line in panel.lines for v in line.x
              if math.isfinite(v)]
        if xs and min(xs) == max(xs):  # one point in time: an iteration (second) either side
            axes[-1].set_xlim(xs[0] - 1, xs[0] + 1)
        if x == "iters":  # iterations are whole numbers: no ticks (grid lines) at 0.2 of one
            for ax in axes:
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axes[-1].set_xlabel(X_AXES[x][1])
        if title:
            axes[0].set_title(title)
        fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    return fig


def _flat(values: Sequence[float]) -> tuple[float, float] | None:
    """A y range for values that are all one number ``v`` (a one-point log, a constant
    learning rate): v +- 10% of |v|, or +-1 around 0; None when they differ or are none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or min(finite) != max(finite):
        return None
    v = finite[0]
    pad = abs(v) * 0.1 if v else 1.0
    return v - pad, v + pad


def plot(logs: Sequence[str | os.PathLike], out: str | os.PathLike, *, x: str = "iters",
         chart: str | None = None, year: int | None = None) -> Any:
    """Read ``logs`` and draw ``chart`` (a CHARTS name) or the default figure to ``out``;
    returns the matplotlib Figure."""
    parsed = [read_training_log(p, year) for p in logs]
    for log in parsed:
        if not log.train and not log.test:
            raise ConvertError(f"{log.path}: no 'Train net output' or 'Test net output' "
                               "line after an 'Iteration' line; nothing to plot")
    if chart is None:
        return draw(figure_panels(parsed, x), out, x)
    panel = chart_panel(parsed, chart, x)
    return draw([panel], out, x, title=f"{panel.ylabel} vs. {X_AXES[x][1]}")


def _chart(text: str) -> str:
    if text.isdigit() and int(text) < len(CAFFE_CHARTS):
        return text
    if text in CHARTS:
        return text
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(CHARTS)} or plot_training_log.py's 0-"
        f"{len(CAFFE_CHARTS) - 1}, got '{text}'")


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``plot LOG [LOG ...] [--out curves.png] [--x iters|seconds] [--chart NAME]``."""
    if parser.description is None:
        parser.description = (
            "Plot training curves from Caffe or purine-caffe logs: by default the losses, "
            "the other net outputs and the learning rate; with --chart one of Caffe's "
            "plot_training_log.py charts. Several logs go on one chart, a line each.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="training logs (glog format)")
    flag(parser, "out", default="curves.png",
         help="the image to write, .png or .svg (or .pdf ...; default curves.png)")
    flag(parser, "x", default="iters", choices=sorted(X_AXES),
         help="the x axis: iterations or seconds since 'Solving' (default iters)")
    flag(parser, "chart", default=None, type=_chart,
         help="one chart: test_accuracy, test_loss, train_lr, train_loss, or a chart number "
              "0-7 of plot_training_log.py (it sets --x too)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    chart, x = args.chart, args.x
    if chart is not None and chart.isdigit():
        chart, x = CAFFE_CHARTS[int(chart)]
    plot(args.logs, args.out, x=x, chart=chart)
    print(f"plotted {', '.join(args.logs)} -> {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("plot", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
