"""Regenerate bench/data/sharegpt_sample.json: our questions, answered by the bundled model.

The questions below were written for this repository. The answers come from the bundled
SmolLM2-135M-Instruct run through our own offline engine (`engine.LLM`), greedy, with the
model's chat template, so the file is reproducible and owes nothing to outside datasets.
Run: python -m bench.data.make_sharegpt_sample [--max-tokens 200] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "sharegpt_sample.json"


def build(max_tokens: int, dtype: str, num_threads: int | None) -> list[dict]:
    from pagedserve import LLM, SamplingParams
    llm = LLM(dtype=dtype, num_threads=num_threads)
    prompts = [llm.tokenizer.encode(_chat(llm.tokenizer, q), add_special_tokens=False) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return [{"id": f"pagedserve-sample-{i:04d}",
             "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": o.outputs[0].text.strip()}]}
            for i, (q, o) in enumerate(zip(QUESTIONS, outs))]


def _chat(tokenizer, question: str) -> str:
    # The template holds BOS and friends: encode its text without adding them again.
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data.make_sharegpt_sample", description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=200, help="longest answer, in tokens (default: 200)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="engine dtype (default: float32, the nearest to the model's own numbers)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"where to write (default: {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    conversations = build(args.max_tokens, args.dtype, args.num_threads)
    args.output.write_text(json.dumps(conversations, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(conversations)} conversations to {args.output}")
    return 0


# Written for this repository: short and long, many topics, so prompt and answer lengths vary.
QUESTIONS = [
    "What is the capital of Australia?",
    "How do magnets work?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Write a haiku about autumn rain.",
    "What is the difference between a virus and a bacterium?",
    "Explain what a hash table is to a beginner programmer.",
    "How many legs does a spider have?",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "Is a tomato a fruit or a vegetable?",
    "Explain the rules of chess in a few sentences.",
    "What are the main differences between renting and buying a home?",
    "How does a bicycle stay upright when it moves?",
    "Summarize the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "Give me a simple recipe for pancakes.",
    "Why do we have leap years?",
    "What is the Pythagorean theorem, and where is it used?",
    "Write a short, polite email asking my manager for a day off next Friday.",
    "What does a compiler do?",
    "Name five animals that live in the Arctic.",
    "How can I improve my public speaking?",
    "What is inflation, and why does it matter to ordinary people?",
    "Describe the water cycle.",
    "What is the tallest mountain in the world, and how tall is it?",
    "Tell me a short story about a robot who learns to paint.",
    "I am learning to play the guitar. I can play a few chords, but switching between them is "
    "slow and my fingers hurt after ten minutes. I practise about twenty minutes a day after work. "
    "How should I structure my practice so that I get better faster without hurting my hands?",
    "Here is a paragraph from my essay: 'Cities are growing quickly all over the world. This brings "
    "jobs and culture, but it also brings traffic, pollution and high rents. Some people think that "
    "building more roads is the answer, while others argue for public transport, bike lanes and "
    "walkable neighbourhoods.' Can you rewrite it to sound more formal, and suggest a strong closing "
    "sentence?",
    "My team has a web service that answers most requests in 50 milliseconds, but about one request in "
    "a hundred takes more than two seconds. The slow requests do not seem to depend on the endpoint or "
    "on the time of day. The service runs on three machines behind a load balancer and talks to one "
    "database. What could cause this kind of tail latency, and how would you investigate it step by step?",
    "I want to start running. I am 35, I have not exercised regularly for years, and I can walk for an "
    "hour without trouble. Please give me a plan for the first four weeks, with how often and how long "
    "to run, and tell me what mistakes beginners usually make.",
    "Compare these two ways of storing a list of users in a program: a plain array that I search from "
    "the start every time, and a dictionary keyed by user id. When is each one the better choice? "
    "Please mention memory use, speed of lookups, and speed of inserting new users.",
    "Explain, as if to a curious twelve-year-old, why ships made of steel float even though steel is "
    "heavier than water, and why a solid steel ball sinks.",
    "We are planning a family trip for a week in summer with two children aged six and nine. We like "
    "nature more than cities, we do not want to drive more than three hours a day, and our budget is "
    "modest. What kinds of destinations and activities would you suggest, and how should we plan the "
    "days so that the children do not get bored?",
    "What is the difference between weather and climate?",
    "List the planets of the solar system in order from the Sun.",
    "Why do onions make people cry when they cut them?",
]


if __name__ == "__main__":
    raise SystemExit(main())
