"""The Hugging Face export of a run from ``model.pretrained`` carries that directory's tokenizer
(``zeropp/models/hf_tokenizer.py``): the exported directory tokenizes text as the pretrained one
did, and nothing outside the directory, no special file and no oversized file is read.

Here: the one-process checks. The export's other checks are in ``tests/unit/test_hf_export.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.hf_export_helpers import train_and_save, world_of_one
from zeropp.models import HFConfig

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
LLAMA = HFConfig(hf_config="llama", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64)
TEXT = "the cat sat on the mat, the end"


def _save_tokenizer(directory: Path) -> None:
    """A small word-level tokenizer of 64 ids, saved the way ``transformers`` saves any fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(TEXT.replace(",", " ,").split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)


def test_an_export_of_a_run_from_a_pretrained_directory_carries_its_tokenizer(tmp_path: Path, capsys) -> None:
    """The tokenizer files of ``model.pretrained`` are copied: ``AutoTokenizer`` of the export gives
    the ids of the pretrained directory's own (before: the export had no tokenizer, so the model
    could not be fed text). A file that is a symlink out of the directory, a FIFO (which would block
    a reader) or one over the size bound is skipped, named in ``zeropp_export.json``; a directory
    gone by the export time is one skip too, and the export still works (the command says so in
    one ``warning:`` line)."""
    pytest.importorskip("transformers", reason=REASON)
    from transformers import AutoTokenizer

    from zeropp.models import build_hf_model
    from zeropp.models import hf_tokenizer as ht
    from zeropp.models.hf_export import export_pretrained

    pre = tmp_path / "pre"
    build_hf_model(LLAMA, seed=0).hf.save_pretrained(pre)
    _save_tokenizer(pre)
    want = AutoTokenizer.from_pretrained(pre)(TEXT)["input_ids"]
    cfg = LLAMA.with_(pretrained=str(pre))
    with world_of_one(tmp_path / "store"):
        train_and_save(build_hf_model(cfg, seed=0), cfg, tmp_path / "run", stage=3)
    out = export_pretrained(tmp_path / "run", tmp_path / "a")
    info = json.loads((out / "zeropp_export.json").read_text())
    assert "tokenizer.json" in info["tokenizer_files"] and info["tokenizer_skipped"] == {}
    assert AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"] == want
    for name in info["tokenizer_files"]:
        assert (out / name).read_bytes() == (pre / name).read_bytes()

    secret = tmp_path / "secret.txt"
    secret.write_text("not the directory's")
    os.symlink(secret, pre / "vocab.txt")  # resolves outside the directory
    os.mkfifo(pre / "merges.txt")
    bound = max((pre / n).stat().st_size for n in ("tokenizer.json", "tokenizer_config.json"))
    (pre / "added_tokens.json").write_bytes(b"{}" + b" " * bound)  # over the bound set below
    inside = pre / "spiece.model"
    os.symlink(pre / "tokenizer.json", inside)  # a symlink within the directory is the directory's own
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ht, "MAX_TOKENIZER_BYTES", bound)
        out = export_pretrained(tmp_path / "run", tmp_path / "b")
    info = json.loads((out / "zeropp_export.json").read_text())
    skipped = info["tokenizer_skipped"]
    assert sorted(skipped) == ["added_tokens.json", "merges.txt", "vocab.txt"]
    assert (
        "outside" in skipped["vocab.txt"]
        and "FIFO" in skipped["merges.txt"]
        and "more than" in skipped["added_tokens.json"]
    )
    assert "spiece.model" in info["tokenizer_files"] and not (out / "vocab.txt").exists()
    assert secret.read_text() == "not the directory's"

    shutil.rmtree(pre)
    out = export_pretrained(tmp_path / "run", tmp_path / "c")
    info = json.loads((out / "zeropp_export.json").read_text())
    assert info["tokenizer_files"] == [] and list(info["tokenizer_skipped"]) == ["(directory)"]
    from zeropp.experiments.runner import export as export_cmd

    capsys.readouterr()
    export_cmd.main([str(tmp_path / "run"), str(tmp_path / "d")])
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("warning:")] == [
        f"warning: tokenizer files of model.pretrained not copied into {tmp_path / 'd'} ((directory): {pre} cannot "
        "be read (No such file or directory): no tokenizer copied)"
    ]
