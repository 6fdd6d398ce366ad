"""A Llama-family model's decoder layers in one C++ call per step of decodes, on CPU.

At one row a layer's kernels take ~60 us and the Python between its ten ops (module calls,
views, argument parsing) ~80 us. `CpuDecodeLayers` hands every layer's weights and constants
to cpu_kernels/csrc/decode_layers.cpp once; a step then passes only the embeddings, positions
and attention metadata, and C++ runs the same ops in the same order (so the same bits as the
Python loop, tested in tests/engine/test_cpu_decode_layers.py).

It takes a model whose every layer is the plain Llama layer with quantized weights on the
CPU kernels (the integer ones of --cpu-arithmetic int8, or the exact bf16 ones): four packed
QuantLinears, RMSNorm (Qwen3's q/k norms too), SiLU, one rank, no LoRA; and a step of
decodes alone, without images, on the CPU attention kernels. Anything else runs the Python
loop, and so does every step under `PAGEDSERVE_CPU_DECODE_LAYERS=0` (to compare). The
layers are read at the first step (after LoRA wraps its layers): code that swaps a layer
later sets the model's `cpu_decode` back to None.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

import cpu_kernels
from cpu_kernels import ops
from cpu_kernels.quant_format import NIBBLE_FORMATS
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.quantized import QuantLinear

log = logging.getLogger("pagedserve.engine")

# the C++ op and the families of the ops it calls
FAMILIES = ("decode_layers", "layer_ops", "paged_attention", "quant_linear_bf16")
INT_DOT, BF16_INT4, BF16_INT8 = 0, 1, 2  # the linear kinds of csrc/decode_layers.cpp


class CpuDecodeLayers:
    def __init__(self, model: nn.Module) -> None:
        """`model`: a LlamaModel that `unfit_reason` accepts."""
        first = model.layers[0]
        weights, unpacked, biases, int_dot, params, norms, windows, sinks = [], [], [], [], [], [], [], []
        empty = torch.empty(0)
        for layer in model.layers:
            for linear in _linears(layer):
                if linear.int_dot is not None:
                    packed = linear.int_dot
                    weights.append(packed.data)
                    int_dot.append(ops.int_dot_op_name(packed.fmt))
                    params += [INT_DOT, packed.n, ops.ENCODINGS.index(packed.encoding), 0, 0, 0, 0]
                else:  # packed for the exact bf16 kernels (QuantLinear.pack)
                    weights.append(linear.qweight)
                    int_dot.append("")
                    params += [BF16_INT4 if linear.format in NIBBLE_FORMATS else BF16_INT8, linear.out_features, 0,
                               int(linear.amx), int(linear.zero_units), int(linear.format == "fp4"),
                               linear.unpacked_from_rows]
                unpacked.append(empty if linear.unpacked is None else linear.unpacked)
                biases.append(empty if linear.bias is None else linear.bias.detach())
            attn = layer.self_attn
            heads_norms = [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()] if attn.qk_norm else [empty] * 2
            norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                      *heads_norms]
            windows.append(attn.sliding_window or 0)
            sinks.append(empty if attn.sinks is None else attn.sinks.float().contiguous())
        heads = [first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim]
        self.op = torch.classes.pagedserve_cpu.DecodeLayers(weights, unpacked, biases, int_dot, params, norms,
                                                            windows, sinks, heads, first.input_layernorm.eps)

    def applies(self, x: torch.Tensor, rope, ctx) -> bool:
        """Whether this step is one it runs: decodes alone, on the CPU kernels' cache and rotary."""
        meta = ctx.meta
        return (ctx.mm is None and not meta.prefills and meta.num_decode_tokens == x.shape[0]
                and rope.gathered is None and "decode" in meta.backend_state
                and ctx.kv_caches[0].dtype in ops.KV_CACHE_DTYPES and getattr(ctx.backend, "name", "") == "cpu")

    def __call__(self, x: torch.Tensor, rope, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the last layer, as the Python loop leaves them."""
        tables, lens = ctx.meta.backend_state["decode"]
        return self.op.forward(x, rope.positions, *rope.tables, ctx.kv_caches, ctx.meta.slot_mapping, tables, lens,
                               ctx.backend.scale)


def cpu_decode_layers(model: nn.Module) -> CpuDecodeLayers | None:
    """The one-call layers for `model` (a LlamaModel) where they fit it, else None (logged once)."""
    reason = unfit_reason(model)
    if reason is not None:
        log.debug("decoder layers run in Python: %s", reason)
        return None
    log.info("decode steps run the %d decoder layers in one C++ call", len(model.layers))
    return CpuDecodeLayers(model)


def unfit_reason(model: nn.Module) -> str | None:
    """Why `CpuDecodeLayers` cannot run `model`'s layers, or None."""
    plain_layer, plain_attention, plain_mlp = model.plain_layer_types  # llama.py's: what the op mirrors
    if os.environ.get("PAGEDSERVE_CPU_DECODE_LAYERS", "1") == "0":
        return "turned off by PAGEDSERVE_CPU_DECODE_LAYERS=0"
    if model.shard.size != 1:
        return "tensor parallel"
    for layer in model.layers:
        if type(layer) is not plain_layer or type(layer.self_attn) is not plain_attention \
                or type(layer.mlp) is not plain_mlp:
            return f"{type(layer).__name__} is not the plain Llama layer"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if layer.self_attn.qk_norm:
            norms += (layer.self_attn.q_norm, layer.self_attn.k_norm)
        if any(type(n) is not RMSNorm or n.kernels is None for n in norms) or type(layer.mlp.act) is not SiluAndMul \
                or layer.mlp.act.kernels is None:
            return "the fused layer ops are not in use"
        if any(n.eps != model.layers[0].input_layernorm.eps for n in norms):
            return "the norms' epsilons differ"
        for linear in _linears(layer):
            if type(linear) is not QuantLinear or linear.perm is not None or linear.int8_inputs \
                    or not (linear.int_dot is not None or linear.packed):
                return "a linear layer is dense, has LoRA, act-order or W8A8, or is on neither CPU kernel"
    for family in FAMILIES:
        reason = cpu_kernels.unavailable_reason(family)
        if reason is not None:
            return reason
    return None


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
