"""Incremental detokenization and stop-string matching, on the bundled SmolLM2 tokenizer
(byte-level BPE: one emoji is several tokens) through both tokenizers the processors meet:
the HF one (offline `LLM`) and the torch-free frontend one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from helpers import LONG

MIXED = "héllo 🤖 wörld 日本語, 👋👍🏽 and 中文字符!"
ROBOT = " 🤖"  # 3 byte-level tokens, none a whole character


@pytest.fixture(scope="module")
def frontend_tokenizer(bundled_tokenizer):
    from engine.models.loader import tokenizer_files
    from frontend.tokenizer import Tokenizer
    return Tokenizer.from_files(tokenizer_files(bundled_tokenizer))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """Llama 2's way in miniature: "▁" for spaces, bytes for what the vocabulary lacks, and a
    decoder that strips the text's first space, so a token decodes differently alone and
    after context (unlike byte-level BPE, where the prompt's tail changes nothing)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers

    from frontend.tokenizer import Tokenizer
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁Hello", "▁world", "▁a", "a", "b", "ab", "▁日本", "語", "."]
    backend = RustTokenizer(models.Unigram([(p, -float(len(pieces) - i)) for i, p in enumerate(pieces)],
                                           unk_id=0, byte_fallback=True))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, {"eos_token": "</s>"}, None)


@pytest.fixture(params=["hf", "frontend"])
def tok(request, bundled_tokenizer, frontend_tokenizer):
    return bundled_tokenizer if request.param == "hf" else frontend_tokenizer


@pytest.fixture(params=["hf", "frontend", "sentencepiece"])
def any_tok(request, bundled_tokenizer, frontend_tokenizer, sentencepiece_tokenizer):
    return {"hf": bundled_tokenizer, "frontend": frontend_tokenizer,
            "sentencepiece": sentencepiece_tokenizer}[request.param]


def stream(tok, prompt: list[int], ids: list[int], chunk: int = 1, **kwargs) -> list[str]:
    """The detokenizer's deltas for `ids` fed `chunk` tokens at a time, then its flush."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_characters_never_stream_a_replacement_char(tok, chunk):
    ids = encode(tok, MIXED)
    # The test means something only if single tokens are broken characters.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 6
    deltas = stream(tok, encode(tok, "Say:"), ids, chunk)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == tok.decode(ids) == MIXED
    assert deltas[-1] == ""  # nothing was left for the flush
    assert sum(bool(d) for d in deltas) >= 8  # text streams, not all at the end


def test_emoji_is_held_until_its_last_byte(tok):
    ids = encode(tok, ROBOT)
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, encode(tok, "A robot:"))
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:2]) == ""
    assert detok.add(ids[2:]) == ROBOT
    assert detok.add(encode(tok, " ok")) == " ok"


def test_flush_releases_an_incomplete_tail(tok):
    ids = encode(tok, "go" + ROBOT)
    detok = IncrementalDetokenizer(tok, encode(tok, "Hi"))
    assert detok.add(ids[:1]) == "go"
    assert detok.add(ids[1:-1]) == ""  # the robot's last byte never comes
    tail = detok.flush()
    assert tail == tok.decode(ids[1:-1]) and tail.startswith(" \ufffd")
    assert detok.flush() == ""


def output_text(tok, prompt: list[int], ids: list[int]) -> str:
    """What the output's deltas must add up to: the whole text minus the prompt's. A character
    split between the two is the output's (as in vLLM): the prompt's text is its whole
    characters, those its decode shows before the U+FFFDs (byte-level BPE) or, where byte
    fallback turns a whole run of bytes into U+FFFDs, those of the tokens before the split
    character. If the output leaves it unfinished, its U+FFFDs stay the prompt's."""
    full, prompt_text = tok.decode(prompt + ids), tok.decode(prompt)
    if not full.startswith(prompt_text):  # the output finished the prompt's last character
        before = next(text for text in (tok.decode(prompt[:k]) for k in range(len(prompt), -1, -1))
                      if not text.endswith("\ufffd"))
        prompt_text = max(prompt_text.rstrip("\ufffd"), before, key=len)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


