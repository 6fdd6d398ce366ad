"""Qwen2.5-VL on CPU against HF transformers in the same run (`python -m bench.vision`): images
through the vision encoder, TTFT of one image, and TTFT of a prefix-cache hit.

The model is bench/vision_model.py's: Qwen2.5-VL-3B's widths (vision 1280 wide, 16 heads;
LM 2048 wide, 16 heads, 2 KV heads) with --vision-depth blocks and --text-layers layers,
random weights, the Hub's preprocessing. Both sides run in this process on --num-threads
torch threads, in --dtype (and --encoder-dtypes for the encoder alone):

    encoder     images/s: pagedserve's embed_images (the engine's model) and HF's
                get_image_features on the same preprocessed pixels, --encoder-batch images
                of each --sizes square per call; their outputs compared (max |diff|)
                target: ours >= 2x HF's images/s
    TTFT        one image and a question, 1 output token: LLM.chat with an empty prefix cache
                and an image never seen (the encoder runs) vs HF's processor + generate
    prefix hit  the same image with a new question right after: TTFT of the hit over the
                first request's; offline, and with --served over HTTP (`pagedserve serve`,
                streamed /v1/chat/completions with the image as a data URL)
                target: <= 0.30

Medians of --repeats runs after one warm-up, ours and HF's interleaved. When ours misses the
encoder target (--profile auto), one call of each encoder at the largest size is split by
part (patch embed, attention, MLP, merger) and by op. Writes vision-*.json (with the
machine's CPU flags) and a chart beside it in bench/results/, and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import vision_report as report
from bench.reporting import OtherLoad, machine_info, model_bytes, write_result
from bench.vision_model import (
    MAX_MODEL_LEN,
    QUESTIONS,
    build,
    conversation,
    hf_inputs,
    hf_model,
    hf_processor,
    picture,
)


def timed(fn, *args, **kwargs):
    """(seconds, what fn(*args, **kwargs) returned)."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def preprocessed(llm, image) -> tuple[np.ndarray, tuple[int, int, int], int]:
    """(patch rows, grid, tokens) of `image` as pagedserve's frontend makes them."""
    _, [im] = llm.input.chat_prompt(conversation(image, QUESTIONS[0]), add_generation_prompt=True)
    return im.pixels, tuple(im.grid), im.length


def measure_encoder(llm, hf, dtype: str, size: int, batch: int, args, bar) -> dict:
    """`batch` images per call through each encoder: one warm-up call (its outputs compared),
    then --repeats timed calls each, interleaved."""
    import torch
    images = [preprocessed(llm, picture(size, 100 + i)) for i in range(batch)]
    pixels, grids = [torch.from_numpy(p) for p, _, _ in images], [g for _, g, _ in images]
    hf_pixels, hf_grids = torch.cat(pixels), torch.tensor(grids)
    model = llm.engine.model_runner.model

    def ours():
        return model.embed_images(pixels, grids)

    def theirs():
        return hf.model.get_image_features(hf_pixels, hf_grids).pooler_output

    ours_s, hf_s = [], []
    with torch.inference_mode():
        a, b = ours(), theirs()
        bar.update()
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
        scale = max(y.float().abs().max().item() for y in b)
        for _ in range(args.repeats):
            ours_s.append(timed(ours)[0])
            hf_s.append(timed(theirs)[0])
            bar.update()
    return report.encoder_row(dtype, size, batch, images[0][2], ours_s, hf_s, diff, scale)


def measure_ttft(llm, hf, processor, size: int, args, bar) -> tuple[dict, dict]:
    """Per run a new image: ours with an empty prefix cache (the miss), the same image with the
    other question (the hit), and HF's processor + generate on the first request's inputs."""
    import torch

    from pagedserve import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1)
    encoder = llm.engine.model_runner.vision.cache
    ours_s, hf_s, hit_s, skipped = [], [], [], True
    for run in range(args.repeats + 1):  # run 0: warm-up
        image = picture(size, 1000 * size + run)
        llm.reset_prefix_cache()
        miss_s, [first] = timed(llm.chat, conversation(image, QUESTIONS[0]), one)
        encoded = encoder.num_encoded
        again_s, [again] = timed(llm.chat, conversation(image, QUESTIONS[1]), one)
        skipped = skipped and encoder.num_encoded == encoded
        with torch.inference_mode():
            theirs_s, _ = timed(hf_generate, hf, processor, image)
        if first.num_cached_tokens:
            raise RuntimeError(f"the first request of a new image hit the prefix cache ({first.num_cached_tokens})")
        if run:
            ours_s.append(miss_s)
            hit_s.append(again_s)
            hf_s.append(theirs_s)
        bar.update()
    return (report.ttft_row(size, len(first.prompt_token_ids), ours_s, hf_s),
            report.hit_row("offline", size, ours_s, hit_s, again.num_cached_tokens, len(again.prompt_token_ids),
                           skipped))


