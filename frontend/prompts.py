"""Turning a request's input (text, token ids or chat) into prompt token ids."""

from __future__ import annotations

MAX_PROMPT_CHARS = 4_000_000  # refuse before tokenizing absurd inputs
MAX_CHAT_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class Prompts:
    """Wraps the tokenizer; every method raises ValueError with an actionable message."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def from_request(self, msg, add_special_tokens: bool = True) -> list[int]:
        """`msg` has a oneof `input` of text / token_ids / chat (GenerateRequest, TokenizeRequest)."""
        kind = msg.WhichOneof("input")
        if kind is None:
            raise ValueError("input: give one of text, token_ids or chat")
        if kind == "text":
            return self.encode_text(msg.text, add_special_tokens)
        if kind == "chat":
            return self.encode_chat(msg.chat)
        return self.check_ids(list(msg.token_ids.ids), "token_ids")

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise ValueError("text: must not be empty")
        if len(text) > MAX_PROMPT_CHARS:
            raise ValueError(f"text: {len(text)} characters is more than the {MAX_PROMPT_CHARS} allowed")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, chat) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        if not messages:
            raise ValueError("chat: needs at least one message")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise ValueError(f"chat: at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"chat.messages[{i}].role: {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise ValueError(f"chat: more than {MAX_PROMPT_CHARS} characters in all")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat: this model has no chat template; send text or token_ids")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template itself rejects the conversation
            raise ValueError(f"chat: the model's chat template rejected it: {e}") from None
        # The template already holds BOS and friends.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids
