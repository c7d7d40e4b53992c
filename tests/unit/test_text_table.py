"""experiments/projection/text_table.py and the two cost-model tables printed with it (scaling, scaling_check)."""

from __future__ import annotations

import pytest

from zeropp.experiments.projection import scaling_check, speedup
from zeropp.experiments.projection.text_table import Column, number, text_table

PROJECTION_ROW = {
    "gbps": 100.0,
    "gpus": 64,
    "zero3_step_s": 1.234,
    "zeropp_step_s": 0.9,
    "zero3_tflops": 123.4,
    "zeropp_tflops": 150.2,
    "zero3_cross_gb": 12.3,
    "zeropp_cross_gb": 4.1,
    "speedup": 1.37,
}
COMPARISON_ROW = {
    "label": "stage=3,quant=zeropp,model=tiny,launcher.progress=False",
    "measured_step_s": 0.5,
    "predicted_step_s": 0.45,
    "step_error": -0.1,
    "predicted_quant_s": 0.01,
    "measured_cross_bytes": 123456,
    "predicted_cross_bytes": 120000,
    "bytes_error": -0.028,
}


def _ends(line: str, columns) -> list[str]:
    """The line cut at the columns' boundaries (each column plus its separating space)."""
    out, at = [], 0
    for c in columns:
        out.append(line[at : at + c.width])
        at += c.width + 1
    return out


@pytest.mark.parametrize(
    "fmt,columns,row,cells",
    [
        (
            speedup.format_table,
            speedup.PROJECTION_COLUMNS,
            PROJECTION_ROW,
            ["100", "64", "1.23", "0.90", "123.4", "150.2", "12.3 ->      4.1", "1.37x"],
        ),
        (
            scaling_check.format_comparison,
            scaling_check.comparison_columns([COMPARISON_ROW]),  # the run column fits the whole label
            COMPARISON_ROW,
            [
                "stage=3,quant=zeropp,model=tiny,launcher.progress=False",
                "0.500",
                "0.450",
                "-10%",
                "0.010",
                "123456",
                "120000",
                "-2.8%",
            ],
        ),
    ],
)
def test_every_cell_sits_under_its_header(fmt, columns, row, cells) -> None:
    head, rule, line = fmt([row]).splitlines()
    assert len(head) == len(rule) == len(line) and set(rule) == {"-"}
    assert [h.strip() for h in _ends(head, columns)] == [c.title for c in columns]
    got = _ends(line, columns)
    assert [g.strip() for g in got] == cells
    for c, g, h in zip(columns, got, _ends(head, columns), strict=True):
        if c.left:  # names start at the column's left edge, numbers end at its right edge, as the header does
            assert not g.startswith(" ") and not h.startswith(" ")
        else:
            assert not g.endswith(" ") and not h.endswith(" ")


def test_number_scales_and_suffixes() -> None:
    assert number("x", ".1f", scale=100, suffix="%")({"x": 0.1234}) == "12.3%"
    assert number("n", "d")({"n": 7}) == "7"  # an int stays an int without a scale


def test_a_cell_wider_than_its_column_is_kept_whole() -> None:
    cols = [Column(title="a", width=3, cell=lambda r: r["a"])]
    assert text_table(cols, [{"a": "toolong"}]).splitlines()[2] == "toolong"


@pytest.mark.parametrize("width", [0, -1, 2.5, True])
def test_a_column_needs_a_positive_int_width(width) -> None:
    with pytest.raises(ValueError, match="width must be a positive int"):
        Column(title="a", width=width, cell=str)
