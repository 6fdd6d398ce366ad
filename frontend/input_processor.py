"""Request input -> prompt token ids, checked once: the input side shared by gRPC, HTTP and
the offline `LLM` (vLLM v1's InputProcessor).

Every method raises `InvalidRequest` with a message a person can act on; each API maps that
to its own status once. Each API's own parameters become `SamplingParams` in that API's
module (`common/ipc.py` for the proto, `frontend/http/params.py` for OpenAI and Anthropic),
through `sampling_params`, which gives an unset field the model's default (its generation
config); `SamplingParams` validates them.

A request names its LoRA adapter once, here: HTTP's `model` (`resolve_model`: a served name of
the base model, or an adapter's name, as in vLLM) and gRPC's / the offline API's `lora_name`
(`check_lora`: "" or an adapter's name). An unknown one raises `NotFound` (HTTP 404, gRPC
NOT_FOUND).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping

from common.errors import InvalidRequest
from common.multimodal import ImageInput
from common.sampling_defaults import NO_DEFAULTS, sampling_params
from common.sampling_params import SamplingParams
from common.structured_output import get_backend_class
from common.structured_output.params import StructuredOutputsParams
from common.validation import PromptLimits, check_prompt
from frontend.harmony import prompt as harmony_prompt
from frontend.multimodal import DEFAULT_MAX_IMAGES
from frontend.multimodal.parts import count_images
from frontend.multimodal.processor import MultiModalProcessor
from frontend.tool_calls.prompt import chat_with_tools
from frontend.tool_calls.tools import ToolUse

MAX_PROMPT_CHARS = 4_000_000  # refuse before tokenizing absurd inputs
MAX_CHAT_MESSAGES = 1024
MAX_REMEMBERED_CONSTRAINTS = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class NotFound(InvalidRequest):
    """The request names a model or LoRA adapter the server does not have (HTTP 404, gRPC
    NOT_FOUND). An InvalidRequest, so code that knows only that still refuses it as bad."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the field that named it


