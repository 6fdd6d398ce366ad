"""A HF checkpoint's `quantization_config` (config.json), parsed and checked before any weight
is read: GPTQ, AWQ (GEMM), compressed-tensors (llm-compressor's int4/int8/FP8), block FP8 and
MXFP4 (gpt-oss's experts: no linear layer is quantized; engine/models/gpt_oss.py reads them).

Each becomes one `HFQuantConfig` whose schemes say, per linear layer, how its weights (and
activations) are quantized, in compressed-tensors' terms; engine/models/hf_quant_weights.py
reads the tensors. Anything else is refused with one ValueError naming the method or variant
and what is supported (engine/models/source.py turns it into the CLI's one-line error).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus 1
SUPPORTED = ("gptq (4 or 8 bit, checkpoint_format gptq or gptq_v2), awq (4 bit, version gemm), "
             f"compressed-tensors ({', '.join(CT_FORMATS)}: int4/int8 weights, int8 dynamic per-token "
             "activations, FP8), fp8 (weight_block_size), mxfp4 (gpt-oss's experts)")


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor is quantized (compressed-tensors' QuantizationArgs, the fields we use)."""

    num_bits: int
    type: str = "int"  # int | float
    symmetric: bool = True  # False: a zero point per group
    strategy: str = "tensor"  # tensor | channel | group | block | token
    group_size: int | None = None  # group: values per scale along the input dimension
    block_structure: tuple[int, int] | None = None  # block: [rows, columns] per scale
    dynamic: bool = False  # activations: scales computed per call
    actorder: str | None = None  # group | weight: GPTQ's activation order (g_idx)


@dataclass(frozen=True)
class Scheme:
    """One config group: the layers it targets, their weights' and inputs' quantization."""

    targets: tuple[str, ...]  # "Linear" (every linear layer), "re:REGEX" or a module name
    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @property
    def int8_inputs(self) -> bool:
        return self.input_activations is not None and self.input_activations.type == "int"


@dataclass(frozen=True)
class HFQuantConfig:
    method: str  # gptq | awq | compressed-tensors | fp8 | mxfp4
    format: str  # gptq: gptq | gptq_v2; awq: gemm; compressed-tensors: CT_FORMATS; fp8: fp8
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...] = ()  # modules left in float (lm_head, a MoE router)

    @property
    def label(self) -> str:
        """What /v1/models and GetModelInfo report: gptq-int4, awq-int4, fp8,
        compressed-tensors-w4a16 (-w8a16, -w8a8, -fp8), mxfp4."""
        if self.method == "mxfp4":
            return "mxfp4"
        w = self.schemes[0].weights
        if self.method in ("gptq", "awq"):
            return f"{self.method}-int{w.num_bits}"
        if self.method == "fp8" or w.type == "float":
            return "fp8" if self.method == "fp8" else "compressed-tensors-fp8"
        return f"compressed-tensors-w{w.num_bits}a{8 if self.schemes[0].int8_inputs else 16}"

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of HF module `module` (e.g. model.layers.0.self_attn.q_proj); None: not
        quantized. Targets match as compressed-tensors matches them: "re:" a regex from the
        start of the name, else the name itself, "Linear" every linear layer."""
        if any(_matches(t, module) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_matches(t, module) for t in s.targets)), None)


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def read_quant_config(path: Path) -> HFQuantConfig | None:
    """The folder's quantization (None: float weights, or not a HF folder)."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return None
    return parse_quant_config(json.loads(config_file.read_text()))


def parse_quant_config(config: dict) -> HFQuantConfig | None:
    """config.json's quantization_config, checked against the model's layer widths; None
    without one. ValueError for anything the loader cannot run."""
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError("its config.json's quantization_config is not an object")
    named = q.get("quant_method") or q.get("method")  # GPTQModel 5+ writes `method`
    method = str(named or "").lower().replace("_", "-")
    parse = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
             "mxfp4": _mxfp4}.get(method)
    if parse is None:
        raise ValueError(f"quantization_config: quant_method {named!r} is not supported (supported: {SUPPORTED})")
    try:
        parsed = parse(q)
        for scheme in parsed.schemes:
            _check_groups(method, scheme.weights, config)
    except (TypeError, AttributeError, KeyError) as e:  # a field of the wrong type
        raise ValueError(f"quantization_config: a malformed {method} config ({type(e).__name__}: {e})") from None
    return parsed


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config: {method} with {what} is not supported (supported: {SUPPORTED})")


