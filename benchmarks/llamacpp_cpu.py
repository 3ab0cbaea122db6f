"""prefixserve vs llama.cpp on this CPU: many chats sharing one long system prompt (issue 28's CPU target).

32 chats share a ~1,400-token system prompt; each adds a 64-token user turn and gets 64 generated
tokens (EOS ignored, greedy). Both engines read the same GGUF (the default model, Q4_1) and use the
same threads. llama.cpp (llama-cpp-python, the peer; optional, never a dependency of the package)
runs the chats one after another, as its Python API does, reusing the KV of the longest common prefix
with the previous prompt, so it computes the system prompt once too; prefixserve runs them together
(prefix cache + continuous batching; fp32, the CPU default, and bf16). Reported: wall time of the 32 chats
(model loads excluded), tokens/s, and prefixserve's wall time as a fraction of llama.cpp's.

    pip install llama-cpp-python      # builds llama.cpp; not needed by prefixserve
    python -m benchmarks.llamacpp_cpu [--threads 2] [--chats 32]
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch

from benchmarks.harness import run_info, write_results
from prefixserve import LLM, SamplingParams
from prefixserve.model.loader import default_gguf_path, tokenizer_for

# the words the synthetic system prompt and user turns are drawn from
TEXT = (
    "The shop keeps spare parts for road gravel and city bikes and its mechanics true wheels fit "
    "chains adjust brakes and gears swap saddles and pedals and check frames forks and tyres"
)
WORDS = re.findall(r"\w+", TEXT)


def make_prompts(tok, chats: int, system_tokens: int, turn_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompts: one shared system message of about ``system_tokens`` tokens, then a
    user turn of ``turn_tokens`` tokens each (token ids, so both engines see the same input)."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_tokens))
    while len(tok.encode(system)) > system_tokens:
        system = system.rsplit(" ", 8)[0]
    out = []
    for _ in range(chats):
        turn = " ".join(rng.choice(WORDS) for _ in range(turn_tokens))
        while len(tok.encode(turn)) > turn_tokens:
            turn = turn.rsplit(" ", 1)[0]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def run_prefixserve(prompts: list[list[int]], gen: int, dtype: str) -> dict:
    llm = LLM(dtype=dtype, device="cpu", num_kv_blocks=2048, progress=False)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2))  # warm up
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def run_llamacpp(prompts: list[list[int]], gen: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(default_gguf_path()),
        n_ctx=4096,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    llm.eval(prompts[0][:16])  # warm up
    t0 = time.perf_counter()
    tokens = []
    for prompt in prompts:  # each reuses the KV of its longest common prefix with the previous one
        out = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) == gen:
                break
        tokens.append(out)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "llama_cpp_python": __import__("llama_cpp").__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1400)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        help="prefixserve's dtypes (float32: the CPU default; bfloat16: AVX512-BF16 / AMX matmuls)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(tokenizer_for(None)[1], args.chats, args.system_tokens, args.turn_tokens)
    ours = {dtype: run_prefixserve(prompts, args.gen, dtype) for dtype in args.dtypes}
    peer = run_llamacpp(prompts, args.gen, args.threads)
    gen_tokens = args.chats * args.gen
    runs = {}
    for dtype, run in ours.items():
        pairs = list(zip(run["tokens"], peer["tokens"], strict=True))
        runs[dtype] = {
            "wall_s": run["wall_s"],
            "tok_s": gen_tokens / run["wall_s"],
            "wall_ratio": run["wall_s"] / peer["wall_s"],
            "first_token_agreement": sum(a[0] == b[0] for a, b in pairs) / args.chats,
            "all_tokens_agreement": sum(a == b for a, b in pairs) / args.chats,
        }
    payload = {
        **run_info(),
        "threads": args.threads,
        "chats": args.chats,
        "prompt_tokens": len(prompts[0]),
        "gen": args.gen,
        "llama_cpp_python": peer["llama_cpp_python"],
        "llamacpp_wall_s": peer["wall_s"],
        "llamacpp_tok_s": gen_tokens / peer["wall_s"],
        "prefixserve": runs,
    }
    md = [
        "# prefixserve vs llama.cpp on the CPU: chats sharing a system prompt",
        "",
        f"{payload['device']}; torch {payload['torch']}; llama-cpp-python {peer['llama_cpp_python']}; "
        f"commit {payload['commit']}; {payload['date']}; {args.threads} threads each. {args.chats} chats, "
        f"one system prompt ({len(prompts[0]) - args.turn_tokens}-odd tokens with the chat template) "
        f"+ a {args.turn_tokens}-token user turn each, {args.gen} tokens generated (greedy, EOS ignored). "
        "Same GGUF (default model, Q4_1): llama.cpp computes on the quantized weights (8-bit "
        "activations), prefixserve on them dequantized to the dtype shown. Model loads excluded. "
        "Written by `benchmarks/llamacpp_cpu.py`.",
        "",
        "| engine | wall (s) | generated tok/s | wall / llama.cpp's | greedy agreement with llama.cpp "
        "(first token / all tokens) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for dtype, r in runs.items():
        md.append(
            f"| prefixserve {dtype} (prefix cache, continuous batching) | {r['wall_s']:.1f} | "
            f"{r['tok_s']:.1f} | **{r['wall_ratio']:.2f}x** | {r['first_token_agreement']:.0%} / "
            f"{r['all_tokens_agreement']:.0%} |"
        )
    md.append(
        f"| llama.cpp (one chat after another, common-prefix KV reuse) | {peer['wall_s']:.1f} | "
        f"{payload['llamacpp_tok_s']:.1f} | 1.00x | |"
    )
    md += ["", "Issue 28's target: prefixserve's wall time <= 0.5x llama.cpp's."]
    write_results("llamacpp_cpu", payload, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
