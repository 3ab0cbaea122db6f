"""OpenAI's Batch API on a live server: a shuffled batch run in the planner's order against the file's.

D documents of P tokens, Q questions each (a question: the document, then 12 tokens of its own;
``gen`` tokens generated, EOS ignored), as /v1/completions rows shuffled into one batch file, as an
unsorted offline job arrives. Each mode starts ``prefixserve serve`` as a user does, uploads the file
(``POST /v1/files``), creates the batch and polls it until it completes:

* ``planned``: ``--batch-grouping first_level`` (the default): rows whose prompts share a prefix run
  together (BatchLLM's grouping), so each document is computed about once;
* ``file_order``: ``--batch-grouping none``: rows in the file's order, as a client sending them one
  by one would; a KV pool smaller than the documents evicts a document between its questions.

Reported: seconds from create to completed, rows/s, the batch's prompt tokens and the share of them
served from the prefix cache (the batch's own usage), and whether both modes gave every row the same
(greedy) answer.

    python -m benchmarks.batch_api --device cpu
    python -m benchmarks.batch_api --device cuda --model dummy:llama-3.1-8b --docs 64 --doc-tokens 2000 \
        --questions 8 --gen 32 --num-kv-blocks 4000 --max-num-seqs 128

Writes docs/benchmarks/batch_api_{cpu,gpu}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, bar_chart, run_info, write_results
from benchmarks.harness.server import ServerProcess, serve_command

MODES = {"planned": "first_level", "file_order": "none"}


def _lines(args: argparse.Namespace, model: str) -> list[str]:
    rng = random.Random(0)
    docs = [[rng.randrange(100, 20000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    rows = []
    for d, doc in enumerate(docs):
        for q in range(args.questions):
            prompt = doc + [rng.randrange(100, 20000) for _ in range(12)]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.gen,
                "temperature": 0,
                "ignore_eos": True,
            }
            rows.append({"custom_id": f"d{d}-q{q}", "method": "POST", "url": "/v1/completions", "body": body})
    rng.shuffle(rows)
    return [json.dumps(r) for r in rows]


def _call(url: str, method: str = "GET", body: bytes | None = None, ctype: str = "application/json") -> Any:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": ctype})
    with urllib.request.urlopen(req, timeout=600) as r:
        data = r.read()
    return json.loads(data) if ctype == "application/json" or data[:1] == b"{" else data


def _upload(url: str, data: bytes) -> str:
    """A batch input file through ``POST /v1/files`` (multipart/form-data, built by hand: stdlib only)."""
    b = uuid.uuid4().hex
    head = (
        f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    )
    body = head.encode() + data + f"\r\n--{b}--\r\n".encode()
    return str(_call(url + "/v1/files", "POST", body, f"multipart/form-data; boundary={b}")["id"])


def _texts(url: str, file_id: str) -> dict[str, str]:
    raw = urllib.request.urlopen(f"{url}/v1/files/{file_id}/content", timeout=600).read().decode()
    rows = [json.loads(line) for line in raw.splitlines()]
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}


def _run_mode(args: argparse.Namespace, grouping: str, data: bytes, log: Path) -> dict[str, Any]:
    cmd = serve_command(args, "--batch-grouping", grouping, "--dtype", args.dtype)
    server = ServerProcess(cmd, log, grouping)
    server.launch(timeout=900)
    try:
        url = server.url
        warm = _upload(url, b"\n".join(data.splitlines()[: args.max_num_seqs]))  # graphs, kernels: untimed
        _wait(url, _call(url + "/v1/batches", "POST", _batch_body(warm))["id"])
        _call(url + "/reset_prefix_cache", "POST", b"{}")
        file_id = _upload(url, data)
        t0 = time.perf_counter()
        batch = _wait(url, _call(url + "/v1/batches", "POST", _batch_body(file_id))["id"])
        seconds = time.perf_counter() - t0
        assert batch["status"] == "completed", batch
        usage = batch["usage"]
        return {
            "seconds": seconds,
            "rows": batch["request_counts"]["completed"],
            "failed": batch["request_counts"]["failed"],
            "prompt_tokens": usage["input_tokens"],
            "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
            "output_tokens": usage["output_tokens"],
            "texts": _texts(url, batch["output_file_id"]),
        }
    finally:
        server.terminate()


def _batch_body(file_id: str) -> bytes:
    return json.dumps(
        {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    ).encode()


def _wait(url: str, batch_id: str) -> dict[str, Any]:
    while True:
        batch = _call(f"{url}/v1/batches/{batch_id}")
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return dict(batch)
        time.sleep(0.05)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    data = "\n".join(_lines(args, "default")).encode()  # "default": whatever model the server serves
    results: dict[str, dict[str, Any]] = {}
    texts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, grouping in MODES.items():
            row = _run_mode(args, grouping, data, Path(tmp) / f"{mode}.log")
            texts[mode] = row.pop("texts")
            row["rows_per_s"] = row["rows"] / row["seconds"]
            row["cached_share"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
            results[mode] = row
            print(mode, row)
    return {
        "info": run_info(("transformers",)),
        "settings": vars(args),
        "results": results,
        "speedup": results["file_order"]["seconds"] / results["planned"]["seconds"],
        # fp32 answers match row for row; in bf16 a row's step shapes differ with the order (which rows
        # share its batch), and the rounding that follows can tip a near-tie
        "same_answers_share": sum(texts["planned"][k] == v for k, v in texts["file_order"].items())
        / max(1, len(texts["file_order"])),
        "pool_tokens": args.num_kv_blocks * 16,
        "document_tokens": args.docs * args.doc_tokens,
    }


def markdown(result: dict[str, Any], name: str) -> str:
    s, info, r = result["settings"], result["info"], result["results"]
    lines = [
        f"# The Batch API: planned order against file order ({s['device']})",
        "",
        f"`python -m benchmarks.batch_api --device {s['device']} --model {s['model']} --docs {s['docs']} "
        f"--doc-tokens {s['doc_tokens']} --questions {s['questions']} --gen {s['gen']} "
        f"--num-kv-blocks {s['num_kv_blocks']} --max-num-seqs {s['max_num_seqs']} "
        f"--max-num-batched-tokens {s['max_num_batched_tokens']}`: {s['docs']} documents of "
        f"{s['doc_tokens']} tokens, {s['questions']} questions each, {s['gen']} tokens generated a row, in "
        f"{s['dtype']}; {result['document_tokens']:,} document tokens against a KV pool of "
        f"{result['pool_tokens']:,}. Each mode is a fresh `prefixserve serve`, warmed with a batch of its "
        "first rows, its prefix cache reset before the timed batch.",
        "",
        "| mode | seconds | rows/s | prompt tokens | from the prefix cache |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode, row in r.items():
        lines.append(
            f"| {mode} (`--batch-grouping {MODES[mode]}`) | {row['seconds']:.2f} | {row['rows_per_s']:.1f} | "
            f"{row['prompt_tokens']:,} | {row['cached_share']:.1%} |"
        )
    lines += [
        "",
        f"The planned order finishes the batch **{result['speedup']:.2f}x** faster than the file's order; "
        f"{result['same_answers_share']:.1%} of the rows got the same greedy answer in both modes"
        + (
            "."
            if result["same_answers_share"] == 1
            else f" (in {s['dtype']} a row's batch, and so its rounding, depends on the order; "
            "the CPU run in float32 matches row for row)."
        ),
        "",
        f"Device: {info['device']} ({info['cpu_count']} CPUs); torch {info['torch']}, "
        f"commit {info['commit']}, {info['date']}.",
        "",
        f"![seconds]({name}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Any) -> None:
    s = result["settings"]
    title = f"{s['docs']} docs x {s['questions']} questions, {s['device']}"
    bar_chart(
        path, result["results"], "seconds", "seconds to complete the batch", title, ["#3b7dd8", "#888888"]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="the KV pool (16-token blocks)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--server-arg", action="append", default=[], help="passed on to prefixserve serve")
    ap.add_argument("--name", default=None, help="result file name (default batch_api_cpu / batch_api_gpu)")
    args = ap.parse_args(argv)
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.model = args.model or "default"
    name = args.name or ("batch_api_cpu" if args.device == "cpu" else "batch_api_gpu")
    result = measure(args)
    write_results(name, result, markdown(result, name))
    plot(result, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
