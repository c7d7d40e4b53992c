"""The GPT model: shapes, parameter count, causality, presets and config errors."""

import pytest
import torch

from zeropp.models import GPT, GPTConfig, byte_batch

CFG = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)


def test_forward_shapes_loss_and_param_count():
    torch.manual_seed(0)
    m = GPT(CFG)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = m(idx, idx)
    assert logits.shape == (3, 16, 256)
    # the loss is the mean token cross-entropy, computed independently here
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx.reshape(-1))
    torch.testing.assert_close(loss, ref)
    assert m(idx)[1] is None
    assert CFG.num_params() == sum(p.numel() for p in m.parameters())
    assert isinstance(m.blocks, torch.nn.ModuleList) and len(m.blocks) == CFG.n_layers


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    m = GPT(CFG)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    la, lb = m(a)[0], m(b)[0]
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_presets_and_errors():
    assert GPTConfig.preset("tiny", n_layers=3).n_layers == 3
    for name in ("tiny", "small", "medium"):
        c = GPTConfig.preset(name)
        assert c.num_params() == sum(p.numel() for p in GPT(c).parameters())
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="must divide d_model"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="exceeds"):
        GPT(CFG)(torch.zeros(1, 17, dtype=torch.long))


def test_byte_batch_targets_are_shifted_inputs():
    data = bytes(range(256)) * 4
    idx, tgt = byte_batch(data, 4, 16, torch.Generator().manual_seed(0))
    assert idx.shape == tgt.shape == (4, 16)
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    assert torch.equal((idx + 1) % 256, tgt)  # consecutive bytes in this data
