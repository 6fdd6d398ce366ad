"""Mixture-of-experts Llama variants: Mixtral and Qwen3-MoE.

Both are the Llama decoder (Qwen3-MoE with Qwen3's q/k norm) whose MLP, in the layers
`cfg.moe_layers`, is a sparse block: a router picks each token's top-k experts and the
experts run grouped by expert (engine/layers/moe.py). The experts' weights are 3-D
parameters, [E, 2I, H] for gate and up and [E, H, I] for down, filled from the
checkpoint's per-expert tensors:

    Mixtral     model.layers.L.block_sparse_moe.experts.N.{w1,w3,w2}.weight, .gate.weight
    Qwen3-MoE   model.layers.L.mlp.experts.N.{gate_proj,up_proj,down_proj}.weight, mlp.gate.weight

(or transformers' fused in-memory form, mlp.experts.gate_up_proj / down_proj). The
experts and the router stay dense under --quantization int4/int8; the attention layers
and the LM head are quantized as in Llama. --quantization mxfp4 quantizes the experts alone,
to MXFP4 kept as fp4 blocks (`quantize_experts_mxfp4`). Under tensor parallelism each rank keeps its
share of every expert's intermediate width, as for the dense MLP, and the block's output
is all-reduced.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.distributed.state import all_reduce
from engine.layers import Layer
from engine.layers.activation import SiluAndMul
from engine.layers.moe import PackedExperts, fp4_experts, grouped_experts, route
from engine.layers.parallel import SINGLE, TPShard
from engine.layers.quantized import QuantizedTensor
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

Weight = torch.Tensor | QuantizedTensor
# checkpoint name of one expert's matrix -> (our parameter, part: 0 gate, 1 up, None down)
_PARTS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
          "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Experts(nn.Module):
    """This rank's share of the experts' weights (no forward: the MoE blocks run them grouped),
    and biases where they have them (gpt-oss). A matrix kept as fp4 blocks (MXFP4, see
    `keep_packed`) is in `packed` and its dense parameter is None."""

    def __init__(self, cfg: ModelArchConfig, shard: TPShard = SINGLE, bias: bool = False) -> None:
        super().__init__()
        if cfg.moe_intermediate_size % shard.size:
            raise ValueError(f"tensor_parallel_size {shard.size}: the experts' width "
                             f"{cfg.moe_intermediate_size} does not divide by {shard.size}")
        n, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * width, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n, hidden, width), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * width), requires_grad=False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(n, hidden), requires_grad=False) if bias else None
        self.packed: dict[str, PackedExperts] = {}  # matrix name ("gate_up_proj", "down_proj") -> fp4

    def matrix(self, name: str) -> torch.Tensor | PackedExperts:
        """What grouped_experts multiplies by: the packed matrix, else the dense parameter."""
        return self.packed.get(name, getattr(self, name))

    def keep_packed(self, name: str, packed: PackedExperts) -> None:
        """Run `name` from `packed` and free its dense parameter (allocated, maybe never written)."""
        self.packed[name] = packed
        setattr(self, name, None)


class SparseMoeBlock(Layer):
    def __init__(self, cfg: ModelArchConfig, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard, self.top_k, self.renormalize = shard, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg, shard)
        self.act = SiluAndMul()
        # HF: Qwen3-MoE casts the routing weights to the model's dtype, Mixtral keeps float32.
        self.weights_in_model_dtype = cfg.model_type == "qwen3_moe"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        e = self.experts
        out = grouped_experts(x, e.matrix("gate_up_proj"), e.matrix("down_proj"), weights, ids, self.act)
        return all_reduce(out, self.shard)


@torch.no_grad()
def quantize_experts_mxfp4(model: nn.Module, int8: bool = False) -> int:
    """--quantization mxfp4: every MoE block's experts (Mixtral, Qwen3-MoE, gpt-oss), loaded
    in float, quantized to MXFP4 and kept as fp4 blocks for the bf16 kernels (`fp4_experts`;
    `int8`: packed for the integer kernel), their dense copies freed; returns how many
    matrices (2 per block where every scale fits)."""
    count = 0
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(experts, name)
            packed = None if dense is None else fp4_experts(dense.data, int8)
            if packed is not None:
                experts.keep_packed(name, packed)
                count += 1
    return count


class MoeForCausalLM(LlamaForCausalLM):
    # MXFP4 experts for the integer kernel (--cpu-arithmetic int8) instead of the bf16 ones;
    # load_model sets it before the weights load.
    int8_experts = False

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, max_positions, shard)
        for i in cfg.moe_layers:  # on the meta device (see loader) the dense MLPs cost nothing
            self.model.layers[i].mlp = SparseMoeBlock(cfg, shard)

    @staticmethod
    def linear_sources(cfg: ModelArchConfig) -> dict[str, list[str]]:
        """Llama's, less the sparse layers' MLPs: experts and router stay dense."""
        sparse = {f"model.layers.{i}.mlp." for i in cfg.moe_layers}
        return {name: sources for name, sources in LlamaForCausalLM.linear_sources(cfg).items()
                if not any(name.startswith(prefix) for prefix in sparse)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        self._experts_loaded: set[tuple[str, int, int | None]] = set()
        super().load_weights(self._take_experts(weights))

    def _take_experts(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Load expert tensors here; pass everything else on to the Llama loader."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
            if isinstance(tensor, QuantizedTensor) and ".mlp.experts." in name:
                tensor = tensor.dequantize()
            if m := _PER_EXPERT.match(name):
                if m.group(3) not in _PARTS:
                    raise ValueError(f"checkpoint tensor {name!r}: unknown expert matrix {m.group(3)!r}")
                param, part = _PARTS[m.group(3)]
                self._load_expert(params, f"{m.group(1)}.{param}", int(m.group(2)), part, tensor)
            elif m := _FUSED.match(name):
                self._load_fused(params, name, m.group(2), tensor)
            else:
                yield name, tensor

    def _load_fused(self, params: dict, name: str, kind: str, tensor: torch.Tensor) -> None:
        width = tensor.shape[1] // 2 if kind == "gate_up_proj" else tensor.shape[2]
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                self._load_expert(params, name, expert, None, tensor[expert])
            else:
                for part in (0, 1):
                    self._load_expert(params, name, expert, part, tensor[expert, part * width:(part + 1) * width])

    def _load_expert(self, params: dict, name: str, expert: int, part: int | None, tensor: torch.Tensor) -> None:
        """Copy one expert's gate (part 0), up (1) or down (None) matrix, this rank's slice
        of the intermediate width: rows of gate and up, columns of down."""
        if name not in params or expert >= params[name].shape[0]:
            raise ValueError(f"checkpoint expert {expert} of {name!r} has no place in {self.config.model_type}")
        start, count = self.shard.split(self.config.moe_intermediate_size)
        target = params[name].data[expert]
        source = tensor
        if part is not None:
            target = target.narrow(0, part * count, count)
        if self.shard.size > 1:
            if part is not None:  # gate or up rows (or their biases)
                source = source.narrow(0, start, count)
            elif source.dim() == 2:  # down's columns
                source = source.narrow(1, start, count)
            elif self.shard.rank:  # down's bias: added once, before the ranks' sum
                source = torch.zeros_like(source)
        if source.shape != target.shape:
            raise ValueError(f"shape mismatch for expert {expert} of {name!r}: checkpoint "
                             f"{tuple(tensor.shape)} vs parameter {tuple(target.shape)}")
        target.copy_(source)
        self._experts_loaded.add((name, expert, part))

    def _check_all_loaded(self, names: list[str], loaded: set[str]) -> None:
        experts = [n for n in names if ".mlp.experts." in n]
        missing = [f"{n}[{e}]" for n in experts for e in range(self.config.num_experts)
                   for part in ((None,) if n.endswith(("down_proj", "down_proj_bias")) else (0, 1))
                   if (n, e, part) not in self._experts_loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert matrices, e.g. {missing[:3]}")
        super()._check_all_loaded([n for n in names if ".mlp.experts." not in n], loaded)
