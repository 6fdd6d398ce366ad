"""Tiny random-weight vision-language models for tests, saved as HF folders (weights, tokenizer,
chat template, image processor config), and HF's own model of each as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2.5-VL-*-Instruct's chat_template.json: an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to one pad per token.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Few patches per test image: 56x56 to 224x224 pixels, i.e. 4x4 to 16x16 patches of 14.
QWEN_VL_PREPROCESSOR = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 56 * 56,
                        "max_pixels": 28 * 28 * 64}


def _qwen_vl_tokenizer(folder: Path, tokenizer, chat_template: str) -> tuple:
    """A copy of `tokenizer` (the caller's may be shared) with Qwen's vision tokens and
    `chat_template`, saved into `folder`: (it, the vision tokens' ids by name, the config's
    bos/eos/pad ids)."""
    from transformers import AutoTokenizer
    tokenizer.save_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(list(QWEN_VL_TOKENS), special_tokens=True)
    tok.chat_template = chat_template
    tok.save_pretrained(str(folder))
    ids = dict(zip(QWEN_VL_TOKENS, tok.convert_tokens_to_ids(list(QWEN_VL_TOKENS))))
    return tok, ids, {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                      "pad_token_id": tok.pad_token_id}


def build_tiny_qwen2_5_vl(folder: Path, tokenizer) -> Path:
    """Save a random-weight Qwen2.5-VL (float32) into `folder`: a 2-layer language model (hidden
    64, 4 heads, 2 KV heads, head_dim 16, mrope_section [2, 3, 3]) and a 2-block vision tower
    (hidden 32, 2 heads, full attention in block 1 only, 56-pixel windows: 2x2 merged tokens).
    `tokenizer` (not changed) gains Qwen's vision tokens and chat template. transformers 5.24's
    save_pretrained writes the Hub's tensor names (`visual.*`, `model.*`, `lm_head.weight`)."""
    import transformers
    folder = Path(folder)
    tok, ids, token_ids = _qwen_vl_tokenizer(folder, tokenizer, QWEN2_5_VL_CHAT_TEMPLATE)
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": -(-len(tok) // 64) * 64, "max_position_embeddings": 2048,
            "initializer_range": 0.2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]}, **token_ids}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [1], "initializer_range": 0.2}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                              **token_ids)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # HF starts norm weights at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    _processor_class()(**QWEN_VL_PREPROCESSOR).save_pretrained(str(folder))
    return folder


def hf_qwen2_5_vl(folder: Path):
    """HF's Qwen2_5_VLForConditionalGeneration from `folder`, float32, eval."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


def qwen_vl_image_processor(folder: Path):
    """transformers' own (PIL) image processor, as `folder`'s preprocessor_config.json sets it."""
    return _processor_class().from_dict(json.loads((Path(folder) / "preprocessor_config.json").read_text()))


def _processor_class() -> type:
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil_processing
    return pil_processing.Qwen2VLImageProcessorPil


def to_module_layout(folder: Path, target: Path) -> Path:
    """`folder` rewritten with the tensor names of transformers' module tree since 4.52
    (`model.visual.*`, `model.language_model.*`: its state_dict, as checkpoints saved by some
    versions and tools hold them), its other files copied."""
    import shutil

    from safetensors.torch import load_file, save_file
    target.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, target / path.name)

    def renamed(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
    for path in folder.glob("*.safetensors"):
        tensors = {renamed(name): t for name, t in load_file(str(path)).items()}
        save_file(tensors, str(target / path.name), metadata={"format": "pt"})
    return target


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [picture(84, 56, 0), picture(56, 150, 1), picture(200, 130, 2)]


def conversation(text: str, images: list[Image.Image]) -> list[dict]:
    if not images:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# Qwen3-VL-*-Instruct's chat_template.json, as shipped: unlike Qwen2.5-VL's, no default system
# prompt; an image part renders as <|vision_start|><|image_pad|><|vision_end|> all the same.
QWEN3_VL_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3-VL's preprocessor_config.json (16-pixel patches, mean and std 0.5) with few pixels: an
# image is resized to 64x64 .. 256x256 pixels, i.e. 4 to 64 tokens of 32x32 pixels.
QWEN3_VL_PREPROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                         "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256},
                         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def build_tiny_qwen3_vl(folder: Path, tokenizer) -> Path:
    """Save a random-weight Qwen3-VL (float32) into `folder`: a 3-layer language model (hidden
    64, 4 heads of 32 (wider than hidden / heads), 2 KV heads, interleaved M-RoPE section
    [6, 5, 5]) and a 3-block vision tower (hidden 32, 2 heads, 16-pixel patches, an 8x8
    learned position table) whose blocks 0 and 1 feed DeepStack (added after decoder layers 0
    and 1). `tokenizer` (not changed) gains Qwen's vision tokens and Qwen3-VL's chat template.
    transformers 5.24's save_pretrained writes its module tree's tensor names
    (`model.visual.*`, `model.language_model.*`, `lm_head.weight`), as the Hub's Qwen3-VL."""
    import transformers
    folder = Path(folder)
    tok, ids, token_ids = _qwen_vl_tokenizer(folder, tokenizer, QWEN3_VL_CHAT_TEMPLATE)
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": -(-len(tok) // 64) * 64,
            "max_position_embeddings": 2048, "initializer_range": 0.2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                "mrope_interleaved": True}, **token_ids}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0, 1], "initializer_range": 0.2}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                        vision_start_token_id=ids["<|vision_start|>"],
                                        vision_end_token_id=ids["<|vision_end|>"], **token_ids)
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # HF starts norm weights at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    _processor_class()(**QWEN3_VL_PREPROCESSOR).save_pretrained(str(folder))
    return folder


def hf_qwen3_vl(folder: Path):
    """HF's Qwen3VLForConditionalGeneration from `folder`, float32, eval."""
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


# -- HF's side of the comparisons --------------------------------------------------------------

_HF_PROCESSORS = {  # model_type -> (transformers processor, its PIL image processor's module, class)
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "qwen3_vl": ("Qwen3VLProcessor", "qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "gemma3": ("Gemma3Processor", "gemma3.image_processing_pil_gemma3", "Gemma3ImageProcessorPil"),
}


def hf_processor(folder: Path):
    """transformers' own processor of the folder's family over its PIL image processor, as the
    folder configures them. Its constructor checks each part's class, the video processor's
    too, which needs torchvision (not installed, and no video here): that check is skipped."""
    import importlib
    from unittest import mock

    import transformers
    from transformers import AutoTokenizer, ProcessorMixin
    folder = Path(folder)
    processor, module, image_class = _HF_PROCESSORS[json.loads((folder / "config.json").read_text())["model_type"]]
    config = json.loads((folder / "preprocessor_config.json").read_text())
    images = getattr(importlib.import_module(f"transformers.models.{module}"), image_class).from_dict(config)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    extra = {"image_seq_length": images.image_seq_length} if processor == "Gemma3Processor" else {}
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return getattr(transformers, processor)(image_processor=images, tokenizer=tokenizer,
                                                chat_template=tokenizer.chat_template, **extra)


def hf_inputs(processor, messages: list[dict]):
    """The processor's model inputs for a conversation in LLM.chat's form (PIL images in parts)."""
    shown = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    text = processor.tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    return processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)


@torch.inference_mode()
def hf_greedy(model, inputs, max_new: int) -> tuple[list[int], list[dict]]:
    """HF generate's greedy tokens and top-5 logprobs per step (check_outputs_match's form)."""
    out = model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [dict(zip(*[t.tolist() for t in reversed(torch.log_softmax(step[0].float(), -1).topk(5))]))
                for step in out.logits]
    return tokens, logprobs