@pytest.mark.parametrize("text", [MIXED, "Hello  world,\n  indented\tline. Don't stop!"])
def test_every_prompt_boundary_gives_the_rest_of_the_text(any_tok, text):
    """Split one text's tokens into prompt and completion at every place: the completion's
    text is the full text minus the prompt's (spaces and merges right at the boundary, and a
    character whose first bytes end the prompt)."""
    ids = encode(any_tok, text)
    for cut in range(1, len(ids)):
        deltas = stream(any_tok, ids[:cut], ids[cut:])
        assert not any("\ufffd" in d for d in deltas), (cut, deltas)
        assert "".join(deltas) == output_text(any_tok, ids[:cut], ids[cut:]), (cut, deltas)


@pytest.mark.parametrize("text", [MIXED, ROBOT + " ok"])
def test_prompt_ending_inside_a_character(any_tok, text):
    """A token-id prompt cut inside a character (the model is to finish it): the output's first
    text is that whole character, never a U+FFFD, and nothing of the prompt's text comes again."""
    ids = encode(any_tok, text)
    cuts = [cut for cut in range(1, len(ids)) if any_tok.decode(ids[:cut]).endswith("\ufffd")]
    assert len(cuts) >= 2  # the test means something only if there are such places
    for cut in cuts:
        deltas = stream(any_tok, ids[:cut], ids[cut:])
        assert not any("\ufffd" in d for d in deltas), (cut, deltas)
        output = "".join(deltas)
        assert output == output_text(any_tok, ids[:cut], ids[cut:]) and text.endswith(output), (cut, deltas)


def test_character_the_output_leaves_unfinished_stays_the_prompts(any_tok):
    """The prompt ends inside the robot and the model writes something else: the prompt's
    U+FFFD is not the output's, which is only its own text."""
    robot, ok = encode(any_tok, ROBOT), encode(any_tok, " ok")
    for cut in range(1, len(robot)):
        text = "".join(stream(any_tok, robot[:cut], ok))
        assert text == output_text(any_tok, robot[:cut], ok) and text.strip() == "ok", cut
        assert "".join(stream(any_tok, robot[:cut], [])) == ""


def test_prompt_longer_than_the_context_window(tok):
    prompt = encode(tok, "word " * 50)
    ids = encode(tok, "end 🤖 of story")
    assert "".join(stream(tok, prompt, ids)) == "end 🤖 of story"


