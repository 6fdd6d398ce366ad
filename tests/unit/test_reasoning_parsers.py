"""The reasoning parsers (frontend/reasoning): whole texts, and the same texts streamed in every
split, which must give the same reasoning and content; what a stream holds back; which parser a
chat template gets. Also the frontend's half of structured output after the reasoning
(params.after_reasoning), Anthropic's `thinking` mapping and the thinking blocks' shapes."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from common.ipc import structured_from_proto, structured_to_proto
from common.structured_output.params import StructuredOutputsParams
from common.validation import PromptLimits
from frontend.http.params import after_reasoning, anthropic_template_kwargs
from frontend.http.protocol import MessagesRequest
from frontend.http.sample_output import AnthropicBlocks, anthropic_blocks, openai_message
from frontend.input_processor import InputProcessor
from frontend.output_events import Content, Reasoning
from frontend.reasoning.parsers import NAMES, choose, end_tag, make_parser
from frontend.sample_parser import parse_sample
from frontend.tokenizer import Tokenizer

# text -> (reasoning, content) for qwen3 and for deepseek_r1
CASES = {
    "<think>\nLet me see.\n</think>\n\nParis.": (("Let me see.", "Paris."), ("Let me see.", "Paris.")),
    "<think>a</think>b": (("a", "b"), ("a", "b")),
    "  \n<think>\n\nhmm\n\n</think>\n\nok\n": (("hmm", "ok\n"), ("hmm", "ok\n")),
    "<think></think>answer": (("", "answer"), ("", "answer")),
    "<think>\n\n</think>\n\n": (("", ""), ("", "")),
    "<think>cut off in thought\n": (("cut off in thought\n", ""), ("cut off in thought\n", "")),
    "<think>a </thin": (("a </thin", ""), ("a </thin", "")),
    "<think>x < y and </b> </think> z": (("x < y and </b> ", " z"), ("x < y and </b> ", " z")),
    "<think>one</think>two</think>three": (("one", "two</think>three"), ("one", "two</think>three")),
    "Reasoning in the prompt's <think>\n</think>\n\nDone.": (
        ("", "Reasoning in the prompt's <think>\n</think>\n\nDone."), ("Reasoning in the prompt's <think>", "Done.")),
    "Plain answer.": (("", "Plain answer."), ("Plain answer.", "")),
    "\n\nPlain answer.": (("", "\n\nPlain answer."), ("Plain answer.", "")),
    "<thin": (("", "<thin"), ("<thin", "")),
    "": (("", ""), ("", "")),
}


def split(events) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert all(e.text for e in events), events  # no empty events
    return reasoning, content


def streamed(name: str, pieces: list[str]):
    parser = make_parser(name)
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", CASES)
def test_whole_and_streamed_at_every_boundary_split_alike(name, text):
    want = CASES[text][NAMES.index(name)]
    assert split(streamed(name, [text])) == want
    assert split(streamed(name, list(text))) == want  # a character at a time
    for i in range(len(text) + 1):
        assert split(streamed(name, [text[:i], text[i:]])) == want, i
    for i in range(len(text) + 1):  # and every three-way split that cuts a tag
        for j in range(i, min(i + 9, len(text) + 1)):
            assert split(streamed(name, [text[:i], text[i:j], text[j:]])) == want, (i, j)


def test_names():
    assert set(NAMES) == {"qwen3", "deepseek_r1"}
    assert end_tag("qwen3") == end_tag("deepseek_r1") == "</think>"


@pytest.mark.parametrize("name", NAMES)
def test_only_a_possible_tag_and_the_newlines_before_it_are_held_back(name):
    parser = make_parser(name)
    assert parser.feed("<thi") == []  # might be <think>
    assert parser.feed("nk>\nFirst") == [Reasoning("First")]
    assert parser.feed(" step.\n\n</th") == [Reasoning(" step.")]  # "\n\n</th" might end it
    assert parser.feed("ought, more") == [Reasoning("\n\n</thought, more")]  # it did not
    assert parser.feed("</think>\n") == []  # the answer's leading newlines go
    assert parser.feed("\nAnswer") == [Content("Answer")]
    assert parser.feed(" goes on</think>") == [Content(" goes on</think>")]  # no tag after the reasoning
    assert parser.finish() == []


def test_qwen3_streams_an_answer_that_opens_with_no_think_at_once():
    parser = make_parser("qwen3")
    assert parser.feed("\n") == []  # whitespace: a <think> may follow
    assert parser.feed("Hi") == [Content("\nHi")]


def test_deepseek_r1_streams_reasoning_from_the_first_character():
    parser = make_parser("deepseek_r1")
    assert parser.feed("Thinking") == [Reasoning("Thinking")]
    assert parser.feed(" on") == [Reasoning(" on")]
    assert parser.finish() == []


QWEN3 = """{%- for message in messages %}{%- if message.role == "assistant" %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
DEEPSEEK_R1 = ("{% for message in messages %}{% set content = message['content'].split('</think>')[-1] %}"
               "{{'<｜Assistant｜>' + content}}{% endfor %}"
               "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
QWEN3_THINKING_ONLY = QWEN3.replace("    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                                    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n",
                                    "    {{- \"<think>\\n\" }}\n")
QWEN35 = QWEN3.replace("    {%- endif %}\n{%- endif %}", "    {%- else %}\n        {{- '<think>\\n' }}\n"
                       "    {%- endif %}\n{%- endif %}")
MESSAGES = [{"role": "user", "content": "Hi"}]
CHATML = "{% for m in messages %}{{'<|im_start|>' + m.role + '\\n' + m.content}}{% endfor %}" \
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"


@pytest.mark.parametrize("template, name", [
    (QWEN3, "qwen3"), (DEEPSEEK_R1, "deepseek_r1"), (QWEN3_THINKING_ONLY, "deepseek_r1"),
    (QWEN35, None),  # thinking opened in the prompt unless enable_thinking is false: ambiguous
    (CHATML, None), (None, None), ("", None)])
def test_choose_by_chat_template(template, name):
    assert QWEN35 != QWEN3 and QWEN3_THINKING_ONLY != QWEN3
    assert choose(template) == name


class CharTokenizer:
    """A token per character: enough to see what after_reasoning encodes and decodes."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


class Processor:
    tokenizer = CharTokenizer()
    harmony = None  # a model that does not speak harmony


def ids(text: str) -> list[int]:
    return CharTokenizer.encode(text)


def test_after_reasoning_starts_the_grammar_after_the_end_tag():
    constraint = StructuredOutputsParams(json={"type": "object"})
    gated = after_reasoning(constraint, Processor(), "qwen3", ids("<|im_start|>assistant\n"))
    assert gated.starts_after == tuple(ids("</think>"))
    assert gated.key == constraint.key and gated.json == constraint.json  # the same grammar
    assert after_reasoning(constraint, Processor(), None, ids("x")) is constraint  # no parser: no reasoning
    assert after_reasoning(None, Processor(), "qwen3", ids("x")) is None


@pytest.mark.parametrize("prompt", ["assistant\n<think>\n\n</think>\n\n", "<｜Assistant｜></think>"])
def test_a_prompt_that_ended_the_reasoning_gets_the_grammar_from_the_first_token(prompt):
    constraint = StructuredOutputsParams(regex="[a-z]+")
    assert after_reasoning(constraint, Processor(), "deepseek_r1", ids(prompt)) is constraint


def test_starts_after_travels_to_the_engine_and_is_checked():
    params = StructuredOutputsParams(choice=("a", "b"), starts_after=[7, 8])
    assert params.starts_after == (7, 8)
    assert structured_from_proto(structured_to_proto(params)) == params
    with pytest.raises(InvalidRequest, match="starts_after"):
        StructuredOutputsParams(regex="a", starts_after=(-1,))


def messages_request(**fields) -> MessagesRequest:
    return MessagesRequest(model="m", max_tokens=2048, messages=[{"role": "user", "content": "hi"}], **fields)


def test_anthropic_thinking_is_the_templates_enable_thinking():
    assert anthropic_template_kwargs(messages_request()) is None
    enabled = {"type": "enabled", "budget_tokens": 1024}
    assert anthropic_template_kwargs(messages_request(thinking=enabled)) == {"enable_thinking": True}
    assert anthropic_template_kwargs(messages_request(thinking={"type": "adaptive"})) == {"enable_thinking": True}
    assert anthropic_template_kwargs(messages_request(thinking={"type": "disabled"})) == {"enable_thinking": False}
    for budget in (None, 1023, 2048):  # as Anthropic: at least 1024, less than max_tokens
        with pytest.raises(InvalidRequest, match="thinking.budget_tokens"):
            anthropic_template_kwargs(messages_request(thinking={"type": "enabled", "budget_tokens": budget}))


def test_thinking_blocks_and_reasoning_content():
    events = parse_sample("<think>\nhmm\n</think>\n\nHi.", "qwen3")
    assert openai_message(events, reasoning=True, tools=False) == {"content": "Hi.", "reasoning_content": "hmm"}
    assert openai_message(parse_sample("<think>cut", "qwen3"), reasoning=True, tools=False) == {
        "content": "", "reasoning_content": "cut"}
    assert anthropic_blocks(events) == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                        {"type": "text", "text": "Hi."}]
    assert anthropic_blocks(events, omit_thinking=True)[0] == {"type": "thinking", "thinking": "", "signature": ""}


def test_omitted_thinking_streams_a_block_with_no_text():
    sent = []
    blocks = AnthropicBlocks(lambda kind, data: sent.append((kind, data)), omit_thinking=True)
    blocks.send([Reasoning("a"), Reasoning("b"), Content("Hi")])
    blocks.close()
    deltas = [d["delta"]["type"] for kind, d in sent if kind == "content_block_delta"]
    assert deltas == ["signature_delta", "text_delta"]


def test_enable_thinking_reaches_the_template_and_decides_where_the_grammar_starts(bundled_tokenizer):
    """chat_template_kwargs (and Anthropic's thinking, mapped onto them) go to the template as
    they are; with enable_thinking false Qwen3's writes an empty thought, which ends the reasoning."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{% endfor %}" + QWEN3[QWEN3.index("{%- if add_generation_prompt"):])
    tokenizer = Tokenizer(bundled_tokenizer.backend_tokenizer, {}, template)
    processor = InputProcessor(tokenizer, PromptLimits(tokenizer.vocab_size, 2048, 128, 16))
    constraint = StructuredOutputsParams(json_object=True)
    off = processor.tokenize_chat(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    on = processor.tokenize_chat(MESSAGES, chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(off).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(on).endswith("assistant\n")
    assert after_reasoning(constraint, processor, "qwen3", off) is constraint
    assert after_reasoning(constraint, processor, "qwen3", on).starts_after == tuple(
        tokenizer.encode("</think>", add_special_tokens=False))
