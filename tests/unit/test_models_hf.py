"""Hugging Face GPT-2 and Llama through the engine.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_models_hf.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.runtime_helpers import micro_batch
from zeropp.models import HFConfig, build_hf_model
from zeropp.models.hf import hf_model_config

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
GPT2 = HFConfig(hf_config="gpt2", d_model=32, n_layers=2, n_heads=2, seq_len=16)
LLAMA = HFConfig(hf_config="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48, seq_len=16)


@pytest.fixture
def tf() -> Any:
    return pytest.importorskip("transformers", reason=REASON)


@pytest.mark.parametrize(
    "cfg",
    [
        GPT2,
        LLAMA,
        GPT2.with_(tie_embeddings=True),
        LLAMA.with_(n_kv_heads=None, d_model=24),
        GPT2.with_(attn_implementation="eager", n_layers=1, intermediate_size=17),
    ],
    ids=["gpt2", "llama", "gpt2-tied", "llama-mha", "gpt2-eager"],
)
def test_shape_blocks_and_param_count(tf: Any, cfg: HFConfig) -> None:
    model = build_hf_model(cfg, seed=0)
    assert model.hf.config._attn_implementation == cfg.attn_implementation
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.n_layers
    assert not any("blocks" in n for n, _ in model.named_parameters())  # blocks are not registered twice
    idx, tgt = micro_batch(0, 0, 0, cfg)  # type: ignore[arg-type]
    logits, loss = model(idx[:, :7], tgt[:, :7])  # a short window (7 of 16)
    assert logits.shape == (idx.size(0), 7, cfg.vocab_size) and logits.dtype == torch.float32
    ref = F.cross_entropy(model.hf(input_ids=idx[:, :7]).logits.reshape(-1, cfg.vocab_size), tgt[:, :7].reshape(-1))
    assert torch.equal(loss, ref)  # targets are the next tokens already: no second shift
    assert model(idx)[1] is None
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    same = build_hf_model(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))  # seeded
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), build_hf_model(cfg, seed=1).parameters()))


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_pretrained_local_directory_round_trip(tf: Any, tmp_path: Any, cfg: HFConfig) -> None:
    """Weights, and the checkpoint's own settings that HFConfig does not hold (norm epsilon), load;
    dropout is switched off."""
    conf = hf_model_config(cfg)
    eps, drop = {"gpt2": ("layer_norm_epsilon", "resid_pdrop"), "llama": ("rms_norm_eps", "attention_dropout")}[
        cfg.hf_config
    ]
    setattr(conf, eps, 1e-3)
    setattr(conf, drop, 0.1)
    torch.manual_seed(3)
    hf = type(build_hf_model(cfg).hf)(conf)
    hf.save_pretrained(tmp_path)
    hf.eval()  # the reference without its dropout
    loaded = build_hf_model(cfg.with_(pretrained=str(tmp_path)), seed=0)  # the seed must not matter
    assert getattr(loaded.hf.config, eps) == 1e-3 and getattr(loaded.hf.config, drop) == 0.0
    assert loaded.training and loaded.hf.config.use_cache is False
    a, b = hf.state_dict(), loaded.hf.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    idx, tgt = micro_batch(0, 0, 0, cfg)  # type: ignore[arg-type]
    assert torch.equal(hf(input_ids=idx).logits, loaded(idx, tgt)[0])
    with pytest.raises(ValueError, match=r"does not match this config; the checkpoint has d_model=32"):
        cfg.with_(pretrained=str(tmp_path), d_model=64)
    other = "llama" if cfg.hf_config == "gpt2" else "gpt2"
    with pytest.raises(ValueError, match=f"holds a '{cfg.hf_config}' model but hf_config='{other}'"):
        HFConfig(hf_config=other, pretrained=str(tmp_path))


def test_pretrained_missing_directory_is_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"HFConfig.pretrained=.*does not exist; give a local directory"):
        HFConfig(pretrained=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"has no config.json"):
        HFConfig(pretrained=str(tmp_path))


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(hf_config="bert"), "hf_config='bert' is not supported; choose one of gpt2, llama"),
        (dict(n_layers=0), "HFConfig.n_layers must be an integer >= 1, got 0"),
        (dict(d_model=30, n_heads=4), "n_heads=4 must divide d_model=30"),
        (dict(n_kv_heads=1), "n_kv_heads=1 applies to hf_config=llama only"),
        (dict(hf_config="llama", n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
        (dict(hf_config="llama", d_model=12, n_heads=4), "head size d_model / n_heads = 3 must be even"),
        (dict(intermediate_size=0), "HFConfig.intermediate_size must be an integer >= 1"),
        (dict(attn_implementation="flash"), "choose sdpa or eager"),
    ],
)
def test_bad_settings_name_the_field(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        HFConfig(**kw)


def test_missing_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    cfg = HFConfig(hf_config="llama")  # the config needs no transformers
    assert cfg.num_params() > 0
    with pytest.raises(ImportError, match=r'need the optional extra: pip install -e "\.\[hf\]"'):
        build_hf_model(cfg)


def _saved(tmp_path: Any, cfg: HFConfig, name: str = "ckpt") -> Any:
    """``cfg``'s model written by ``save_pretrained`` into ``tmp_path / name``."""
    path = tmp_path / name
    build_hf_model(cfg, seed=0).hf.save_pretrained(path)
    return path


def test_a_bad_config_json_is_named_and_refused(tf: Any, tmp_path: Any) -> None:
    """config.json is read as a bounded regular file holding a JSON object: anything else is one
    ValueError naming the file (before: an AttributeError for a JSON list, "has no config.json"
    for a FIFO, and "set hf_config to match" for an architecture zeropp does not build)."""
    import json
    import os

    path = _saved(tmp_path, GPT2)
    conf = path / "config.json"
    good = json.loads(conf.read_text())
    for text, words in [
        ("{not json", r"config.json is not JSON \(Expecting"),
        ("[1, 2]", r"config.json holds a JSON list, not the object save_pretrained writes"),
        (
            json.dumps(good | {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}),
            r"holds a quantized model \(config.json's quantization_config: bitsandbytes\); zeropp trains float",
        ),
        (
            json.dumps(good | {"model_type": "mistral"}),
            r"holds a 'mistral' model .*which zeropp does not build; it supports gpt2, llama",
        ),
    ]:
        conf.write_text(text)
        with pytest.raises(ValueError, match=words):
            GPT2.with_(pretrained=str(path))
    conf.unlink()
    os.mkfifo(conf)  # reading it would wait for a writer forever
    with pytest.raises(ValueError, match=r"cannot read .*config.json: is a FIFO \(named pipe\), not a regular file"):
        GPT2.with_(pretrained=str(path))


def test_weights_that_are_not_the_models_are_refused_before_loading(tf: Any, tmp_path: Any) -> None:
    """The safetensors headers must hold exactly the model's weights: transformers would fill a
    missing one with random values and drop an extra one without an error (before: the run
    trained from partly random weights, or a traceback came from every rank)."""
    from safetensors.torch import load_file, save_file

    from zeropp.models.hf import check_pretrained

    path = _saved(tmp_path, GPT2)
    weights = path / "model.safetensors"
    good = load_file(weights)
    cfg = GPT2.with_(pretrained=str(path))
    some = "transformer.h.1.attn.c_attn.weight"
    cases: list[tuple[dict[str, torch.Tensor], str]] = [
        ({k: v for k, v in good.items() if k != some}, rf"missing \['{some}'\]"),
        (good | {"transformer.h.5.mlp.c_fc.weight": torch.zeros(3)}, r"not in the model \['transformer.h.5.mlp"),
        (good | {some: torch.zeros(5, 5)}, rf"shaped differently: {some} \[5, 5\] \(the model: \[32, 96\]\)"),
    ]
    for state, words in cases:
        save_file(state, weights, metadata={"format": "pt"})
        for check in (check_pretrained, build_hf_model):
            with pytest.raises(ValueError, match=r"its weights are not those of the gpt2 model .*" + words):
                check(cfg)
    save_file(good, weights, metadata={"format": "pt"})
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file or is truncated"):
        build_hf_model(cfg)
    weights.unlink()
    with pytest.raises(ValueError, match=r"holds no weights file; zeropp loads model.safetensors"):
        build_hf_model(cfg)
    torch.save(good, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"holds only pytorch_model.bin \(pickled weights\); .*a pickle can run code"):
        build_hf_model(cfg)  # never unpickled


def test_sharded_and_ignorable_weights_load(tf: Any, tmp_path: Any) -> None:
    """What transformers loads exactly still loads: shards with an index, bf16 weights, GPT-2's
    legacy attention-mask buffers; an index naming a file outside the directory is refused."""
    import json

    from safetensors.torch import load_file, save_file

    ref = build_hf_model(GPT2, seed=0).hf
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    loaded = build_hf_model(GPT2.with_(pretrained=str(sharded)))
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), loaded.hf.state_dict().values()))
    legacy = _saved(tmp_path, GPT2, "legacy")
    state = load_file(legacy / "model.safetensors") | {"transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16)}
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    build_hf_model(GPT2.with_(pretrained=str(legacy)))
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "../legacy/model.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"names '../legacy/model.safetensors', which is not a file of"):
        build_hf_model(GPT2.with_(pretrained=str(sharded)))


def test_buffers_older_transformers_saved_load(tf: Any, tmp_path: Any) -> None:
    """Checkpoints written by older ``transformers`` hold buffers today's versions drop when loading:
    Llama's ``rotary_emb.inv_freq`` (before 4.31), GPT-2's ``attn.masked_bias``. They load, with
    the same weights (before: refused as weights not in the model); a real extra weight still is not."""
    from safetensors.torch import load_file, save_file

    for cfg, extra in (
        (LLAMA, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
        (GPT2, {"transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}),
    ):
        path = _saved(tmp_path, cfg, cfg.hf_config)
        state = load_file(path / "model.safetensors")
        save_file(state | extra, path / "model.safetensors", metadata={"format": "pt"})
        loaded = build_hf_model(cfg.with_(pretrained=str(path)))
        assert all(torch.equal(loaded.hf.state_dict()[k], v) for k, v in state.items() if k in loaded.hf.state_dict())
        save_file(state | {"model.extra.weight": torch.ones(2)}, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"not in the model \['model.extra.weight'\]"):
            build_hf_model(cfg.with_(pretrained=str(path)))


def test_a_directory_with_a_peft_adapter_is_refused(tf: Any, tmp_path: Any) -> None:
    """A `--lora-format peft` export (base model plus adapter/) or a peft adapter directory given as
    the pretrained model: loading it would leave the adapter out (before: the run started from
    the base model, silently, or said 'has no config.json')."""
    path = _saved(tmp_path, GPT2)
    (path / "adapter").mkdir()
    (path / "adapter" / "adapter_config.json").write_text("{}")
    for given in (path, path / "adapter"):
        with pytest.raises(ValueError, match=r"holds a peft adapter \(.*adapter_config.json\), which is not loaded"):
            GPT2.with_(pretrained=str(given))


def test_the_weights_checked_are_the_ones_transformers_reads(tf: Any, tmp_path: Any) -> None:
    """config.json's ``transformers_weights`` makes transformers read the file it names (a pickled
    ``adapter_model.bin`` included), and model.safetensors comes before a shard index: the check
    reads that same file, and refuses any other name (before: the header check read one file and
    transformers loaded another, a pickle among them)."""
    import json

    from safetensors.torch import load_file

    path = _saved(tmp_path, GPT2)
    torch.save(load_file(path / "model.safetensors"), path / "adapter_model.bin")
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(conf | {"transformers_weights": "adapter_model.bin"}))
    with pytest.raises(ValueError, match=r"names its weights file transformers_weights='adapter_model.bin'"):
        build_hf_model(GPT2.with_(pretrained=str(path)))  # the pickle is never read
    (path / "config.json").write_text(json.dumps(conf))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    build_hf_model(GPT2.with_(pretrained=str(path)))  # a stale index beside model.safetensors: transformers' order


def test_special_token_ids_are_not_a_different_model(tf: Any) -> None:
    """A GPT-2 directory's config names its special tokens (50256); the config the same settings
    build names none. That is no difference of the model a checkpoint was trained in (before: a
    resume without the directory was refused over them), while a real one still is."""
    from zeropp.models.hf import config_differences, recorded_config

    recorded = recorded_config(GPT2) | {"bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": 0}
    assert config_differences(GPT2, recorded) == []
    assert config_differences(GPT2, recorded | {"layer_norm_epsilon": 0.5}) == ["layer_norm_epsilon=0.5 (now 1e-05)"]
