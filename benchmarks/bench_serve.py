"""Time to first token of a conversation's second turn through `kimi-run --serve`, with the prompt
cache (the default) and without it (`--no-prompt-cache`), on a synthetic q2 model whose experts do
not fit the memory budget (the budget leaves room for a quarter of them). Prints one JSON object.

    python benchmarks/bench_serve.py [--dir /var/tmp/kimi-bench] [--conversations 3] [--cache-share 0.25]

Each conversation: a first turn (a long system message and a question, 16 tokens answered), then a
second turn that re-sends all of it plus a new question, streamed; the time to its first content
event is measured from the client (the real `openai` package), and the server's own counters say
how many prompt tokens it computed and how many expert bytes it read.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 4096,
            "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
            "num_hidden_layers": 8, "num_attention_heads": 8, "kv_lora_rank": 128, "q_lora_rank": 256,
            "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64, "n_routed_experts": 64,
            "num_experts_per_tok": 6, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1}


def make_model(d: Path) -> Path:
    """The synthetic file, with the bundled model's tokenizer (it has a chat template)."""
    out = d / "serve-q2.kst"
    if out.exists():
        return out
    src = d / "serve-src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(GEOMETRY))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "stdlib-moe" / name, src / name)
    subprocess.run(["kimi-convert", "--synthetic", str(src / "config.json"), "-o", str(out), "--quant", "q2",
                    "--quiet"], check=True)
    return out


def plan(weights: Path, budget: str | None) -> dict:
    cmd = ["kimi-run", "--weights", str(weights), "--dry-run", "--json", "--quiet", "--max-context", "2048"]
    out = subprocess.run(cmd + (["--memory-budget", budget] if budget else []), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["memory_plan"]


def metrics(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {k: float(v) for k, v in re.findall(r"^(kimi_\w+) (\S+)$", text, re.M)}


def conversation(i: int) -> tuple[list, str]:
    system = (f"You are reviewing module number {i}. " +
              " ".join(f"Rule {k}: functions named step_{k}_{i} must return a list of integers." for k in range(40)))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"def step_{i}(values):"}], \
        f"class Reader{i}:\n    def __init__(self, path):"


def run_server(weights: Path, budget: str, extra: list[str], conversations: int) -> dict:
    import openai
    proc = subprocess.Popen(["kimi-run", "--weights", str(weights), "--serve", "--port", "0", "--memory-budget", budget,
                             "--max-context", "2048", *extra], stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise SystemExit(f"the server did not start: {proc.stderr.read()}")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rows = []
        for i in range(conversations):
            msgs, follow_up = conversation(i)
            r1 = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=16)
            msgs = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                           {"role": "user", "content": follow_up}]
            before = metrics(url)
            t0 = time.perf_counter()
            ttft = None
            usage = None
            for ch in client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True}):
                if ttft is None and ch.choices and ch.choices[0].delta.content:
                    ttft = time.perf_counter() - t0
                usage = ch.usage or usage
            after = metrics(url)
            rows.append({"ttft_s": round(ttft, 3), "prompt_tokens": usage.prompt_tokens,
                         "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                         "computed_tokens": int(after["kimi_prompt_tokens_computed_total"]
                                                - before["kimi_prompt_tokens_computed_total"]),
                         "expert_bytes_read": int(after["kimi_expert_bytes_read_total"]
                                                  - before["kimi_expert_bytes_read_total"])})
        return {"turns": rows, "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
                "peak_rss_bytes": int(metrics(url)["kimi_peak_rss_bytes"])}
    finally:
        proc.send_signal(2)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kimi-bench")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--cache-share", type=float, default=0.25, help="share of the experts the budget leaves room for")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    weights = make_model(d)
    p = plan(weights, None)
    fixed = p["baseline"] + p["resident"] + p["metadata"] + p["kv_cache"] + p["activations"]
    budget = str(int(fixed + args.cache_share * p["total_experts"] * p["expert_bytes"]))
    capped = plan(weights, budget)
    assert capped["cache_experts"] < capped["total_experts"], capped
    result = {"weights": str(weights), "file_bytes": weights.stat().st_size, "budget_bytes": int(budget),
              "expert_cache": f"{capped['cache_experts']} of {capped['total_experts']} experts"}
    for name, extra in (("prompt_cache", []), ("no_prompt_cache", ["--no-prompt-cache"])):
        result[name] = run_server(weights, budget, extra, args.conversations)
    result["ttft_ratio_without_over_with"] = round(result["no_prompt_cache"]["median_ttft_s"]
                                                   / result["prompt_cache"]["median_ttft_s"], 2)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
