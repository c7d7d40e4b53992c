"""``python -m experiments.formats``: the format study's capture, its figures against their
formulas, its format names, and one small run of the command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zeropp.comm.codecs import IntCodec
from zeropp.comm.spec import QuantSpec
from zeropp.experiments.studies import format_capture as fc
from zeropp.experiments.studies import format_metrics as fm
from zeropp.experiments.studies import formats as fs
from zeropp.models.gpt import GPT, PRESETS, GPTConfig


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tied", [True, False])
def test_every_gpt_parameter_has_a_layer_type(preset: str, tied: bool) -> None:
    model = GPT(GPTConfig.preset(preset, tie_embeddings=tied, n_layers=1))
    types = {name: fc.layer_type(name) for name, _ in model.named_parameters()}
    assert set(types.values()) == set(fc.LAYER_TYPES)
    assert types["blocks.0.attn.qkv.weight"] == "attention" and types["blocks.0.out.weight"] == "mlp"
    assert types["blocks.0.ln2.weight"] == "norm" and types["blocks.0.fc.bias"] == "bias"


def test_capture_holds_every_parameter_once_per_kind() -> None:
    cfg = fc.CaptureConfig(model="tiny", steps=2, batch=2)
    got = fc.capture(cfg)
    n = GPTConfig.preset("tiny").num_params()
    for kind in fc.KINDS:
        assert sum(t.numel() for t in got[kind].values()) == n
        assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in got[kind].values())
    # a step moves the weights by about lr (AdamW's normalized update), far less than the weights
    d, w = got["weight_diffs"]["mlp"], got["weights"]["mlp"]
    assert 0 < d.abs().max() < 3 * cfg.lr < w.abs().max()


def test_capture_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown GPT preset"):
        fc.CaptureConfig(model="huge")
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        fc.CaptureConfig(steps=0)


def test_round_trip_figures_match_their_formulas() -> None:
    torch.manual_seed(0)
    x = torch.randn(17 * 257)
    spec = QuantSpec(bits=4, group_size=32)
    got = fm.measure(spec, x, chunk=1000, weights=True)
    # the same rows through the int codec by hand
    x2d, n = fm.as_rows(x, 1000)
    assert x2d.shape == (5, 1000) and n == 17 * 257 and x2d.reshape(-1)[n:].eq(0).all()
    codec = IntCodec()
    y = codec.dequantize(codec.unpack(codec.encode(x2d, 4, 32, rows=5, seed=None), 1000, 4, 32)).reshape(-1)[:n]
    e = (y - x).double()
    assert got.sqnr_db == pytest.approx(10 * math.log10(float(x.double().square().sum() / e.square().sum())))
    assert got.max_error == pytest.approx(float(e.abs().max() / x.abs().max()))
    assert got.bias == pytest.approx(float(e.mean() / x.double().square().mean().sqrt()))
    groups = math.ceil(1000 / 32)  # the row is padded to whole groups: 4-bit codes of 32 * groups, fp32 scales
    assert got.bits_per_element == pytest.approx((32 * groups / 2 + 4 * groups) * 8 / 1000)


def test_an_exact_tensor_has_infinite_sqnr_and_no_error() -> None:
    x = torch.tensor([0.0, 127.0, -64.0, 1.0, 7.0])  # INT8 codes of scale 1 exactly
    got = fm.measure(QuantSpec(bits=8, group_size=8), x, chunk=5, weights=True)
    assert math.isinf(got.sqnr_db) and got.max_error == 0 and got.bias == 0


def test_speed_shares_are_against_the_copy_given() -> None:
    x2d = torch.randn(4, 256)
    s = fm.speed(QuantSpec(bits=8), x2d, weights=False, copy=2.0, repeats=1)
    assert s.quantize_of_copy == pytest.approx(s.quantize_gbs / 2.0)
    assert s.dequantize_of_copy == pytest.approx(s.dequantize_gbs / 2.0)


def test_format_names_take_group_rotation_and_rounding() -> None:
    specs = fs.format_specs("int4@g64+had+sr")
    for kind in fc.KINDS:
        s = specs[kind]
        assert (s.bits, s.group_size, s.rotation, s.rounding) == (4, 64, "hadamard", "stochastic")
    w8g4 = fs.format_specs("w8g4")
    assert w8g4["weights"].bits == 8 and w8g4["grads"].bits == 4 and w8g4["weight_diffs"].bits == 8


@pytest.mark.parametrize(
    "name, says",
    [
        ("int9", "unknown recipe 'int9'"),
        ("none", "quantizes nothing"),
        ("int8@g", "is not <recipe>"),
        ("int8@g7+had", "for weights: QuantSpec.rotation='hadamard'"),
    ],
)
def test_bad_format_names_are_refused_with_what_to_write(name: str, says: str) -> None:
    with pytest.raises(fs.ConfigError, match=says):
        fs.format_specs(name)


def test_bad_options_exit_2_before_any_training(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(fs, "capture", lambda cfg: pytest.fail("training started"))
    with pytest.raises(SystemExit) as e:
        fs.main(["--formats", "int8,nope", "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown recipe 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # before: measured twice, two rows of one name in each table
        fs.main(["--formats", "int4,mxfp4,int4", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--formats names int4 more than once" in capsys.readouterr().err


def test_the_command_prints_and_saves_a_table_per_kind(capsys, tmp_path) -> None:
    result = fs.main(
        [
            "--formats",
            "int8,int4@g32",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--speed-mib",
            "0.25",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    for kind in fc.KINDS:
        assert out.count(f"{kind} (SQNR") == 1
    saved = json.loads((tmp_path / "formats.json").read_text())
    assert [(r["kind"], r["format"]) for r in saved["rows"]] == [(k, f) for k in fc.KINDS for f in ("int8", "int4@g32")]
    by = {(r["kind"], r["format"]): r for r in result["rows"]}
    assert by[("grads", "int8")]["sqnr"] > by[("grads", "int4@g32")]["sqnr"] + 15  # ~6 dB per bit
    assert [s["format"] for s in saved["speed"]] == ["int8", "int4@g32"]


def test_files_of_the_users_in_out_are_refused_before_training(monkeypatch, capsys, tmp_path) -> None:
    """Before: a formats.md of the user's in --out was overwritten after the study."""
    monkeypatch.setattr(fs, "capture", lambda cfg: pytest.fail("training started"))
    (tmp_path / "formats.md").write_text("mine")
    with pytest.raises(SystemExit) as e:
        fs.main(["--formats", "int8", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds formats.md, which this command would overwrite" in err
    assert (tmp_path / "formats.md").read_text() == "mine"


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--speed-mib", "1000000"], "--speed-mib 1000000.0 needs about 3.81 TiB of host memory"),
        (["--chunk", "1000000000000"], "--chunk 1000000000000 needs about 14.55 TiB of host memory"),
        (["--speed-mib", "inf"], "--speed-mib inf: give a finite size"),
    ],
)
def test_sizes_beyond_host_memory_exit_2_before_training(argv, words, monkeypatch, capsys, tmp_path) -> None:
    """Before: the study trained, then died of the allocation with its traceback."""
    monkeypatch.setattr(fs, "capture", lambda cfg: pytest.fail("training started"))
    monkeypatch.setattr(fs, "host_memory", lambda: 16 << 30)
    with pytest.raises(SystemExit) as e:
        fs.main(["--formats", "int8", "--out", str(tmp_path), *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_chunk_smaller_than_a_group_exits_2_before_training(monkeypatch, capsys, tmp_path) -> None:
    """Before: --chunk 7 studied 7-element rows of padded 32-element groups (589 bits per element)."""
    monkeypatch.setattr(fs, "capture", lambda cfg: pytest.fail("training started"))
    with pytest.raises(SystemExit) as e:
        fs.main(["--formats", "int8,mxfp4", "--chunk", "31", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--chunk 31 is smaller than one group of" in err and "use --chunk" in err