def hf_generate(hf, processor, image):
    """HF's TTFT path: its processor on the first request, then generate 1 token."""
    return hf.generate(**hf_inputs(processor, image, QUESTIONS[0]), max_new_tokens=1, do_sample=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.num_threads)
    folder = build(args.vision_depth, args.text_layers)
    processor = hf_processor(folder)
    steps = (args.repeats + 1) * len(args.sizes) * (len(args.encoder_dtypes) + 1 + args.served)
    bar = tqdm(total=steps, desc="vision", unit="run")
    load = OtherLoad()
    encoder, ttft, hits, profile = measure_in_process(folder, processor, args, bar)
    served_errors = []
    if args.served:
        from bench.vision_served import measure_served
        served, served_errors = measure_served(folder, args, bar)
        hits += served
    bar.close()
    payload = {
        "machine": machine_info("cpu"),
        "model": {"folder": folder.name, "vision_depth": args.vision_depth, "text_layers": args.text_layers,
                  "file_mib": round(model_bytes(folder) / 2**20, 1)},
        "workload": {"sizes": args.sizes, "encoder_batch": args.encoder_batch, "repeats": args.repeats,
                     "num_threads": args.num_threads, "dtype": args.dtype, "encoder_dtypes": args.encoder_dtypes,
                     "questions": QUESTIONS, "max_model_len": MAX_MODEL_LEN},
        "other_load_cores": load.cores(),
        "encoder": encoder, "ttft": ttft, "prefix_hit": hits, "profile": profile,
        "served_note": None if args.served else "prefix hit measured offline only (--no-served)",
        "served_errors": served_errors,
        "targets": report.TARGETS, "met": report.verdicts(encoder, hits, args.dtype)}
    if args.served:
        payload["met"]["served_all_sizes"] = not served_errors
    report.print_report(payload)
    path = write_result("vision", payload, args.output_dir)
    print(f"wrote {path} and {report.plot(path).name}")
    return 0


def measure_in_process(folder: Path, processor, args, bar) -> tuple[list, list, list, dict | None]:
    """(encoder rows, TTFT rows, offline hit rows, the profile or None): pagedserve's LLM and HF's
    model side by side, one dtype at a time."""
    from pagedserve import LLM
    encoder, ttft, hits, profile = [], [], [], None
    for dtype in args.encoder_dtypes:
        llm = LLM(str(folder), dtype=dtype, max_model_len=MAX_MODEL_LEN, num_threads=args.num_threads)
        hf = hf_model(folder, dtype)
        for size, batch in zip(args.sizes, args.encoder_batch):
            bar.set_description(f"encoder {size}px {dtype}")
            encoder.append(measure_encoder(llm, hf, dtype, size, batch, args, bar))
        if dtype == args.dtype:
            missed = not report.verdicts(encoder, [], dtype)["encoder_speedup"]
            if args.profile == "always" or (args.profile == "auto" and missed):
                bar.set_description("profile")
                profile = profile_encoders(llm, hf, max(args.sizes), dtype)
            for size in args.sizes:
                bar.set_description(f"TTFT {size}px")
                row, hit = measure_ttft(llm, hf, processor, size, args, bar)
                ttft.append(row)
                hits.append(hit)
        del llm, hf
        gc.collect()
    return encoder, ttft, hits, profile


def profile_encoders(llm, hf, size: int, dtype: str) -> dict:
    """One call of each encoder on a size x size image, split by part and by op (ms)."""
    from bench.vision_profile import encoder_profile
    pixels, grid, _ = preprocessed(llm, picture(size, 7))
    ours, theirs = llm.engine.model_runner.model, hf.model
    import torch
    px = torch.from_numpy(pixels)
    full = set(ours.visual.full_blocks)
    return {"size": size, "dtype": dtype,
            "pagedserve": encoder_profile(ours.visual, lambda: ours.embed_images([px], [grid]), full),
            "HF": encoder_profile(theirs.visual, lambda: theirs.get_image_features(px, torch.tensor([grid])), full)}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from common.process_args import default_num_threads
    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vision-depth", type=int, default=4, help="vision blocks, the last full attention (default: 4)")
    p.add_argument("--text-layers", type=int, default=2, help="language model layers (default: 2)")
    p.add_argument("--sizes", type=_int_list, default=[448, 1024], help="square image sizes (default: 448,1024)")
    p.add_argument("--encoder-batch", type=_int_list, default=[4, 1],
                   help="images per encoder call, one per size (default: 4,1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after a warm-up (default: 3)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of TTFT and of the encoder target (default: bfloat16)")
    p.add_argument("--encoder-dtypes", default=None, type=lambda t: [d for d in t.split(",") if d],
                   help="dtypes of the encoder rows, --dtype among them (default: bfloat16,float32)")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the prefix hit over HTTP, `pagedserve serve` (default: on)")
    p.add_argument("--profile", default="auto", choices=("auto", "always", "never"),
                   help="split the encoders' time by part: auto when ours misses the target (default: auto)")
    p.add_argument("--num-threads", type=int, default=default_num_threads(), help="torch threads (default: all cores)")
    p.add_argument("--output-dir", type=Path, default=None, help="where to write JSON (default: bench/results)")
    args = p.parse_args(argv)
    if len(args.encoder_batch) != len(args.sizes):
        p.error(f"--encoder-batch: one per size, got {len(args.encoder_batch)} for {len(args.sizes)} sizes")
    dtypes = args.encoder_dtypes or ["bfloat16", "float32"]
    args.encoder_dtypes = [args.dtype] + [d for d in dtypes if d != args.dtype]  # --dtype first: TTFT runs with it
    return args


if __name__ == "__main__":
    sys.exit(main())
