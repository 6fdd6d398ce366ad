"""bench/vision.py's parts without a model: rates, ratios and verdicts, the table, the
encoder profile's arithmetic, the HTTP stream's first token, the flags, the real
preprocessing's token counts, and the chart (the benchmark itself takes minutes)."""

from __future__ import annotations

import json

import pytest

from bench import vision, vision_report
from bench.vision_profile import part_of, parts_ms
from bench.vision_served import chat_body, first_token_s


def _encoder(dtype: str, size: int, ours_s: float, hf_s: float) -> dict:
    return vision_report.encoder_row(dtype, size, 2, 256, [ours_s, ours_s * 2, ours_s / 2], [hf_s] * 3, 0.06, 7.5)


def test_encoder_row_rates_are_images_per_median_second_and_judged_at_2x():
    row = _encoder("bfloat16", 448, 0.5, 1.0)  # median 0.5 s for 2 images: 4/s; HF 2/s
    assert (row["ours_images_s"], row["hf_images_s"], row["speedup"]) == (4.0, 2.0, 2.0)
    assert row["met"]  # exactly 2x meets it
    assert not _encoder("bfloat16", 448, 0.51, 1.0)["met"]


def test_hit_row_ratio_of_medians_and_the_030_target():
    row = vision_report.hit_row("offline", 1024, [1.0, 3.0, 2.0], [0.6, 0.5, 0.7], 1376, 1395, True)
    assert row["miss_ms"] == pytest.approx(2000) and row["hit_ms"] == pytest.approx(600)
    assert row["ratio"] == pytest.approx(0.30) and row["met"]
    assert not vision_report.hit_row("http", 448, [1.0], [0.31], 272, 282, None)["met"]


def test_ttft_row_speedup_is_hf_over_ours():
    row = vision_report.ttft_row(448, 282, [2.0, 2.5, 3.0], [5.0, 5.0, 6.0])
    assert (row["ours_ms"], row["hf_ms"], row["speedup"]) == (2500.0, 5000.0, 2.0)


def test_verdicts_judge_the_encoder_on_one_dtype_and_every_size():
    encoder = [_encoder("bfloat16", 448, 0.4, 1.0), _encoder("bfloat16", 1024, 0.4, 1.0),
               _encoder("float32", 448, 1.0, 1.0)]  # float32 misses: not judged
    hit = vision_report.hit_row("offline", 448, [1.0], [0.1], 16, 20, True)
    assert vision_report.verdicts(encoder, [hit], "bfloat16") == {"encoder_speedup": True, "hit_to_miss": True}
    assert not vision_report.verdicts(encoder, [hit], "float32")["encoder_speedup"]
    encoder[1] = _encoder("bfloat16", 1024, 0.6, 1.0)  # 1.67x at one size
    slow_hit = vision_report.hit_row("http", 448, [1.0], [0.5], 16, 20, None)
    assert vision_report.verdicts(encoder, [hit, slow_hit], "bfloat16") == {
        "encoder_speedup": False, "hit_to_miss": False}
    assert vision_report.verdicts([], [], "bfloat16") == {"encoder_speedup": False, "hit_to_miss": False}


def _payload() -> dict:
    return {"machine": {"cpu": "AMD EPYC"}, "model": {"vision_depth": 4, "text_layers": 2},
            "workload": {"num_threads": 2},
            "encoder": [_encoder("bfloat16", 448, 0.4, 1.0), _encoder("bfloat16", 1024, 0.6, 1.0)],
            "ttft": [vision_report.ttft_row(448, 282, [2.0], [3.0])],
            "prefix_hit": [vision_report.hit_row("offline", 448, [2.0], [0.1], 272, 283, True),
                           vision_report.hit_row("http", 448, [2.0], [0.8], 272, 283, None)]}


def test_table_rows_mark_each_target():
    rows = vision_report.table_rows({**_payload(), "served_errors": [{"size": 1024, "error": "engine lost"}]})
    assert [r[-1] for r in rows] == ["met", "MISSED", "", "met", "MISSED", "FAILED"]
    assert rows[0][1:5] == ["5.000", "2.000", "2.50x", ">= 2x"]
    assert rows[3][0] == "TTFT ms hit / miss, 448px, offline" and rows[3][1:4] == ["100 / 2000", "-", "0.050"]


def test_profile_parts_take_the_linears_out_of_attention_and_keep_the_rest_as_other():
    assert part_of("blocks.3.attn", {3}) == "attention core (full)"
    assert part_of("blocks.0.attn", {3}) == "attention core (windows)"
    assert part_of("patch_embed.proj", {3}) == "patch embed" and part_of("patch_embed", {3}) is None
    assert part_of("blocks.0", {3}) is None and part_of("blocks.0.mlp.up_proj", {3}) is None
    spent = {"blocks.0.attn": 0.5, "blocks.0.attn.qkv": 0.2, "blocks.0.attn.proj": 0.1,
             "blocks.0.mlp": 1.0, "blocks.0.norm1": 0.05, "blocks.0.norm2": 0.05, "merger": 0.3}
    parts = parts_ms(spent, 2.5, {3})
    assert parts == pytest.approx({"attention core (windows)": 200, "attention qkv linear": 200,
                                   "attention out linear": 100, "MLP": 1000, "norms": 100, "merger": 300,
                                   "other": 600, "total": 2500})
    rows = vision_report.profile_rows(parts)
    assert rows[0] == ["MLP", "1000", "40%"] and rows[-1] == ["total", "2500", "100%"]


def test_first_token_is_the_first_chunk_with_text_or_a_finish():
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    events = [(0.1, role_only), (0.5, {"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]}),
              (0.6, {"choices": [], "usage": {"prompt_tokens": 9}})]
    assert first_token_s(events) == 0.5
    assert first_token_s([(0.2, role_only), (0.3, {"choices": [{"delta": {"content": "Hi"}}]})]) == 0.3
    assert first_token_s([(0.1, role_only)]) is None
    body = chat_body("m", "data:image/jpeg;base64,AA==", "Why?")
    assert body["max_tokens"] == 1 and body["stream"] and body["messages"][0]["content"][0]["type"] == "image_url"


def test_flags_pair_sizes_with_batches_and_put_the_ttft_dtype_first():
    args = vision.parse_args(["--dtype", "float32", "--sizes", "224,448", "--encoder-batch", "2,1"])
    assert args.encoder_dtypes == ["float32", "bfloat16"] and args.sizes == [224, 448]
    assert vision.parse_args([]).encoder_dtypes == ["bfloat16", "float32"]
    assert vision.parse_args(["--encoder-dtypes", "bfloat16"]).encoder_dtypes == ["bfloat16"]
    with pytest.raises(SystemExit):
        vision.parse_args(["--sizes", "448,1024", "--encoder-batch", "4"])


def test_the_hubs_preprocessing_makes_1369_tokens_of_a_1024_image():
    from bench.vision_model import PREPROCESSOR, image_processor_class, picture
    processor = image_processor_class()(**PREPROCESSOR)
    out = processor(images=[picture(448, 0)], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]] and out["pixel_values"].shape == (1024, 1176)
    assert processor.get_number_of_image_patches(1024, 1024, {}) == 74 * 74  # merged 2x2: 1369 tokens


def test_chart_is_written_beside_its_result_and_named_in_it(tmp_path):
    path = tmp_path / "vision-x.json"
    path.write_text(json.dumps(_payload()))
    chart = vision_report.plot(path)
    assert chart == path.with_suffix(".png") and chart.read_bytes().startswith(b"\x89PNG")
    assert json.loads(path.read_text())["plot"] == chart.name