def test_metaspace_space_at_the_prompt_boundary():
    """SentencePiece-style decoding drops a leading "▁" at the start of the text: decoded
    alone the first completion token loses its space, after the prompt it keeps it."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from frontend.tokenizer import Tokenizer
    words = ["<unk>", "</s>", "▁Hello", "▁world", "▁again", "!"]
    backend = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend, {"eos_token": "</s>"}, None)
    assert tok.decode([3]) == "world"
    assert tok.decode([2, 3]) == "Hello world"
    assert stream(tok, [2], [3, 4, 5]) == [" world", " again", "!", ""]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, skip):
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    assert eos == "<|im_end|>"
    ids = encode(tok, "Done.") + [tok.eos_token_id] + encode(tok, " More")
    text = "".join(stream(tok, encode(tok, "Go"), ids, skip_special_tokens=skip))
    assert text == ("Done. More" if skip else "Done.<|im_end|> More")


def feed(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    """Released text per delta, until a stop string; and that stop string."""
    released = []
    for d in deltas:
        text, stop = matcher.add(d)
        released.append(text)
        if stop is not None:
            return released, stop
    return released, None


def test_stop_string_across_deltas():
    released, stop = feed(StopStringMatcher(["STOP"]), ["abc S", "T", "O", "P and more", "never"])
    assert stop == "STOP"
    assert released == ["abc ", "", "", ""]


def test_stop_string_across_tokens(tok):
    """Real token deltas: the stop string is split over tokens, found once complete."""
    text = "The quick brown fox jumps over the lazy dog."
    ids = encode(tok, text)
    detok, matcher = IncrementalDetokenizer(tok, encode(tok, "Say:")), StopStringMatcher(["wn fox j"])
    released, stop = feed(matcher, [detok.add([i]) for i in ids])
    assert stop == "wn fox j"
    assert "".join(released) == "The quick bro"
    assert len(released) < len(ids)  # it stopped before the end


def test_held_back_prefix_released_when_not_a_stop():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("abc ST") == ("abc ", None)
    assert matcher.add("O") == ("", None)
    assert matcher.pending == "STO"
    assert matcher.add("RM") == ("STORM", None)
    assert matcher.pending == ""


def test_held_back_prefix_released_by_flush():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.add("abc STO") == ("abc ", None)
    assert matcher.flush() == "STO"
    assert matcher.flush() == ""


def test_include_stop_str_in_output():
    released, stop = feed(StopStringMatcher(["STOP"], include_stop_str_in_output=True),
                          ["abc S", "TO", "P tail"])
    assert stop == "STOP"
    assert "".join(released) == "abc STOP"


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    assert matcher.add("hello world") == ("hel", "lo w")
    released, stop = feed(StopStringMatcher(["world", "o"]), ["hell", "o world"])
    assert (released, stop) == (["hell", ""], "o")


def test_longest_possible_start_is_held():
    # "ab" could begin "abc", and "b" could begin "bd": hold the longer one.
    matcher = StopStringMatcher(["abc", "bd"])
    assert matcher.add("xab") == ("x", None)
    assert matcher.add("d") == ("a", "bd")


def test_overlapping_prefixes_of_one_stop_string():
    matcher = StopStringMatcher(["aab"])
    assert [matcher.add(c) for c in "xaa"] == [("x", None), ("", None), ("", None)]
    assert matcher.add("a") == ("a", None)  # "aaa": only the last "aa" may still begin "aab"
    assert matcher.add("b") == ("", "aab")
    repeated = StopStringMatcher(["abab"])
    released, stop = feed(repeated, list("abaabab"))
    assert stop == "abab" and "".join(released) == "aba"


def test_no_stop_strings_releases_everything():
    matcher = StopStringMatcher([])
    assert matcher.add("any text") == ("any text", None)
    assert matcher.flush() == ""


# --- DecodeStream against the window: the same deltas, add by add ---------------------------

class WindowOnly:
    """A tokenizer without a Rust backend (as a slow one is): the detokenizer's window path."""

    def __init__(self, tok) -> None:
        self.decode = tok.decode


