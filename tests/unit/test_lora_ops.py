"""The batched LoRA term and adapter reading: grouped by adapter it equals each token's own
adapter applied alone, whatever the mix; PEFT files with features we do not run are refused
by name; the prefix-cache keys of the base model stay what they were."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from common.errors import LoraError
from common.prefix_hash import block_extra_keys
from engine.lora.adapter import read_adapter
from engine.lora.layers import LoraBatch, LoraLinear
from engine.lora.manager import LoraManager


def test_segmented_lora_equals_per_token_reference():
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 24, bias=False)
    batch = LoraBatch()
    layer = LoraLinear(base, [8, 8, 8], batch, max_loras=3, max_rank=4, dtype=torch.float32,
                       device=torch.device("cpu"))
    adapters = {}
    for slot, rank in enumerate((4, 2, 3)):
        parts = [(torch.randn(rank, 32), torch.randn(8, rank)) if j != slot else None for j in range(3)]
        layer.set_slot(slot, parts, rank)
        adapters[slot] = parts
    # Rows as the model runner lays them out: decodes, then prefill chunks; base rows between.
    rows = [SimpleNamespace(token_ids=[0] * n, lora_slot=s) for n, s in
            [(1, -1), (1, 0), (1, 0), (1, 2), (3, -1), (4, 1), (2, 1), (2, 2), (1, -1)]]
    manager = SimpleNamespace(batch=batch)
    LoraManager.set_tokens(manager, rows)
    assert batch.segments == [(0, 1, 3), (2, 3, 4), (1, 7, 13), (2, 13, 15)]  # neighbours merged
    slots = [r.lora_slot for r in rows for _ in r.token_ids]
    x = torch.randn(len(slots), 32)
    got = layer(x)
    for i, s in enumerate(slots):
        want = base(x[i])
        if s >= 0:
            want = want + torch.cat([torch.zeros(8) if p is None else p[1] @ (p[0] @ x[i])
                                     for p in adapters[s]])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    layer.clear_slot(1)  # an unloaded adapter's rows get no LoRA term
    torch.testing.assert_close(layer(x)[7:13], base(x[7:13]))


def _adapter(folder, config: dict, tensors: dict | None = None):
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            **config}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    tensors = tensors or {key.format("A"): torch.ones(2, 8), key.format("B"): torch.ones(4, 2)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("config, tensors, message", [
    ({"r": 32}, None, "rank 32 exceeds --max-lora-rank 16"),
    ({"use_dora": True}, None, "DoRA is not supported"),
    ({"bias": "all"}, None, "bias 'all' is not supported"),
    ({"peft_type": "IA3"}, None, "only LORA runs"),
    ({}, {"base_model.model.lm_head.lora_A.weight": torch.ones(2, 8)}, "not a LoRA on one of q_proj"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)},
     "needs lora_A"),
])
def test_unsupported_adapters_are_refused(tmp_path, config, tensors, message):
    with pytest.raises(LoraError, match=message) as e:
        read_adapter("x", _adapter(tmp_path / "x", config, tensors), max_rank=16)
    assert e.value.kind == "invalid"


def test_scaling_and_rslora(tmp_path):
    plain = read_adapter("p", _adapter(tmp_path / "p", {"r": 2, "lora_alpha": 4}), 16)
    rs = read_adapter("r", _adapter(tmp_path / "r", {"r": 2, "lora_alpha": 4, "use_rslora": True}), 16)
    assert plain.scaling == 2.0 and rs.scaling == pytest.approx(4 / 2 ** 0.5)
    a, b = plain.weights[(0, "q_proj")]
    assert a.shape == (2, 8) and torch.equal(b, torch.full((4, 2), 2.0))  # scaling folded into B


def test_adapter_must_fit_the_model(tmp_path):
    class Arch:
        num_heads, num_kv_heads, head_dim = 2, 1, 4

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(16, 16, bias=False)  # q 8, k 4, v 4; in 16 (not 8)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = Attn()
    manager = LoraManager(model, Arch, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(LoraError, match="does not fit this model: layer 0 q_proj"):
        manager.load("x", _adapter(tmp_path / "x", {}))
    assert not manager.adapters


def test_block_extra_keys():
    assert block_extra_keys(None) == () and block_extra_keys("") == ()
    assert block_extra_keys("a", "/p") == ("lora", "a", "/p") != block_extra_keys("a", "/q")
