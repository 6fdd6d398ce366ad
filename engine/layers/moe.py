"""Mixture-of-experts primitives: top-k routing and the batched expert op.

The experts run grouped: the step's (token, expert) pairs are sorted by expert, each
expert multiplies its contiguous slice of gathered tokens in one matmul (experts that
received no token are skipped), and the weighted results are scattered back onto their
tokens with one `index_add_`. The Python loop is over experts, never over tokens, and a
token's result does not depend on which other tokens share its expert's matmul beyond
the matmul's own summation order.

    pairs (T=3, k=2)   t0:e2 t0:e0 t1:e2 t1:e1 t2:e0 t2:e2
    sorted by expert   e0:[t0 t2] e1:[t1] e2:[t0 t1 t2]      -> 3 matmuls, e3 skipped
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from cpu_kernels import mxfp4_format, ops, packing
from cpu_kernels.quant_format import QuantizedTensor, from_mxfp4, to_mxfp4


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) as Mixtral and Qwen3-MoE route in HF: a
    float32 softmax over all experts, the top k, optionally renormalised to sum to 1 (for
    Mixtral, which always renormalises, that equals a softmax over the top-k logits)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, where expert e is
    down(act(gate_up(x))): x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    weights, ids [T, k]; biases b13 [E, 2I], b2 [E, H] where the experts have them (gpt-oss).
    w13 and w2 may instead be `PackedExperts` (quantized experts, their own kernels).
    `act` maps [N, 2I] -> [N, I] (SiLU of gate times up). A product in float32 weights is cast
    to x's dtype after weighting, as HF does."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _every_expert(x, w13, w2, weights, ids, act, b13, b2)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=len(w13)).tolist()  # one sync per layer
    gathered = x.index_select(0, tokens)
    out = torch.empty_like(gathered)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out[rows] = _expert(gathered[rows], expert, w13, w2, act, b13, b2)
        start += count
    weighted = (out * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    # index_add_ adds each token's pairs in expert order: HF's order of summation.
    return torch.zeros_like(x).index_add_(0, tokens, weighted)


def _expert(x: torch.Tensor, e: int, w13: torch.Tensor, w2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
            b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """Expert e on rows x: down(act(gate_up(x)))."""
    return _linear(act(_linear(x, e, w13, b13)), e, w2, b2)


def _linear(x: torch.Tensor, e: int, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):  # PackedExperts
        return w.linear(e, x, b)
    return F.linear(x, w[e], None if b is None else b[e])


class PackedExperts:
    """One matrix of every expert ([out, in] each) packed for a CPU kernel, what grouped_experts
    takes in place of a dense [E, out, in] tensor; bfloat16 activations. `format`: "int4" |
    "int8" | "fp4" in the bf16 kernels' layout (cpu_kernels.packing), or "mxfp4_int8": MXFP4
    for the integer kernel (mxfp4_format.pack_int8; --cpu-arithmetic int8)."""

    def __init__(self, fmt: str, data: list[torch.Tensor], out_features: int, in_features: int,
                 zero_units: list[bool] | None = None) -> None:
        self.format, self.data = fmt, data
        self.zero_units = zero_units or [False] * len(data)
        self.out_features, self.in_features = out_features, in_features

    def __len__(self) -> int:
        return len(self.data)

    def linear(self, e: int, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.format == "mxfp4_int8":
            y = ops.mxfp4_int8_linear(x.contiguous(), self.data[e], self.out_features)
        else:
            y = ops.bf16_quant_linear(x.contiguous(), self.format, self.data[e], self.out_features,
                                      zero_units=self.zero_units[e])
        return y if b is None else y + b[e]

    def nbytes(self) -> int:
        return sum(d.numel() for d in self.data)


def pack_fp4(weights: Iterable[QuantizedTensor], int8: bool = False) -> PackedExperts | None:
    """fp4 weights, one per expert, packed for the bf16 kernels (None where a block's scale
    falls outside fp16's powers of two, which they cannot hold: those stay dense), or with
    `int8` as MXFP4 for the integer kernel (--cpu-arithmetic int8), which holds every scale."""
    weights = list(weights)
    n, k = weights[0].shape
    if int8:
        return PackedExperts("mxfp4_int8", [mxfp4_format.pack_int8(*to_mxfp4(w)) for w in weights], n, k)
    packed = []
    for weight in weights:
        if packing.zero_encoding(weight) is None:
            return None
        packed.append(packing.pack(weight))
    return PackedExperts("fp4", [p.data for p in packed], n, k, [p.zero_units for p in packed])


def fp4_experts(matrices: torch.Tensor, int8: bool = False) -> PackedExperts | None:
    """Float experts [E, out, in] quantized to MXFP4 (--quantization mxfp4) and packed as
    `pack_fp4` packs them; None where `in` is not a multiple of 32 or `pack_fp4` says so."""
    if matrices.shape[-1] % mxfp4_format.BLOCK:
        return None
    return pack_fp4((from_mxfp4(*mxfp4_format.quantize(matrix)) for matrix in matrices), int8)


def _every_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """The same sum with no data-dependent shapes, for CUDA-graph capture (decode batches):
    every expert runs on every token, unchosen ones weighted by exactly 0 (adding 0 leaves
    a token's sum, taken in expert order, unchanged)."""
    combine = torch.zeros(ids.shape[0], len(w13), dtype=weights.dtype, device=x.device)
    combine.scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for expert in range(len(w13)):
        y = _expert(x, expert, w13, w2, act, b13, b2)
        out += (y * combine[:, expert:expert + 1]).to(x.dtype)
    return out


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """The same sum, one token and one expert at a time: the slow reference for tests."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = _expert(x[t:t + 1], e, w13, w2, act, b13, b2)
            out[t] += (y[0] * weights[t, j]).to(x.dtype)
    return out