def _group_args(bits: int, group_size: int, symmetric: bool, actorder: str | None = None) -> QuantArgs:
    if group_size == -1:  # one scale per output channel: a group as wide as the input
        return QuantArgs(bits, symmetric=symmetric, strategy="channel")
    return QuantArgs(bits, symmetric=symmetric, strategy="group", group_size=group_size, actorder=actorder)


def _gptq(q: dict) -> HFQuantConfig:
    bits = q.get("bits")
    fmt = "marlin" if q.get("is_marlin_format") else q.get("checkpoint_format") or q.get("format") or "gptq"
    if bits not in (4, 8):
        raise _refuse("gptq", f"bits {bits}")
    if fmt not in GPTQ_FORMATS:  # marlin, bitblas: repacked for one GPU kernel
        raise _refuse("gptq", f"checkpoint_format {fmt!r}")
    if str(q.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":  # GPTQModel may pack into others
        raise _refuse("gptq", f"pack_dtype {q['pack_dtype']!r}")
    sym = bool(q.get("sym", True))
    if bits == 8 and not sym:  # int8 blocks have no zero point; symmetric's is 128 (q - 128 fits)
        raise _refuse("gptq", "8 bits and sym false")
    args = _group_args(bits, int(q.get("group_size", 128)), sym, "group" if q.get("desc_act") else None)
    ignore = () if q.get("lm_head") else ("lm_head",)
    return HFQuantConfig("gptq", fmt, (Scheme(("Linear",), args),), ignore)


def _awq(q: dict) -> HFQuantConfig:
    bits, version = q.get("bits", q.get("w_bit")), str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse("awq", f"bits {bits}")
    if version != "gemm":  # gemv, gemv_fast, marlin, exllama: other layouts
        raise _refuse("awq", f"version {version!r}")
    if not q.get("zero_point", True):
        raise _refuse("awq", "zero_point false")
    args = _group_args(4, int(q.get("group_size", q.get("q_group_size", 128))), False)
    ignore = ("lm_head", *(q.get("modules_to_not_convert") or ()))
    return HFQuantConfig("awq", "gemm", (Scheme(("Linear",), args),), tuple(ignore))


def _fp8(q: dict) -> HFQuantConfig:
    """transformers' FineGrainedFP8 (DeepSeek-V3, Qwen3-FP8): e4m3 weights, a float32
    `weight_scale_inv` per block of weight_block_size."""
    block = q.get("weight_block_size")
    if block is None or len(block) != 2:
        raise _refuse("fp8", f"weight_block_size {block!r} (want [rows, columns])")
    args = QuantArgs(8, type="float", strategy="block", block_structure=(int(block[0]), int(block[1])))
    inputs = QuantArgs(8, type="float", strategy="token", dynamic=q.get("activation_scheme", "dynamic") == "dynamic")
    ignore = tuple(q.get("modules_to_not_convert") or ())
    return HFQuantConfig("fp8", "fp8", (Scheme(("Linear",), args, inputs),), ignore)


def _mxfp4(q: dict) -> HFQuantConfig:
    """gpt-oss's MXFP4: the MoE experts' `*_blocks` and `*_scales` (cpu_kernels/mxfp4_format.py);
    every linear layer (modules_to_not_convert: attention, router, embedding, head) in float."""
    return HFQuantConfig("mxfp4", "mxfp4", (), tuple(q.get("modules_to_not_convert") or ()))


def _compressed_tensors(q: dict) -> HFQuantConfig:
    fmt = q.get("format")
    if fmt not in CT_FORMATS:  # dense, marlin-24, sparse-*, nvfp4/mxfp4-pack-quantized, mixed-precision
        raise _refuse("compressed-tensors", f"format {fmt!r}")
    for key in ("kv_cache_scheme", "transform_config"):
        if q.get(key):
            raise _refuse("compressed-tensors", key)
    if (q.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise _refuse("compressed-tensors", f"sparsity format {q['sparsity_config']['format']!r}")
    groups = q.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors", "no config_groups")
    schemes = tuple(_ct_scheme(name, group, fmt) for name, group in groups.items())
    return HFQuantConfig("compressed-tensors", fmt, schemes, tuple(q.get("ignore") or ()))


def _ct_scheme(name: str, group: dict, fmt: str) -> Scheme:
    what = f"config group {name!r}"
    if group.get("output_activations"):
        raise _refuse("compressed-tensors", f"output activations ({what})")
    if group.get("format") not in (None, fmt):
        raise _refuse("compressed-tensors", f"format {group['format']!r} in {what} beside {fmt!r}")
    weights = _ct_args(group.get("weights") or {})
    inputs = None if group.get("input_activations") is None else _ct_args(group["input_activations"])
    if weights.type == "int":
        if weights.num_bits not in (4, 8) or weights.strategy not in ("tensor", "channel", "group"):
            raise _refuse("compressed-tensors", f"int{weights.num_bits} weights by {weights.strategy} ({what})")
        if weights.num_bits == 8 and not weights.symmetric:
            raise _refuse("compressed-tensors", f"asymmetric int8 weights ({what}: int8 blocks have no zero point)")
        if not weights.symmetric and weights.strategy == "tensor":
            raise _refuse("compressed-tensors", f"an asymmetric per-tensor weight ({what})")
        if inputs is not None and not _w8a8(weights, inputs):
            raise _refuse("compressed-tensors", f"int{weights.num_bits} weights with {inputs.type}{inputs.num_bits} "
                          f"{'dynamic' if inputs.dynamic else 'static'} {inputs.strategy} activations ({what}); "
                          "int activations: int8, symmetric, dynamic, per token, with per-channel int8 weights")
    elif weights.num_bits != 8 or weights.strategy not in ("tensor", "channel", "block"):
        raise _refuse("compressed-tensors", f"float{weights.num_bits} weights by {weights.strategy} ({what})")
    elif inputs is not None and inputs.type != "float":
        raise _refuse("compressed-tensors", f"FP8 weights with {inputs.type} activations ({what})")
    return Scheme(tuple(group.get("targets") or ("Linear",)), weights, inputs)


def _w8a8(weights: QuantArgs, inputs: QuantArgs) -> bool:
    return (inputs.type == "int" and inputs.num_bits == 8 and inputs.symmetric and bool(inputs.dynamic)
            and inputs.strategy in ("token", "tensor") and weights.num_bits == 8
            and weights.strategy in ("channel", "tensor"))


def _ct_args(a: dict) -> QuantArgs:
    """compressed-tensors' QuantizationArgs, its defaults and strategy inference."""
    group_size, strategy = a.get("group_size"), str(a.get("strategy") or "").lower()
    if not strategy:
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    actorder = a.get("actorder")
    if isinstance(actorder, bool):
        actorder = "group" if actorder else None
    block = a.get("block_structure")
    if isinstance(block, str):  # the old "128x128" spelling
        block = [int(v) for v in block.split("x")]
    return QuantArgs(int(a.get("num_bits", 8)), str(a.get("type", "int")).lower(), bool(a.get("symmetric", True)),
                     strategy, group_size if strategy == "group" else None,
                     tuple(block) if block else None, a.get("dynamic") is True,
                     {"dynamic": "group", "static": "weight"}.get(actorder, actorder))


def _check_groups(method: str, w: QuantArgs, config: dict) -> None:
    """Groups must cover whole blocks of 32 and divide every quantized layer's input width
    (hidden, attention, MLP and expert widths from config.json), before any weight is read."""
    if w.strategy != "group":
        return
    g = w.group_size
    if not g or g % 32:
        raise _refuse(method, f"group_size {g} (groups must be -1 or a multiple of 32)")
    text = config.get("text_config") or config
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    widths = {"hidden_size": hidden, "intermediate_size": text.get("intermediate_size"),
              "moe_intermediate_size": text.get("moe_intermediate_size"),
              "attention width": heads * (text.get("head_dim") or hidden // heads) if heads and hidden else None}
    for name, width in widths.items():
        if isinstance(width, int) and width % g:
            raise ValueError(f"quantization_config: group_size {g} does not divide the model's {name} {width}, "
                             "the input width of its layers (a broken or mislabelled checkpoint)")


# -- The tensors (safetensors headers only: no torch, no weights read) ----------------

# method -> (the scale tensor every quantized module has, its other tensors)
PARTS = {
    "gptq": ("scales", ("qweight", "qzeros", "g_idx")),
    "awq": ("scales", ("qweight", "qzeros")),
    "compressed-tensors": ("weight_scale", ("weight_packed", "weight", "weight_zero_point", "weight_g_idx",
                                            "weight_shape", "input_scale", "input_zero_point")),
    "fp8": ("weight_scale_inv", ("weight", "input_scale")),
}
_QUANTIZED_DTYPES = ("I8", "I32", "F8_E4M3")  # a `weight` of these is stored quantized


def read_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype ("I32", "F16", ...) of every *.safetensors file in
    `path`, from their JSON headers (8 bytes of length, then the header)."""
    dtypes = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(size))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{file.name} is not a safetensors file ({e})") from None
        dtypes.update((name, info["dtype"]) for name, info in header.items() if name != "__metadata__")
    return dtypes


def quantized_modules(dtypes: dict[str, str], q: HFQuantConfig) -> dict[str, QuantArgs]:
    """Module name -> its weights' quantization, for every module stored quantized (one with
    its method's scale tensor); a ValueError naming the first whose tensors are incomplete.
    MXFP4 quantizes no linear layer: its expert tensors come in pairs, checked here."""
    if q.method == "mxfp4":
        _check_mxfp4_pairs(dtypes)
        return {}
    scale = PARTS[q.method][0]
    modules = {name.rpartition(".")[0] for name in dtypes if name.endswith(f".{scale}")}
    for name, dtype in dtypes.items():  # quantized values whose scale is missing
        prefix, _, part = name.rpartition(".")
        stored = part in ("qweight", "weight_packed") or (part == "weight" and dtype in _QUANTIZED_DTYPES)
        if stored and prefix not in modules:
            raise ValueError(f"{q.method} checkpoint tensor {name!r} has no {prefix}.{scale} beside it")
    out = {}
    for module in sorted(modules):
        scheme = q.scheme_for(module)
        if scheme is None:
            raise ValueError(f"{q.method}: {module} is stored quantized, but quantization_config leaves it "
                             "unquantized (its ignore list or targets)")
        for part in _required(q, scheme.weights):
            if f"{module}.{part}" not in dtypes:
                raise ValueError(f"{q.method} checkpoint lacks {module}.{part} (next to {module}.{scale})")
        out[module] = scheme.weights
    return out


def _check_mxfp4_pairs(dtypes: dict[str, str]) -> None:
    for name in dtypes:
        for have, want in (("_blocks", "_scales"), ("_scales", "_blocks")):
            if name.endswith(have) and name.removesuffix(have) + want not in dtypes:
                raise ValueError(f"mxfp4 checkpoint tensor {name!r} has no {name.removesuffix(have) + want} beside it")


def _required(q: HFQuantConfig, w: QuantArgs) -> tuple[str, ...]:
    if q.method in ("gptq", "awq"):
        return ("qweight", "qzeros")
    if q.method == "fp8":
        return ("weight",)
    values = "weight_packed" if q.format == "pack-quantized" else "weight"
    return (values,) if w.symmetric else (values, "weight_zero_point")


def check_tensors(path: Path, q: HFQuantConfig) -> None:
    """Every quantized module of the folder has its tensors."""
    quantized_modules(read_dtypes(path), q)
