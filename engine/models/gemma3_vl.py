"""Gemma 3 4B+ (HF's Gemma3ForConditionalGeneration): the Gemma 3 language model of
engine/models/gemma3.py, a SigLIP vision encoder, and the projector between them.

    pixels [B, 3, S, S]                    every image resized to the config's S (image_size)
      -> patches [B, P, 3*p*p]             P = (S/p)^2; the stride-p conv as one matmul
      -> + learned position embeddings     [P, D], one per patch
      -> encoder layers                    pre-LayerNorm, bidirectional attention, GELU MLP
      -> post_layernorm                    [B, P, D]
      -> projector                         average pool to mm_tokens_per_image (a square grid),
                                           Gemma's RMSNorm, a matmul to the text hidden size
      -> [B, mm_tokens_per_image, hidden]  one row per <image_soft_token> of the prompt

The language model takes them at the step's image rows (`ctx.mm`, Gemma3Model's forward),
after its token embeddings are scaled: the image rows are not scaled (as HF). The vision
weights stay in the model's dtype (never quantized) and are whole on every tensor-parallel
rank; `linear_sources` lists the language model's layers only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import GemmaRMSNorm
from engine.layers.parallel import SINGLE, TPShard
from engine.layers.quantized import QuantizedTensor
from engine.models.config import ModelArchConfig
from engine.models.gemma3 import Gemma3ForCausalLM

# Checkpoint prefixes -> ours: transformers 5 modules (model.language_model...) and the Hub
# layout that transformers still saves (language_model.model..., vision_tower.vision_model...).
_RENAMES = (
    ("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION = ("vision_tower.", "multi_modal_projector.")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


class PatchEmbedding(nn.Module):
    """SigLIP's stride-p conv over non-overlapping patches, as a matmul (weight kept in the
    conv's checkpoint shape [D, C, p, p])."""

    def __init__(self, channels: int, hidden: int, patch: int) -> None:
        super().__init__()
        self.patch = patch
        self.weight = nn.Parameter(torch.empty(hidden, channels, patch, patch))
        self.bias = nn.Parameter(torch.empty(hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, S, S] -> [B, (S/p)^2, D], patches in row-major order as the conv's output."""
        b, c, h, w = pixels.shape
        p = self.patch
        patches = pixels.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return F.linear(patches.reshape(b, (h // p) * (w // p), c * p * p), self.weight.flatten(1), self.bias)


class SiglipEmbeddings(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.patch_embedding = PatchEmbedding(v["num_channels"], v["hidden_size"], v["patch_size"])
        self.position_embedding = nn.Embedding((v["image_size"] // v["patch_size"]) ** 2, v["hidden_size"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixels) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    """Every patch attends to every patch of its image (q, k, v fused into one matmul)."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.num_heads, hidden = v["num_heads"], v["hidden_size"]
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [B, H, P, d], scale head_dim**-0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.approximate = "tanh" if v["gelu_tanh"] else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.self_attn = SiglipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.mlp = SiglipMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(v) for _ in range(v["num_layers"]))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision model without its pooling head (Gemma 3 has none): [B, C, S, S] -> [B, P, D]."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(v)
        self.encoder = SiglipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    """[B, P, D] patch features -> [B, mm_tokens_per_image, hidden]: average pooling of the
    patch grid down to a tokens_per_side^2 grid, RMSNorm, a projection (stored [D, hidden])."""

    def __init__(self, v: dict, text_hidden: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v["hidden_size"], text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(v["hidden_size"], v["layer_norm_eps"])
        self.patches_per_side = v["image_size"] // v["patch_size"]
        self.kernel = self.patches_per_side // int(v["mm_tokens_per_image"] ** 0.5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        b, _, d = features.shape
        grid = features.transpose(1, 2).reshape(b, d, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma3ForCausalLM (its `model`, `lm_head`, forward and logits) plus `vision_tower` and
    `multi_modal_projector`, with `embed_images` (engine/models/multimodal.py)."""

    # An image's tokens attend to each other both ways (HF's token_type_ids mask, every
    # Gemma3ForConditionalGeneration): the engine prefills each image's tokens in one chunk.
    bidirectional_images = True

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, max_positions, shard)
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg.vision, cfg.hidden_size)
        self.image_token_id = cfg.vision["image_token_id"]
        self.tokens_per_image = cfg.vision["mm_tokens_per_image"]

    def num_image_tokens(self, shape: tuple[int, ...], grid: tuple[int, int, int] | None) -> int:
        size = self.config.vision["image_size"]
        if tuple(shape) != (self.config.vision["num_channels"], size, size) or grid is not None:
            raise ValueError(f"gemma3: an image's pixels are [3, {size}, {size}] with no grid, got {list(shape)}")
        return self.tokens_per_image

    @staticmethod
    def linear_sources(cfg: ModelArchConfig) -> dict[str, list[str]]:
        """The language model's layers, from the checkpoint names of the Hub layout (the one
        transformers saves)."""
        sources = Gemma3ForCausalLM.linear_sources(cfg)
        return {layer: [name.replace("model.", "language_model.model.", 1) if name.startswith("model.")
                        else f"language_model.{name}" for name in names] for layer, names in sources.items()}

    @torch.no_grad()
    def embed_images(self, pixels: list[torch.Tensor], grids: list | None = None) -> list[torch.Tensor]:
        """Each image's [mm_tokens_per_image, hidden] embeddings, all images in one encoder
        pass. `pixels`: [3, S, S] each, as Gemma 3's image processor makes them; `grids`
        are unused (every image is one S x S square)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        size = self.config.vision["image_size"]
        for image in pixels:
            if tuple(image.shape) != (self.config.vision["num_channels"], size, size):
                raise ValueError(f"gemma3: an image's pixels are {tuple(image.shape)}, not [3, {size}, {size}]")
        batch = torch.stack([image.to(weight.device, weight.dtype) for image in pixels])
        return list(self.multi_modal_projector(self.vision_tower(batch)).unbind(0))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """The language model's tensors through Gemma3ForCausalLM's loading, the vision
        tower's and projector's copied as they stream past (q/k/v stacked). Raises if any
        parameter is left unloaded."""
        params = {n: p for n, p in self.named_parameters() if n.startswith(_VISION)}
        loaded: set[str] = set()

        def language():
            for name, tensor in weights:
                name = _our_name(name)
                if name.startswith(_VISION):
                    _load_vision(params, name, tensor, loaded)
                else:
                    yield name, tensor

        super().load_weights(language())
        wanted = [f"{n}#{i}" if ".qkv_proj." in n else n for n in params for i in range(3 if ".qkv_proj." in n else 1)]
        missing = [w for w in wanted if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} vision tensor(s), e.g. {missing[:3]}")

    def _check_all_loaded(self, names: list[str], loaded: set[str]) -> None:
        """The language model's part (load_weights checks the vision side itself)."""
        super()._check_all_loaded([n for n in names if not n.startswith(_VISION)], loaded)


def _our_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def _load_vision(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | QuantizedTensor,
                 loaded: set[str]) -> None:
    if name.startswith("vision_tower.head."):
        return  # SigLIP's pooling head (vision_use_head): Gemma 3 reads the patches, not it
    if isinstance(tensor, QuantizedTensor):
        tensor = tensor.dequantize()
    stem, _, kind = name.rpartition(".")
    stem, _, proj = stem.rpartition(".")
    key = name
    if proj in _QKV:
        key = f"{stem}.qkv_proj.{kind}"
    if key not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in gemma3's vision side")
    target = params[key].data
    if proj in _QKV:
        target = target.narrow(0, _QKV[proj] * target.shape[0] // 3, target.shape[0] // 3)
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: shape mismatch: checkpoint {tuple(tensor.shape)} vs parameter {tuple(target.shape)}")
    target.copy_(tensor)
    loaded.add(key if proj not in _QKV else f"{key}#{_QKV[proj]}")