def reference_deltas(tok, prompt: list[int], chunks: list[list[int]], skip: bool) -> list[str]:
    """The window detokenizer as it was before DecodeStream (read and prefix offsets into one
    growing list, 6 tokens of context), kept as the oracle; its last delta is the flush."""
    ids, prefix_at = list(prompt[-6:]), 0
    read_at, deltas = len(ids), []
    for chunk, final in [(c, False) for c in chunks] + [([], True)]:
        ids += chunk
        prefix = tok.decode(ids[prefix_at:read_at], skip_special_tokens=skip)
        text = tok.decode(ids[prefix_at:], skip_special_tokens=skip)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            deltas.append("")
            continue
        prefix_at, read_at = max(read_at, len(ids) - 6), len(ids)
        deltas.append(text[len(prefix):])
    return deltas


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` cut into chunks of the given sizes, repeated as needed."""
    chunks, i = [], 0
    while i < len(ids):
        size = sizes[len(chunks) % len(sizes)]
        chunks.append(ids[i:i + size])
        i += size
    return chunks


def deltas_of(tok, prompt: list[int], chunks: list[list[int]], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    # The fast path is the one under test: a prompt's tail that is text takes it, even one
    # ending inside a character; only stray bytes that end no character take the window.
    if not isinstance(tok, WindowOnly) and not ends_inside_a_character(tok, prompt, skip):
        assert detok._stream is not None
    return [detok.add(c) for c in chunks] + [detok.flush()]


def ends_inside_a_character(tok, prompt: list[int], skip: bool = True) -> bool:
    return tok.decode(prompt, skip_special_tokens=skip).endswith("\ufffd")


SIZES = st.lists(st.integers(1, 4), min_size=1, max_size=4)
IDS = st.lists(st.integers(0, 10**6), max_size=24)  # taken modulo the vocabulary's size
TEXT = st.lists(st.sampled_from([*"ab xy.,'\n", *"éß日本語中文", "🤖", "👍🏽", "  ", " <|im_end|>"]),
                max_size=30).map("".join)
fuzz = settings(max_examples=2000 if LONG else 100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def in_vocab(tok, ids: list[int]) -> list[int]:
    return [i % tok.backend_tokenizer.get_vocab_size() for i in ids]


def split_text(tok, text: str, cut: int) -> tuple[list[int], list[int]]:
    """Prompt and completion ids of one text: the prompt's last token may merge with the
    first output token, or end inside a character."""
    ids = tok.encode("Say:" + text, add_special_tokens=False)
    return ids[:cut], ids[cut:]


@fuzz
@given(prompt=IDS, ids=IDS, sizes=SIZES, skip=st.booleans())
def test_random_ids_stream_as_the_old_window_did(tok, prompt, ids, sizes, skip):
    prompt, chunks = in_vocab(tok, prompt), chunked(in_vocab(tok, ids), sizes)
    assume(not ends_inside_a_character(tok, prompt, skip))  # the old window lost that character
    assert deltas_of(tok, prompt, chunks, skip) == reference_deltas(tok, prompt, chunks, skip)


@fuzz
@given(text=TEXT, cut=st.integers(0, 40), sizes=SIZES, skip=st.booleans())
def test_text_streams_as_the_old_window_did(tok, text, cut, sizes, skip):
    prompt, ids = split_text(tok, text, cut)
    assume(not ends_inside_a_character(tok, prompt, skip))  # the old window lost that character
    chunks = chunked(ids, sizes)
    assert deltas_of(tok, prompt, chunks, skip) == reference_deltas(tok, prompt, chunks, skip)


@fuzz
@given(prompt=IDS, ids=IDS, text=TEXT, cut=st.integers(0, 40), sizes=SIZES, skip=st.booleans())
def test_stream_and_window_paths_agree(any_tok, prompt, ids, text, cut, sizes, skip):
    """Random ids (special tokens, stray bytes) and real text: the same deltas either way."""
    for prompt, ids in [(in_vocab(any_tok, prompt), in_vocab(any_tok, ids)), split_text(any_tok, text, cut)]:
        chunks = chunked(ids, sizes)
        assert deltas_of(any_tok, prompt, chunks, skip) == deltas_of(WindowOnly(any_tok), prompt, chunks, skip)


@fuzz
@given(text=TEXT, cut=st.integers(1, 40), sizes=SIZES)
def test_text_is_the_whole_decode_minus_the_prompts(any_tok, text, cut, sizes):
    """The streamed text is the whole text's minus the prompt's, even where the prompt ends
    inside a character, and shows no U+FFFD. Byte fallback and a first space that decodes
    differently alone too. (The old window kept only 6 tokens after a release; inside a run of
    byte tokens that decoded as U+FFFDs: "日日xx" lost an "x".)"""
    prompt, ids = split_text(any_tok, text, cut)
    deltas = deltas_of(any_tok, prompt, chunked(ids, sizes), False)
    assert "".join(deltas) == output_text(any_tok, prompt, ids)
    assert not any("\ufffd" in d for d in deltas)