class InputProcessor:
    def __init__(self, tokenizer, limits: PromptLimits,
                 lora_names: Callable[[], Collection[str]] = tuple,
                 sampling_defaults: Mapping[str, float | int] = NO_DEFAULTS, harmony=None,
                 multimodal: MultiModalProcessor | None = None, max_images: int = DEFAULT_MAX_IMAGES) -> None:
        self.tokenizer = tokenizer
        # A vision-language model's image side (frontend/multimodal); None: text only.
        self.multimodal = multimodal
        self.max_images = max_images  # per prompt: --limit-mm-per-prompt image=N
        # openai-harmony's encoding where the model speaks harmony (gpt-oss: frontend/harmony):
        # chat prompts are rendered by it, not by the chat template.
        self.harmony = harmony
        self.limits = limits
        # The model's generation config, for the fields a request leaves unset (common/sampling_defaults.py).
        self.sampling_defaults = sampling_defaults
        self.lora_names = lora_names  # the adapters loaded now (they change at run time)
        self.grammar_backend = get_backend_class("llguidance")
        self._valid_constraints: dict[str, None] = {}  # validated keys, oldest first

    def resolve_model(self, model: str | None, base_names: Collection[str]) -> str:
        """HTTP's `model`: the LoRA adapter it names, "" for the base model (any of its served
        names, or none given)."""
        if model is None or model in base_names:
            return ""
        if model in self.lora_names():
            return model
        raise NotFound(f"The model `{model}` does not exist; GET /v1/models lists the models served here", "model")

    def check_lora(self, name: str, field: str = "lora_name") -> str:
        """gRPC's and the offline API's adapter name: "" (the base model) or a loaded adapter."""
        if name and name not in self.lora_names():
            raise NotFound(f"{field}: the LoRA adapter `{name}` does not exist; Info.GetModelInfo "
                           "lists the adapters loaded here", field)
        return name

    def sampling_params(self, **fields: object) -> SamplingParams:
        """SamplingParams of an API's fields, None meaning unset: common/sampling_defaults.py."""
        return sampling_params(self.sampling_defaults, **fields)

    def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "text") -> list[int]:
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"{field}: must be a non-empty string")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"{field}: {len(text)} characters is more than the {MAX_PROMPT_CHARS} allowed")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, field: str = "messages") -> str:
        """The prompt text of a conversation, through the model's chat template."""
        self._check_messages(messages, field)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest(f"{field}: this model has no chat template; send a plain prompt")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both be true")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message: the last message must be the assistant's")
        try:
            # tokenize=False: transformers' tokenizers (the offline LLM's) return ids otherwise.
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the template itself rejects the conversation
            raise InvalidRequest(f"{field}: the model's chat template rejected it: {e}") from None

    def chat_with_tools(self, messages: list[dict], tool_use: ToolUse | None) -> tuple[list[dict], list[dict] | None]:
        """The messages and the `tools` argument of tokenize_chat for a request with these
        tools (frontend/tool_calls/prompt.py; harmony shows the tools itself, unless the
        choice is none)."""
        if self.harmony is None:
            return chat_with_tools(self.tokenizer.chat_template, messages, tool_use)
        shown = tool_use is not None and tool_use.choice.mode != "none"
        return messages, [t.template_entry() for t in tool_use.tools] if shown else None

    def chat_prompt(self, messages: list[dict], **kwargs) -> tuple[list[int], list[ImageInput]]:
        """`tokenize_chat` of messages that may hold images (a content list with
        {"type": "image", "image": PIL image} parts, frontend/multimodal/parts.py): the prompt's
        ids, each image's placeholder expanded, and its images as the engine takes them."""
        field = kwargs.get("field", "messages")
        images = [p["image"] for m in messages if isinstance(m.get("content"), list)
                  for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]
        if not images:
            return self.tokenize_chat(messages, **kwargs), []
        self.check_images(len(images), field)
        shown = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
                 if isinstance(m.get("content"), list) else m for m in messages]
        return self.multimodal.prompt(self.render_chat(shown, **kwargs), images, field)

    async def chat_prompt_async(self, messages: list[dict], **kwargs) -> tuple[list[int], list[ImageInput]]:
        """`chat_prompt` on the event loop: with images, in a worker thread (preprocessing a
        1024x1024 image takes 0.1-0.2 s, which would hold every other stream meanwhile)."""
        if not count_images(messages):
            return self.chat_prompt(messages, **kwargs)
        return await asyncio.to_thread(self.chat_prompt, messages, **kwargs)

    def prompt_with_images(self, text: str, images: list, field: str = "prompt") -> tuple[list[int], list[ImageInput]]:
        """A plain prompt's ids with its images, one per image placeholder in the text (the
        offline `LLM.generate`'s multi_modal_data, as in vLLM)."""
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"{field}: must be a non-empty string")
        self.check_images(len(images), field)
        return self.multimodal.prompt(text, images, field, add_special_tokens=True)

    def check_images(self, count: int, field: str = "messages") -> None:
        """A prompt may have `count` images here: checked before any is fetched or decoded."""
        if count and (self.multimodal is None or self.harmony is not None):
            raise InvalidRequest(f"{field}: this model takes text only; it cannot read images")
        if count > self.max_images:
            raise InvalidRequest(f"{field}: {count} images is more than the {self.max_images} a prompt may "
                                 "have here (--limit-mm-per-prompt image=N)")

    def tokenize_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """The prompt's ids: the chat template's text, encoded (it holds BOS and friends
        already), or harmony's rendering."""
        if self.harmony is None:
            return self.tokenizer.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)
        field = kwargs.get("field", "messages")
        self._check_messages(messages, field)
        if kwargs.get("continue_final_message"):
            raise InvalidRequest("continue_final_message: a harmony prompt (gpt-oss) cannot continue the "
                                 "assistant's message; end the conversation with a user or tool message")
        effort = (kwargs.get("chat_template_kwargs") or {}).get("reasoning_effort")
        return harmony_prompt.render(self.harmony, messages, kwargs.get("tools"), effort,
                                     kwargs.get("add_generation_prompt", True), field)

    def check_token_ids(self, ids: list[int], field: str = "token_ids") -> list[int]:
        """For a list that is not a prompt (Detokenize)."""
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab})")
        return ids

    def check(self, prompt: list[int], params: SamplingParams, field: str = "prompt") -> None:
        """The one check of a prompt and its parameters against the model and the KV pool;
        tokenizes `bad_words` first (into params.bad_words_token_ids), so they are checked too."""
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        check_prompt(prompt, params, self.limits, field)
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenizing of bad_words: each word as it is (its leading spaces stripped), and
        with one leading space where that makes other tokens of the same count, so a word is
        banned both at the start of the text and after a space (tokenizers with and without
        add_prefix_space)."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Can the grammar library compile it? Checked without the vocabulary, in about a
        millisecond; remembered, as clients send the same schema again and again."""
        if constraint.key in self._valid_constraints:
            return
        self.grammar_backend.validate(constraint)
        self._valid_constraints[constraint.key] = None
        if len(self._valid_constraints) > MAX_REMEMBERED_CONSTRAINTS:
            del self._valid_constraints[next(iter(self._valid_constraints))]

    def max_tokens_left(self, prompt: list[int]) -> int:
        """What the context leaves for output: the default when a request sets no limit."""
        return max(1, self.limits.max_model_len - len(prompt))

    @staticmethod
    def _check_messages(messages: list[dict], field: str) -> None:
        if not messages:
            raise InvalidRequest(f"{field}: needs at least one message")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequest(f"{field}: at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"{field}[{i}].role: {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}")
            content = m.get("content")
            if not isinstance(content, str) and not (isinstance(content, list) and all(
                    isinstance(p, dict) and (p.get("type") == "image" or isinstance(p.get("text"), str))
                    for p in content)):
                raise InvalidRequest(f"{field}[{i}].content: must be text, or text and image parts")
        if sum(_num_chars(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"{field}: more than {MAX_PROMPT_CHARS} characters in all")


def _num_chars(content: str | list[dict]) -> int:
    return len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
