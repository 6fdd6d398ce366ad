"""Where a Qwen2.5-VL vision tower's time goes, pagedserve's or HF's (both keep HF's module
names): one call timed by part with forward hooks, and by op with torch.profiler.

    patch embed            patch_embed.proj (our Linear, HF's Conv3d)
    attention qkv / out    blocks.*.attn.qkv, blocks.*.attn.proj
    attention core         the rest of blocks.*.attn: rotary, gathers, SDPA; split into the
                           full-attention blocks and the windowed ones
    MLP, norms, merger     blocks.*.mlp, blocks.*.norm1/2, merger
    other                  the call's time outside those: window order, rotary table, ...
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

TOP_OPS = 8


def part_of(name: str, full_blocks: set[int]) -> str | None:
    """The part a tower module's time counts to (None: not timed on its own)."""
    if name == "patch_embed.proj":
        return "patch embed"
    if name == "merger":
        return "merger"
    bits = name.split(".", 2)
    if len(bits) < 3 or bits[0] != "blocks" or not bits[1].isdigit():
        return None
    kind = "full" if int(bits[1]) in full_blocks else "windows"
    return {"attn.qkv": "attention qkv linear", "attn.proj": "attention out linear",
            "attn": f"attention core ({kind})", "mlp": "MLP", "norm1": "norms", "norm2": "norms"}.get(bits[2])


def parts_ms(spent_s: dict[str, float], total_s: float, full_blocks: set[int]) -> dict[str, float]:
    """Module times (s, by name) -> ms by part; an attention's linears leave its core, and what
    no part holds is "other"."""
    out: dict[str, float] = defaultdict(float)
    for name, seconds in spent_s.items():
        part = part_of(name, full_blocks)
        out[part] += 1e3 * seconds
        if part in ("attention qkv linear", "attention out linear"):
            out[part_of(name.rsplit(".", 1)[0], full_blocks)] -= 1e3 * seconds
    out["other"] = 1e3 * total_s - sum(out.values())
    out["total"] = 1e3 * total_s
    return dict(out)


def encoder_profile(visual, run: Callable[[], object], full_blocks: set[int]) -> dict:
    """{"parts": ms by part, "ops": the top ops' self CPU ms, "op_calls"} of one `run()` of
    `visual`. Our layers skip nn.Module's hook dispatch (engine.layers.Layer: their class's
    __call__ is forward), so the timing wraps the __call__ of each timed module's class."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    names = {id(m): name for name, m in visual.named_modules() if part_of(name, full_blocks) is not None}
    spent: dict[str, float] = defaultdict(float)
    classes = {type(m) for name, m in visual.named_modules() if id(m) in names}
    saved = {cls: cls.__dict__.get("__call__") for cls in classes}
    for cls in classes:
        cls.__call__ = _timing(cls.__call__, names, spent)
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
    finally:
        for cls, call in saved.items():
            if call is None:
                del cls.__call__
            else:
                cls.__call__ = call
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    return {"parts": parts_ms(spent, total, full_blocks),
            "ops": {e.key: round(e.self_cpu_time_total / 1e3, 1) for e in ops},
            "op_calls": {e.key: e.count for e in ops}}


def _timing(call: Callable, names: dict[int, str], spent: dict[str, float]) -> Callable:
    """`call` (a class's __call__), adding each named module's seconds to spent[name]."""
    def timed(module, *args, **kwargs):
        name = names.get(id(module))
        if name is None:
            return call(module, *args, **kwargs)
        start = time.perf_counter()
        out = call(module, *args, **kwargs)
        spent[name] += time.perf_counter() - start
        return out
    return timed
