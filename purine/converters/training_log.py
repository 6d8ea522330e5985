"""Training logs in Caffe's (glog's) format read into the rows of Caffe's parse_log.py: per
iteration, its time since "Solving", its learning rate and each train (or test) net output;
and ``parse_log``, which writes them as Caffe's ``LOG.train`` / ``LOG.test`` CSV files."""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import re
import sys
from dataclasses import dataclass

from purine.converters import ConvertError, flag, run_main
from purine.formats.files import read_bounded

Row = dict[str, float]

# glog's prefix: level, MMDD (glog < 0.7) or YYYYMMDD (glog 0.7's log_year_in_prefix), time
_PREFIX = re.compile(r"\s*[A-Z](\d{8}|\d{4}) +(\d{1,2}):(\d{2}):(\d{2})\.(\d{1,6})\s")
_ITERATION = re.compile(r"Iteration (\d+)")
# Caffe's number pattern, plus the nan / inf a diverging run prints (Caffe's drops those)
_NUMBER = r"([-+]?(?:nan|inf)|[\.\deE+-]+)"
_OUTPUT = {kind: re.compile(rf"{kind} net output #(\d+): (\S+) = {_NUMBER}")
           for kind in ("Train", "Test")}
_LR = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
# Training logs run long (one line per iteration with debug_info); the bound is there for
# an input that never ends, not for a real log.
LOG_LIMIT = 2**32
FIXED = ("NumIters", "Seconds", "LearningRate")  # the columns before the outputs


@dataclass
class TrainingLog:
    """The rows of one log: ``train`` and ``test`` each a list of {column: value}, the
    columns ``NumIters``, ``Seconds``, ``LearningRate``, then the net outputs by name."""

    path: str
    train: list[Row]
    test: list[Row]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def columns(rows: list[Row]) -> list[str]:
    """The CSV header: the first row's columns, then any later one in order of appearance."""
    return list(dict.fromkeys(k for row in rows for k in row))


def outputs(rows: list[Row]) -> list[str]:
    """The net output names of ``rows`` (every column after the fixed three)."""
    return [c for c in columns(rows) if c not in FIXED]


class _Clock:
    """The datetime of a glog prefix. An 8-digit date names its year; a 4-digit one takes
    ``year`` and moves to the next year when the month goes back (a run past New Year), as
    Caffe's parse_log does."""

    def __init__(self, year: int):
        self.year, self.month = year, 0

    def time(self, m: re.Match[str]) -> datetime.datetime | None:
        date = m.group(1)
        if len(date) == 8:
            year, month, day = int(date[:4]), int(date[4:6]), int(date[6:])
        else:
            month, day = int(date[:2]), int(date[2:])
            year = self.year + (month < self.month)
        h, mi, s, us = (int(g) for g in m.group(2, 3, 4, 5))
        try:
            t = datetime.datetime(year, month, day, h, mi, s, us)
        except ValueError:  # 31 February, 29 February in a common year: skipped, as Caffe
            return None
        if len(date) == 4:
            self.year, self.month = year, month
        return t


