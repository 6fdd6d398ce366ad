"""OpenAI's gpt-oss (GptOssForCausalLM), following transformers' implementation.

It is the Llama decoder with:
- attention biases on q, k, v and o, and a learned sink logit per head that joins every
  softmax's denominator without adding a value (`Attention.sinks`, passed to the backend);
  layers alternate a 128-token sliding window and full attention; YaRN rotary;
- every MLP a sparse block: a biased router, a softmax over the top-k logits (in their own
  dtype, as HF), experts with biases and a clamped SwiGLU:

      gate = min(gate, limit);  up = clamp(up, -limit, limit)
      out  = (up + 1) * gate * sigmoid(alpha * gate)

The checkpoint keeps each layer's experts fused and transposed against nn.Linear, gate and
up interleaved column by column:

    mlp.router.weight [E, H], .bias [E]
    mlp.experts.gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]), gate_up_proj_bias [E, 2I]
    mlp.experts.down_proj [E, I, H], down_proj_bias [E, H]
    self_attn.sinks [Hq]

which the loader turns into the grouped experts' [E, 2I, H] (gate rows, then up rows) and
[E, H, I]. OpenAI's checkpoints store the two experts' matrices in MXFP4 instead
(`quantization_config.quant_method: mxfp4`; cpu_kernels/mxfp4_format.py):

    mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16], gate_up_proj_scales [E, 2I, H/32]
    mlp.experts.down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32]

(rows = output features, not transposed). A bfloat16 model on a CPU with the bf16 kernels
keeps them as stored: each expert's matrix becomes fp4 blocks (the int4 kernels' layout with
e2m1 codes, cpu_kernels/quant_format.py `from_mxfp4`; 5 bits a weight with the layout's scale
and zero) run by `PackedExperts`, the dense copy never written. Elsewhere (float32, CUDA, a
scale outside fp16's powers of two) they are dequantized at load, exactly (every MXFP4 value
is exact in bfloat16).

Under tensor parallelism each rank keeps its heads' sinks and its share of each expert's
width, as for the other MoE models: packed fp4, its rows of gate and up and its columns of
down (dense where those cut a 32-value block).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from cpu_kernels import mxfp4_format, ops
from cpu_kernels.quant_format import QuantizedTensor, from_mxfp4
from engine.distributed.state import all_reduce
from engine.layers import Layer
from engine.layers.activation import ClampedSwiGLU
from engine.layers.moe import grouped_experts, pack_fp4
from engine.layers.parallel import SINGLE, TPShard, shard_cols
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import Experts, MoeForCausalLM, Weight

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4 = re.compile(r"(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


class GptOssMoeBlock(Layer):
    def __init__(self, cfg: ModelArchConfig, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard, self.top_k = shard, cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = Experts(cfg, shard, bias=True)  # MXFP4 ones kept as stored (see the top)
        self.act = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        e = self.experts
        out = grouped_experts(x, e.matrix("gate_up_proj"), e.matrix("down_proj"), weights, ids, self.act,
                              e.gate_up_proj_bias, e.down_proj_bias)
        return all_reduce(out, self.shard)


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        LlamaForCausalLM.__init__(self, cfg, max_positions, shard)  # not MoeForCausalLM's blocks
        for layer in self.model.layers:  # on the meta device (see loader) the dense MLPs cost nothing
            layer.mlp = GptOssMoeBlock(cfg, shard)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        expert = self.model.layers[0].mlp.experts.gate_up_proj
        kernel = ops.int8_dot_supported if self.int8_experts else ops.bf16_dot_supported
        self._fp4_experts = expert.device.type == "cpu" and expert.dtype == torch.bfloat16 and kernel()
        super().load_weights(weights)

    def _take_experts(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The fused, transposed, interleaved experts (see the top) into the grouped layout,
        MXFP4 ones dequantized an expert at a time; everything else on to the Llama loader."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4: blocks or scales waiting for the other
        for name, tensor in weights:
            if m := _MXFP4.match(name):
                parts = pending.setdefault(m.group(1), {})
                parts[m.group(2)] = tensor
                if len(parts) == 2:
                    self._load_mxfp4(params, m.group(1), pending.pop(m.group(1)))
            elif m := _EXPERTS.match(name):
                prefix, kind, bias = m.group(1), m.group(2), m.group(3) or ""
                for expert in range(tensor.shape[0]):  # [in, out] (a bias: [out]) -> rows of out
                    rows = tensor[expert] if bias else tensor[expert].t()
                    self._load_rows(params, f"{prefix}.{kind}{bias}", expert, rows)
            else:
                yield name, tensor
        if pending:
            raise ValueError(f"mxfp4 checkpoint lacks the other half of {min(pending)}'s blocks and scales")

    def _load_mxfp4(self, params: dict, name: str, parts: dict[str, torch.Tensor]) -> None:
        """One MXFP4 matrix of every expert ([E, out, in/32, 16] blocks, [E, out, in/32] scales),
        dequantized exactly, one expert at a time."""
        mxfp4_format.check(parts["blocks"], parts["scales"], name)
        if self._fp4_experts and self._keep_fp4(params, name, parts):
            return
        blocks, scales = parts["blocks"], parts["scales"]
        for expert in range(blocks.shape[0]):
            self._load_rows(params, name, expert, mxfp4_format.dequantize(blocks[expert], scales[expert]))

    def _load_rows(self, params: dict, name: str, expert: int, rows: torch.Tensor) -> None:
        """One expert's matrix (or bias) with its output features first: gate_up's interleaved
        gate and up rows split into parts 0 and 1, down's as it is."""
        if name.rpartition(".")[2].startswith("down_proj"):
            self._load_expert(params, name, expert, None, rows)
        else:
            for part, values in enumerate((rows[0::2], rows[1::2])):  # gate, up
                self._load_expert(params, name, expert, part, values)

    def _keep_fp4(self, params: dict, name: str, parts: dict[str, torch.Tensor]) -> bool:
        """Pack one MXFP4 matrix of every expert as fp4 for the bf16 kernels (or, with
        `int8_experts`, for the integer kernel) and drop its dense
        parameter, never written: gate_up's rows reordered to gate then up, and under tensor
        parallelism this rank's rows of each (down: its columns, on 32-value blocks). False
        (nothing done) where a scale is outside fp16's powers of two, which the kernels cannot
        hold, or a rank's columns would cut a block."""
        blocks, scales = parts["blocks"], parts["scales"]
        start, count = self.shard.split(self.config.moe_intermediate_size)
        gate_up = "gate_up" in name
        if gate_up:  # this rank's gate rows (even rows), then its up rows (odd rows)
            order = torch.cat([torch.arange(0, blocks.shape[1], 2)[start:start + count],
                               torch.arange(1, blocks.shape[1], 2)[start:start + count]])
        weights = []
        for expert in range(blocks.shape[0]):
            weight = from_mxfp4(blocks[expert], scales[expert])
            if gate_up:
                weight = weight.map_rows(lambda t: t.index_select(0, order))
            elif self.shard.size > 1:
                weight = shard_cols(weight, start, count)
                if not isinstance(weight, QuantizedTensor):  # the cut fell inside a block
                    return False
            weights.append(weight)
        expected = tuple(params[name].shape[1:])
        if weights[0].shape != expected:
            raise ValueError(f"shape mismatch for {name!r}: MXFP4 experts {list(weights[0].shape)} vs "
                             f"parameter {list(expected)}")
        packed = pack_fp4(weights, self.int8_experts)
        if packed is None:
            return False
        experts_name, _, kind = name.rpartition(".")
        self.get_submodule(experts_name).keep_packed(kind, packed)  # the dense one was never written
        parts_of = (None,) if kind == "down_proj" else (0, 1)
        self._experts_loaded.update((name, e, p) for e in range(len(weights)) for p in parts_of)
        return True