class _Table:
    """Caffe's row rule: an output of a new iteration starts a row (pushing the pending one);
    a row is pushed as soon as it has as many columns as the first row."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.row: Row | None = None

    def add(self, it: float, seconds: float, lr: float, name: str, value: float) -> None:
        if self.row is None or self.row["NumIters"] != it:
            if self.row is not None:
                self.rows.append(self.row)
            self.row = {"NumIters": it, "Seconds": seconds, "LearningRate": lr}
        self.row[name] = value
        if self.rows and len(self.row) == len(self.rows[0]):
            self.rows.append(self.row)
            self.row = None

    def finish(self) -> list[Row]:
        # Caffe drops the pending row; when it is the only one (one test round in the whole
        # log) that would leave no row at all, so it is kept.
        if self.row is not None and not self.rows:
            self.rows.append(self.row)
        if len(self.rows) > 1:  # "lr = " follows the first outputs: take the second row's
            self.rows[0]["LearningRate"] = self.rows[1]["LearningRate"]
        return self.rows


def _file_year(path: str, lines: list[str], start: int) -> int:
    """The year of the start line when the prefixes have none: the file was last written
    in the year of its last line, so count back the New Years the log runs past. (Caffe's
    parse_log gives the start line the file's year: the same Seconds but across 29 February.)"""
    new_years, last = 0, 0
    for line in lines[start:]:
        m = _PREFIX.match(line)
        if m and len(m.group(1)) == 4:
            month = int(m.group(1)[:2])
            new_years, last = new_years + (month < last), month
    return datetime.datetime.fromtimestamp(os.stat(path).st_mtime).year - new_years


def read_training_log(path: str | os.PathLike, year: int | None = None) -> TrainingLog:
    """The train and test rows of a Caffe or purine-caffe training log. ``year`` is the year
    of the "Solving" line when the prefixes carry none (default: from the file's time)."""
    path = os.fspath(path)
    data = read_bounded(path, LOG_LIMIT, what="the log", error=ConvertError)
    lines = data.decode("utf-8", "replace").splitlines()
    train, test = parse_lines(lines, path, year)
    return TrainingLog(path, train, test)


def parse_lines(lines: list[str], path: str, year: int | None = None
                ) -> tuple[list[Row], list[Row]]:
    """The (train, test) rows of a log's lines (see read_training_log); ``path`` names the
    log in errors and, when ``year`` is None, gives the year from its modification time."""
    stamped = [i for i, line in enumerate(lines) if _PREFIX.match(line)]
    if not stamped:
        raise ConvertError(f"{path}: no line starts with a glog prefix such as "
                           "'I1121 12:34:56.789012'; not a Caffe training log")
    # Seconds count from the "Solving" line, as Caffe's; in a log without one (the tail of
    # a longer log), from its first stamped line
    solving = [i for i in stamped if "Solving" in lines[i]]
    start = solving[0] if solving else stamped[0]
    clock = _Clock(_file_year(path, lines, start) if year is None else year)
    start_time = None
    while start_time is None and start < len(lines):  # an impossible date: the next line
        m = _PREFIX.match(lines[start])
        start_time = clock.time(m) if m else None
        start += 1
    if start_time is None:
        raise ConvertError(f"{path}: no glog prefix with a valid date")

    iteration, lr = -1.0, math.nan
    tables = {"Train": _Table(), "Test": _Table()}
    for line in lines[start:]:
        m = _ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:  # nothing counts before the first iteration
            continue
        m = _PREFIX.match(line)
        t = clock.time(m) if m else None
        if t is None:  # an unprefixed line (a wrapped message, a resumed run's banner)
            continue
        seconds = (t - start_time).total_seconds()
        m = _LR.search(line)
        if m:
            lr = float(m.group(1))
        for kind, table in tables.items():
            m = _OUTPUT[kind].search(line)
            if m:
                try:
                    value = float(m.group(3))
                except ValueError:  # a stray "." or "e" that the pattern lets through
                    continue
                table.add(iteration, seconds, lr, m.group(2), value)
    return tables["Train"].finish(), tables["Test"].finish()


def write_csv(path: str, rows: list[Row], delimiter: str = ",") -> None:
    """``rows`` as Caffe's parse_log writes them: Excel's dialect (\\r\\n line ends),
    Python's float text (``100.0``, ``nan``)."""
    check_delimiter(delimiter)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns(rows), dialect=csv.excel, delimiter=delimiter)
        w.writeheader()
        w.writerows(rows)


def check_delimiter(delimiter: str) -> str:
    """One character that Python's csv module (and Excel, pandas) can read back as a
    delimiter: not a line end, not the quote character, not another control character."""
    if len(delimiter) != 1:
        raise ConvertError(f"--delimiter {delimiter!r}: expected one character")
    if delimiter in '\r\n"' or (delimiter < " " and delimiter != "\t") or delimiter == "\x7f":
        raise ConvertError(f"--delimiter {delimiter!r}: a CSV reader cannot read that back "
                           "(a line end, the quote character '\"' or a control character); "
                           "use ',', ';', '\\t' (a tab), '|' or a space")
    return delimiter


def parse_log(log: str | os.PathLike, output_dir: str | os.PathLike, delimiter: str = ",",
              year: int | None = None) -> list[str]:
    """Write ``OUTPUT_DIR/<log name>.train`` and ``.test`` (a file with no rows is not
    written, as in Caffe); returns the paths written."""
    check_delimiter(delimiter)  # before the log is read or a folder made
    parsed = read_training_log(log, year)
    if not parsed.train and not parsed.test:
        raise ConvertError(f"{parsed.path}: no 'Train net output' or 'Test net output' line "
                           "after an 'Iteration' line; nothing to write")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for suffix, rows in ((".train", parsed.train), (".test", parsed.test)):
        if rows:
            out = os.path.join(output_dir, parsed.name + suffix)
            write_csv(out, rows, delimiter)
            written.append(out)
    return written


def _delimiter(text: str) -> str:
    """The spelled-out tab; everything else is checked by check_delimiter, in one line."""
    return {"\\t": "\t", "tab": "\t"}.get(text, text)


# -- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``parse_log LOG OUTPUT_DIR [--delimiter ,] [--verbose]``, as Caffe's parse_log.py."""
    if parser.description is None:
        parser.description = ("Parse a Caffe (or purine-caffe) training log into two CSV "
                              "files, OUTPUT_DIR/LOG.train and OUTPUT_DIR/LOG.test: NumIters, "
                              "Seconds, LearningRate and one column per net output.")
    parser.add_argument("logfile_path", metavar="LOG", help="the training log (glog format)")
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="where the CSV files go")
    flag(parser, "delimiter", default=",", type=_delimiter,
         help="column delimiter in the output files (default ','; '\\t' for a tab)")
    parser.add_argument("-verbose", "--verbose", action="store_true",
                        help="print the names of the files written")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for path in parse_log(args.logfile_path, args.output_dir, args.delimiter):
        if args.verbose:
            print(f"Wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("parse_log", add_arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
