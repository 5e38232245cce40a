"""The streaming engine: output is the same under any feasible budget, in either I/O mode, with or
without prefetch; peak RSS (the kernel's VmHWM via getrusage) stays within --memory-budget when the
routed experts are 4x the expert cache; impossible budgets, I/O errors and changed files fail
clearly; telemetry traces plot."""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kimistream.formats.presets import PrecisionPlan
from kimistream.convert.synthetic import write_synthetic
from kimistream.formats.weightfile import WeightFile
from kimistream.runtime.generate import GenerationStats, generate
from kimistream.runtime.model import Model
from kimistream.runtime.pager import ExpertReadError
from kimistream.runtime.sampler import Sampler
from kimistream.runtime.weights import ModelWeights

DATA = Path(__file__).parent / "data"
GEOMETRY = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 768, "num_hidden_layers": 4,
            "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "qk_nope_head_dim": 32, "n_routed_experts": 32, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
            "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn")
    (d / "config.json").write_text(json.dumps(GEOMETRY))
    return write_synthetic(d / "config.json", d / "syn.kst", PrecisionPlan.from_preset("f32"), seed=1)


def kimi_run(*args):
    return subprocess.run([sys.executable, "-m", "kimistream.runtime.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


PROMPT = list(range(3, 60, 2))


def _run(path, **kw):
    w = ModelWeights(path, **kw)
    w.load_resident()
    m = Model(w, 128)
    logits = m.prefill(PROMPT, 7, all_logits=True)
    m.reset()
    tokens = list(generate(m, PROMPT, 12, Sampler(0.0), 5))
    stats = w.pager.stats
    w.close()
    return logits, tokens, stats


def test_same_output_under_any_budget_mode_and_prefetch(synthetic):
    ref_logits, ref_tokens, _ = _run(synthetic)
    expert = max(e.nbytes for e in ModelWeights(synthetic).file.extents if e.kind == "expert")
    seen_evictions = False
    for io in ("mmap", "pread"):
        for cache in (2, 5, 40):
            for prefetch in ("off", "next-layer"):
                for policy in ("lru", "lfru"):
                    logits, tokens, stats = _run(synthetic, io=io, cache_bytes=cache * expert, policy=policy,
                                                 prefetch=prefetch)
                    case = (io, cache, prefetch, policy)
                    np.testing.assert_array_equal(logits, ref_logits, err_msg=str(case))
                    assert tokens == ref_tokens, case
                    seen_evictions |= stats.evictions > 0
                    if prefetch == "next-layer":
                        assert stats.routed_checked > 0, case      # predictions were made and scored
                        if cache == 40:
                            # A two-slot pool may rightly refuse every guess (a demand read always
                            # keeps a slot); a roomy cache must start speculative reads.
                            assert stats.prefetched > 0, case
    assert seen_evictions


def test_direct_io_matches(synthetic):
    ref_logits, ref_tokens, _ = _run(synthetic)
    try:
        logits, tokens, _ = _run(synthetic, io="pread", cache_bytes=3 << 20, direct=True)
    except ExpertReadError as e:       # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    np.testing.assert_array_equal(logits, ref_logits)


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_peak_rss_within_budget_when_experts_are_4x_the_cache(synthetic, io):
    # the plan of chunks alone (at 10G the default window would be the whole context)
    plan = json.loads(kimi_run("--weights", synthetic, "--dry-run", "--json", "--memory-budget", "10G",
                               "--max-context", 256, "--prefill-batch-size", 8, "--prompt-window", 8,
                               "--quiet").stdout)["memory_plan"]
    expert, total = plan["expert_bytes"], plan["total_experts"]
    cache = total // 6
    # Baseline RSS is measured at start-up by the run itself; leave a margin for its variation.
    budget = plan["baseline"] + plan["resident"] + plan["metadata"] + plan["kv_cache"] + plan["activations"] \
        + cache * expert + (8 << 20)
    prompt = "".join(chr(33 + (i * 7) % 90) for i in range(120))
    proc = kimi_run("--weights", synthetic, "--prompt", prompt, "--max-tokens", 24, "--json", "--io", io,
                    "--memory-budget", budget, "--max-context", 256, "--prefill-batch-size", 8)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    st = rep["stats"]
    assert total * expert >= 4 * st["expert_cache_experts"] * expert
    assert st["experts_touched"] > st["expert_cache_experts"]       # the cache really had to evict
    assert st["evictions"] > 0
    assert st["peak_rss_bytes"] <= budget, (st["peak_rss_bytes"], budget, proc.stderr)


def test_a_kl_reference_opens_within_the_same_budget(synthetic, tmp_path):
    """--perplexity with --kl-reference holds two files: the first leaves half its expert cache's room
    to the reference, which plans with what the first will still take counted out, so peak RSS stays
    within --memory-budget (it had reached 178 MiB under 124); a budget too small for both is refused
    in one line."""
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(33 + (i * 7) % 90) for i in range(300)))
    budget = 130_000_000
    r = kimi_run("--weights", synthetic, "--perplexity", text, "--max-context", 64, "--memory-budget", budget,
                 "--kl-reference", synthetic, "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["quality"]["kl_mean"] == 0.0 and out["peak_rss_bytes"] <= budget, out["peak_rss_bytes"]
    r = kimi_run("--weights", synthetic, "--perplexity", text, "--max-context", 64, "--memory-budget", 75_000_000,
                 "--kl-reference", synthetic, "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "will still take" in lines[0] and "Traceback" not in r.stderr


def test_chat_on_a_model_without_a_template_is_refused_before_loading(synthetic):
    """The synthetic byte tokenizer has no chat template: --chat says so before the resident weights
    load (it had loaded them, then failed on every message)."""
    r = kimi_run("--weights", synthetic, "--chat", "--prompt", "hi", "--max-tokens", 2)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"kimi-run: error: {synthetic}: this model's tokenizer has no chat template (drop --chat)"
    assert "layers (" not in r.stderr                   # the start-up report comes after the resident load


def test_impossible_budget_refused_before_loading(synthetic):
    proc = kimi_run("--weights", synthetic, "--prompt", "hi", "--memory-budget", "20M")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "cannot hold the minimum" in err and "raise --memory-budget to at least" in err
    proc = kimi_run("--weights", synthetic, "--prompt", "hi", "--memory-budget", "75M", "--max-context", 100000)
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "lower --max-context from 100000 to" in err


def test_pread_io_error_is_clear(synthetic, tmp_path):
    copy = tmp_path / "c.kst"
    copy.write_bytes(synthetic.read_bytes())
    w = ModelWeights(copy, io="pread", cache_bytes=4 << 20)
    w.load_resident()
    m = Model(w, 64)
    first_expert = min(e.offset for e in w.file.extents if e.kind == "expert")
    os.truncate(copy, first_expert + 1000)                  # the file shrinks under the running model
    with pytest.raises(ExpertReadError, match=r"c\.kst: .*expert"):
        for _ in range(8):
            m.forward(PROMPT[:8])
    w.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_reads_count_their_cpu_time(synthetic, io):
    """The pager's account of the CPU time expert reads took (the copy or mapping, the first-read
    checksum), on whichever thread ran them: it grows while experts are read and not while every
    expert comes from the cache."""
    w = ModelWeights(synthetic, io=io, cache_bytes=64 << 20)
    w.load_resident()
    m = Model(w, 64)
    m.forward(PROMPT[:8])
    st = w.pager.stats
    read, cpu = st.bytes_read, st.read_cpu_s
    assert read > 0 and cpu > 0
    m.reset()
    m.forward(PROMPT[:8])
    assert st.bytes_read == read and st.read_cpu_s == cpu
    w.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_an_expert_read_ahead_of_its_use_is_a_miss_under_every_io(synthetic, io):
    """A hit is a use no read was started for: an expert fetch_ahead read (and that landed before its
    use) counts as a miss under pread as under mmap, and only its second use is a hit."""
    from kimistream.runtime.pager import MmapPager, PreadPager
    wf = WeightFile(synthetic)
    expert = max(e.nbytes for e in wf.extents if e.kind == "expert")
    p = (PreadPager if io == "pread" else MmapPager)(wf, 8 * expert)
    p.fetch_ahead(1, [0, 1])
    p._pool.submit(lambda: None).result()           # the pool's reads have landed (one thread at a time)
    p.close()
    p.get(1, 0)
    p.get_many(1, [1])
    assert (p.stats.hits, p.stats.misses) == (0, 2)
    p.get(1, 0)
    assert p.held(1, [0, 1]) is not None
    assert (p.stats.hits, p.stats.misses) == (3, 2)
    wf.close()


def test_the_summary_counts_only_the_measured_run(synthetic, tmp_path):
    """With --warm-up the pager's totals hold the warm-up's reads too; the summary reports the measured
    run's: its bytes read, hits and misses are the sums of its own steps in the trace."""
    trace = tmp_path / "t.jsonl"
    r = kimi_run("--weights", synthetic, "--prompt", "abcdefghij", "--max-tokens", "4", "--memory-budget", "72M",
                 "--json", "--quiet", "--warm-up", "--threads", "1", "--trace", trace)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    for k in ("bytes_read", "hits", "misses"):
        assert st[k] == sum(s[k] for s in steps), k
    assert st["bytes_read"] > 0


def test_trace_and_plot(synthetic, tmp_path):
    trace, png = tmp_path / "t.jsonl", tmp_path / "t.png"
    # the prompt's 10 tokens in windows of 8 a layer at a time (chunks of 4): a record a window
    proc = kimi_run("--weights", synthetic, "--prompt", "abcdefghij", "--max-tokens", 6, "--trace", trace,
                    "--prefill-batch-size", 4, "--prompt-window", 8, "--quiet")
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(l) for l in trace.read_text().splitlines()]
    assert [r["phase"] for r in recs] == ["prefill"] * 2 + ["decode"] * 5
    assert [r["tokens"] for r in recs[:2]] == [8, 2]
    for r in recs:
        assert r["rss_bytes"] >= r["rss_anon_bytes"] > 0 and r["wall_s"] >= r["compute_s"] >= 0
        assert r["read_cpu_s"] >= 0 and (r["read_cpu_s"] > 0 or not r["bytes_read"])
    proc = kimi_run("--plot-trace", trace, "-o", png)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_for_kimi_k2_config():
    proc = kimi_run("--plan-config", DATA / "kimi-k2-instruct-config.json", "--quant", "q2",
                    "--memory-budget", "8.24G", "--max-context", 4096, "--json")
    rep = json.loads(proc.stdout)
    plan = rep["memory_plan"]
    assert rep["file_bytes"] > 250e9                       # ~1 T parameters at ~2 bits
    assert plan["total_experts"] == 60 * 384
    assert plan["kv_cache"] == 2 * 4096 * 61 * 576                # f16: the default for quantized experts
    assert "KV cache: f16 (experts at q2" in proc.stderr
    assert "memory plan for a budget of 7.67 GiB" in proc.stderr
    assert ("verdict: fits" in proc.stderr) == (proc.returncode == 0)
    # The baseline is the recorded one for a run of this geometry, whatever the planning process holds
    from kimistream.runtime import budget as B
    assert plan["baseline_recorded"] is True
    assert plan["baseline"] == B.RECORDED_BASELINE + 60 * 384 * B.RECORDED_BASELINE_PER_EXPERT
    assert "baseline (interpreter, libraries, recorded)" in proc.stderr


def test_auto_fit_chooses_f16_then_a_shorter_context_and_never_overrides_a_flag():
    """planner.auto_fit on a plan whose fixed part is the KV cache (context x bytes per value): f16
    first, then the longest context that fits; a flag the user gave is never changed, and when nothing
    of at least MIN_AUTO_CONTEXT fits, nothing changes (the refusal and its advice follow)."""
    import types
    from kimistream.runtime import planner

    def replan_for(args, budget):
        def replan(ctx, chunk):
            itemsize = 2 if args.kv_dtype == "f16" else 4
            return types.SimpleNamespace(fits=(ctx or args.max_ctx) * itemsize + chunk <= budget)
        return replan

    def run(budget, kv=None, max_context=None, batch=None):
        args = types.SimpleNamespace(kv_dtype=kv, max_context=max_context, max_ctx=max_context or 4096,
                                     prefill_batch_size=batch)
        said = []
        planner.auto_fit(args, replan_for(args, budget), said.append)
        return args.kv_dtype, args.max_ctx, said
    assert run(4 * 4096 + 16) == (None, 4096, [])                      # fits as it is
    kv, ctx, said = run(2 * 4096 + 16)
    assert (kv, ctx) == ("f16", 4096) and len(said) == 1 and said[0].startswith("KV cache: f16")
    kv, ctx, said = run(2 * 1000 + 16)
    assert (kv, ctx) == ("f16", 1000) and said[1].startswith("max context: 1000 tokens (4096 does not fit")
    assert run(4 * 1000 + 16, kv="f32")[:2] == ("f32", 1000)           # --kv-dtype given: kept
    assert run(2 * 1000 + 16, max_context=4096) == (None, 4096, [])   # --max-context given: kept
    assert run(2 * 10 + 16) == (None, 4096, [])                        # nothing >= 64 tokens fits


def test_tight_budget_run_works_with_default_flags(synthetic):
    """A budget below what the default context and an f32 KV cache need: kimi-run adapts and runs
    (peak RSS inside the budget) instead of refusing."""
    def fixed(*flags):
        proc = kimi_run("--weights", synthetic, "--dry-run", "--json", "--memory-budget", "10G",
                        "--prefill-batch-size", 16, *flags)
        p = json.loads(proc.stdout.strip().splitlines()[-1])["memory_plan"]
        return p["baseline"] + p["resident"] + p["metadata"] + p["kv_cache"] + p["activations"], p
    small, p = fixed("--max-context", 64, "--kv-dtype", "f16")
    full, _ = fixed("--kv-dtype", "f32")
    budget = small + p["min_cache_experts"] * p["expert_bytes"] + (512 << 10)
    assert full + p["min_cache_experts"] * p["expert_bytes"] > budget + (512 << 10)
    prompt = "".join(chr(97 + i % 26) for i in range(40))
    run = kimi_run("--weights", synthetic, "--prompt", prompt, "--max-tokens", 8, "--json", "--memory-budget", budget,
                   "--prefill-batch-size", 16)
    assert run.returncode == 0, run.stderr
    assert "KV cache: f16" in run.stderr or "max context:" in run.stderr
    assert json.loads(run.stdout)["stats"]["peak_rss_bytes"] <= budget


def test_auto_prefetch_guesses_whatever_the_cache_holds(synthetic, monkeypatch):
    """--prefetch auto (the default) guesses the next layer's experts with a cache short of the whole
    file as with one that holds them all (judged as it goes: see the tests below); how much the cache
    holds is in the run's report. (The fresh file is in the page cache: pausing is tested below.)"""
    from kimistream.runtime import weights as W
    monkeypatch.setattr(W, "GUESS_IDLE_READS", 1 << 30)
    w = ModelWeights(synthetic)
    expert, total = w.expert_extent_bytes, len(w._extents("expert"))
    w.close()
    _, _, small = _run(synthetic, cache_bytes=(total - 1) * expert, prefetch="auto")
    assert small.prefetched > 0 and small.routed_checked > 0
    w = ModelWeights(synthetic, cache_bytes=(total - 1) * expert, prefetch="auto")
    assert w.wants_guesses and w.prefetch_policy == (
        f"next-layer: the cache holds {total - 1} of {total} experts (auto; timed against no guesses in the first "
        f"decode steps, pauses while reads come from the page cache, stops if fewer than 50% of guesses are used)")
    w.close()
    _, _, off = _run(synthetic, cache_bytes=(total - 1) * expert, prefetch="off")
    assert off.prefetched == 0 and off.routed_checked == 0
    _, _, roomy = _run(synthetic, prefetch="auto")
    assert roomy.routed_checked > 0
    proc = kimi_run("--weights", synthetic, "--prompt", "hello", "--max-tokens", 4, "--json",
                    "--memory-budget", "10G")
    assert json.loads(proc.stdout)["stats"]["prefetch_policy"].startswith("next-layer: the cache holds all experts")


def test_auto_prefetch_plans_room_for_guesses_unless_it_halves_the_prompt_window():
    """--prefetch auto plans, as next-layer does, twice a token's experts of a layer where the budget
    allows (what the fit chooses gives way); where the room would halve the
    default prompt window (Kimi K2 in 8.24 GB: 704 tokens against 192) the window stays and the cache
    is off's."""
    def plan(prefetch, *extra):
        proc = kimi_run("--plan-config", DATA / "kimi-k2-instruct-config.json", "--quant", "q2",
                        "--memory-budget", "8.0G", "--prefetch", prefetch, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["memory_plan"], proc.stderr
    off, _ = plan("off", "--prompt-window", 64)
    auto, _ = plan("auto", "--prompt-window", 64)
    nxt, _ = plan("next-layer", "--prompt-window", 64)
    assert off["min_cache_experts"] == 8 and off["cache_experts"] < 16
    assert auto["min_cache_experts"] == nxt["min_cache_experts"] == 16 and auto["cache_experts"] >= 16
    assert auto == nxt
    proc = kimi_run("--plan-config", DATA / "kimi-k2-instruct-config.json", "--quant", "q2",
                    "--memory-budget", "8.24G", "--max-context", 4096, "--json")
    assert "prompt window: 704 tokens" in proc.stderr
    assert json.loads(proc.stdout)["memory_plan"]["min_cache_experts"] == 8


def test_auto_prefetch_makes_no_guesses_where_a_layers_experts_leave_no_room_for_them(synthetic):
    """A cache of fewer than twice a token's experts of a layer (top-2 here: the plan's fallback where
    the budget has no room for guesses): a guess could only take the slot of an expert the layer in
    use still needs; --prefetch auto makes none and says why (an explicit next-layer still guesses)."""
    w = ModelWeights(synthetic)
    expert = w.expert_extent_bytes
    w.close()
    for slots, guesses in ((3, False), (4, True)):
        w = ModelWeights(synthetic, cache_bytes=slots * expert, prefetch="auto")
        assert w.wants_guesses == guesses and (w.pager.guess_trial is not None) == guesses, slots
        if not guesses:
            assert w.prefetch_policy == "off: the cache holds 3 experts, too few for a layer's 2 and as many guesses (auto)"
        w.close()
        _, _, st = _run(synthetic, cache_bytes=slots * expert, prefetch="auto")
        assert (st.routed_checked > 0) == guesses, slots
    _, _, st = _run(synthetic, cache_bytes=3 * expert, prefetch="next-layer")
    assert st.routed_checked > 0


def test_auto_prefetch_stops_when_guesses_are_mostly_wrong(synthetic, monkeypatch):
    """--prefetch auto judges its guesses once GUESS_TRIAL routed experts were scored, and stops for
    the rest of the run when fewer than GUESS_MIN_RECALL of them were used (here: an impossible bar)."""
    from kimistream.runtime import weights as W
    monkeypatch.setattr(W, "GUESS_TRIAL", 1)
    monkeypatch.setattr(W, "GUESS_MIN_RECALL", 1.01)
    w = ModelWeights(synthetic, prefetch="auto")
    w.load_resident()
    assert w.wants_guesses
    m = Model(w, 64)
    m.prefill(PROMPT[:8], 8)
    for _ in range(4):
        m.forward([5])
    assert not w.wants_guesses and w.prefetch_policy.startswith("stopped: ")
    checked = w.pager.stats.routed_checked
    m.forward([5])
    assert w.pager.stats.routed_checked == checked          # no guess made or scored after stopping
    w.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_auto_prefetch_pauses_while_the_page_cache_serves_every_read(synthetic, monkeypatch, io):
    """--prefetch auto stops guessing while GUESS_IDLE_READS reads in a row found their expert in the
    page cache (nothing to read ahead), and guesses again from the first read that does not."""
    from kimistream.runtime import weights as W
    monkeypatch.setattr(W, "GUESS_IDLE_READS", 3)
    w = ModelWeights(synthetic, io=io, prefetch="auto", cache_bytes=256 << 20)
    w.load_resident()
    served = {"cache": True}
    monkeypatch.setattr(w.pager, "cached_share", lambda off, n: 1.0 if served["cache"] else 0.5)
    m = Model(w, 64)
    m.prefill(PROMPT[:8], 8)
    assert not w.wants_guesses and w.prefetch_policy.startswith("paused: ")
    checked = w.pager.stats.routed_checked
    for t in range(6):
        m.forward([t + 3])
    assert w.pager.stats.routed_checked == checked          # no guess made while paused
    served["cache"] = False                                 # the next read comes from disk
    w.pager._cache.clear()
    w.pager.cached_bytes = 0
    if io == "pread":
        w.pager._free = list(range(w.pager.slots))
    m.forward([9])
    assert w.wants_guesses and w.prefetch_policy.startswith("next-layer: resumed")
    m.forward([10])
    assert w.pager.stats.routed_checked > checked
    w.close()


def test_o_direct_reads_never_count_as_page_cache_reads(synthetic):
    w = ModelWeights(synthetic, io="pread", direct=True, prefetch="auto", cache_bytes=16 << 20)
    ext = next(e for e in w.file.extents if e.kind == "expert")
    w.pager.watch_reads = True
    w.pager._note_read((0, 0), ext.offset, ext.nbytes)
    assert w.pager.cached_reads == 0
    w.close()


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds address `addr` (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                    reason="needs Linux's smaps and madvise(MADV_HUGEPAGE)")
def test_the_read_pool_is_private_memory_asking_for_huge_pages(synthetic):
    # O_DIRECT reads into scattered 4 KiB pages ran at half the disk's speed (see pager.read_buffer):
    # the pool must not be shared memory (shmem takes no transparent huge pages here) and must ask for them
    w = ModelWeights(synthetic, io="pread", direct=False, cache_bytes=16 << 20)
    flags = _vma_flags(w.pager.base.ctypes.data)
    assert "hg" in flags and "sh" not in flags, flags
    w.close()


def _k278(tmp_path) -> Path:
    cfg = json.loads((DATA / "kimi-k2-instruct-config.json").read_text())
    cfg["n_routed_experts"] = 1048
    path = tmp_path / "k278.json"
    path.write_text(json.dumps(cfg))
    return path


def kimi_convert(*args):
    return subprocess.run([sys.executable, "-m", "kimistream.convert.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def test_plan_for_a_k2_geometry_with_1048_experts(tmp_path):
    """Kimi K2's config with 1 048 routed experts (2.78 T parameters) at 8.24 GB and 4096 tokens: the
    q2 preset's resident set does not fit, so --plan-config lowers resident classes (the cheapest KL
    per byte first: the float32 routers to q8), says so with the flags that convert the file that
    way, and fits; kimi-convert --memory-budget makes the same choice; a budget nothing fits is
    still refused with advice, and nothing is lowered for it."""
    path = _k278(tmp_path)
    proc = kimi_run("--plan-config", path, "--quant", "q2", "--memory-budget", "8.24G", "--max-context", 4096, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "resident: router f32 → q8" in proc.stderr and "--override 'mlp\\.gate\\.weight$=q8'" in proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["memory_plan"]["fits"] and rep["classes"]["router"] == "q8"
    assert [s["class"] for s in rep["resident_steps"]] == ["router"]
    conv = kimi_convert("--synthetic", path, "--quant", "q2", "--memory-budget", "8.24G", "--max-context", 4096,
                        "--dry-run", "--json")
    assert conv.returncode == 0, conv.stderr
    dry = json.loads(conv.stdout)
    assert dry["classes"] == rep["classes"] and dry["memory_fit"]["memory_plan"]["fits"]
    assert dry["memory_fit"]["memory_plan"]["resident"] == rep["memory_plan"]["resident"]
    proc = kimi_run("--plan-config", path, "--quant", "q2", "--memory-budget", "3G", "--max-context", 4096)
    assert proc.returncode == 1 and "cannot hold the minimum" in proc.stderr and "resident: router" not in proc.stderr
    conv = kimi_convert("--synthetic", path, "--quant", "q2", "--memory-budget", "3G", "--max-context", 4096, "--dry-run")
    assert conv.returncode == 2 and conv.stderr.count("\n") == 1 and "cannot hold this model" in conv.stderr


def _budget_between(cfg_path: Path, ctx: int) -> int:
    """A budget the q2 preset misses but its lowest rungs fit, planned as kimi-convert plans."""
    from kimistream.formats import memplan
    from kimistream.formats.config import ModelConfig
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))

    def need(classes=None):
        p = PrecisionPlan.from_preset("q2").for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        p.classes.update(classes or {})
        fp, _ = memplan.of_config(cfg, p)
        plan = memplan.plan_for(cfg, fp, budget=0, baseline=memplan.recorded_baseline(fp.total_experts),
                                max_context=ctx, chunk=memplan.MIN_FIT_CHUNK, kv_itemsize=2)
        return plan.fixed + plan.min_cache_experts * plan.expert_bytes
    lowest = {}
    for cls in memplan.RESIDENT_LADDER:
        codec = PrecisionPlan.from_preset("q2").classes[cls]
        while memplan.next_rung(cls, codec):
            codec = memplan.next_rung(cls, codec)
        lowest[cls] = codec
    hi, lo = need(), need(lowest)
    assert lo < hi
    return (hi + lo) // 2


def test_convert_memory_budget_writes_the_precision_it_planned(tmp_path):
    """kimi-convert --memory-budget on a budget the preset misses: resident classes go down, the file
    records them, its resident bytes are what the plan predicted, and --plan-config chooses the same."""
    cfg_path = Path(__file__).resolve().parent.parent / "models" / "stdlib-moe" / "config.json"
    budget = _budget_between(cfg_path, 256)
    out = tmp_path / "fit.kst"
    flags = ("--memory-budget", budget, "--max-context", 256)
    proc = kimi_convert("--synthetic", cfg_path, "-o", out, "--quant", "q2", *flags, "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout)["memory_fit"]
    with WeightFile(out) as wf:
        classes = wf.header["plan"]["classes"]
        from kimistream.runtime import planner
        resident = planner.of_file(wf).resident
    preset = PrecisionPlan.from_preset("q2").classes
    lowered = {c for c in classes if classes[c] != preset[c]}
    assert lowered, classes
    rep = json.loads(kimi_run("--plan-config", cfg_path, "--quant", "q2", *flags, "--kv-dtype", "f16",
                              "--prefill-batch-size", 16, "--json").stdout)
    assert rep["classes"] == classes and rep["memory_plan"]["fits"]
    assert resident == rep["memory_plan"]["resident"] == fit["memory_plan"]["resident"]


def test_fit_resident_leaves_overridden_tensors_alone():
    """An explicit --override names tensors whose codec the fit must not change: lowering their class
    saves nothing, so that step is never taken, and their codec stays the override's."""
    from kimistream.formats import memplan
    from kimistream.formats.config import ModelConfig
    from kimistream.formats.constants import ROUTER
    cfg = ModelConfig.from_hf(json.loads((DATA / "kimi-k2-instruct-config.json").read_text()))
    p = PrecisionPlan.from_preset("q2", [f"{memplan.CLASS_PATTERNS[ROUTER]}=f32"])
    p.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    steps = memplan.fit_resident(cfg, p, lambda fp: False)        # nothing fits: every rung is taken
    assert steps and ROUTER not in {s.cls for s in steps}
    assert p.codec_for("model.layers.3.mlp.gate.weight", ROUTER, (384, 7168)) == "f32"
    lowest = {cls: lad[-1] for cls, lad in memplan.RESIDENT_LADDER.items() if cls != ROUTER}
    assert {cls: p.classes[cls] for cls in lowest} == lowest
    assert all(s.saved > 0 for s in steps)


def test_recorded_baseline_matches_a_dry_run(tiny_kst):
    """--plan-config's recorded baseline is what kimi-run measures before its first weight (within
    the slack it adds), for a file of the same geometry."""
    from kimistream.runtime import budget as B
    proc = kimi_run("--weights", tiny_kst, "--dry-run", "--json")
    measured = json.loads(proc.stdout)["memory_plan"]["baseline"]
    with WeightFile(tiny_kst) as wf:
        n_experts = sum(1 for e in wf.extents if e.kind == "expert")
    recorded = B.RECORDED_BASELINE + n_experts * B.RECORDED_BASELINE_PER_EXPERT
    assert abs(measured - recorded) <= B.RUNTIME_SLACK, (measured, recorded)


def test_f16_kv_cache_is_close_and_half_the_memory(synthetic):
    from kimistream.runtime.model import KVCache
    ref_logits, ref_tokens, _ = _run(synthetic)
    w = ModelWeights(synthetic)
    w.load_resident()
    m = Model(w, 128, kv_dtype="f16")
    logits = m.prefill(PROMPT, 7, all_logits=True)
    assert np.abs(logits - ref_logits).max() <= 2e-3 * np.abs(ref_logits).max()
    assert m.cache.latent[0].nbytes * 2 == KVCache(w.config, 128).latent[0].nbytes
    w.close()


def test_a_config_and_its_converted_file_get_the_same_plan(tmp_path):
    """One planner: --plan-config on a config and --dry-run on the file converted from it lay out the
    same resident set, experts, KV cache and buffers; only the header and tokenizer term is an
    estimate before conversion, and it errs on the safe side."""
    model = Path(__file__).resolve().parent.parent / "models" / "stdlib-moe"
    out = tmp_path / "q2.kst"
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(model), "-o", str(out), "--quant", "q2",
                           "--calibration", "none", "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    flags = ("--memory-budget", "600M", "--max-context", 512, "--prefill-batch-size", 64, "--json")
    from_config = json.loads(kimi_run("--plan-config", model / "config.json", "--quant", "q2", *flags).stdout)
    from_file = json.loads(kimi_run("--weights", out, "--dry-run", *flags).stdout)
    a, b = from_config["memory_plan"], from_file["memory_plan"]
    for key in ("resident", "expert_bytes", "total_experts", "kv_cache", "activations", "min_cache_experts"):
        assert a[key] == b[key], key
    assert b["metadata"] <= a["metadata"] <= b["metadata"] + (80 << 20)
    # the file's size as laid out (header, extents on 4 KiB boundaries): from a config alone with an
    # allowance for the tokenizer (on the safe side), from the checkpoint within 1 %
    from kimistream.formats.memplan import TOKENIZER_ALLOWANCE
    size = out.stat().st_size
    assert size <= from_config["file_bytes"] <= size + TOKENIZER_ALLOWANCE
    dry = json.loads(subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(model), "--quant", "q2",
                                     "--dry-run", "--json"], capture_output=True, text=True, timeout=600).stdout)
    assert abs(dry["file_bytes"] - size) <= 0.01 * size, (dry["file_bytes"], size)


def _evicted_and_not_cached(w):
    """Experts read and evicted since (not in the pager's cache now)."""
    cached = set(w.pager._cache)
    return [k for k in w.experts_touched if k not in cached]


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_page_cache_drop_gives_the_same_output_and_drops_evicted_pages(synthetic, io):
    ref_logits, ref_tokens, _ = _run(synthetic)
    expert = ModelWeights(synthetic).expert_extent_bytes
    for mode in ("keep", "drop", "auto"):
        logits, tokens, stats = _run(synthetic, io=io, cache_bytes=2 * expert, page_cache=mode)
        np.testing.assert_array_equal(logits, ref_logits, err_msg=mode)
        assert tokens == ref_tokens and stats.evictions > 0, mode
    # Start cold: a read with readahead (an unclosed weights object, kimi-verify, a plain pread) can
    # leave large page-cache folios that straddle two extents, and a drop of one extent's range
    # cannot remove those (Linux 6.x large folios). The pagers' own reads never read ahead.
    gc.collect()
    w = ModelWeights(synthetic, io=io, cache_bytes=2 * expert, page_cache="drop")
    os.posix_fadvise(w.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    probe = [e for e in w.file.extents if e.kind == "expert"][0]
    fd = os.open(synthetic, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    os.pread(fd, probe.nbytes, probe.offset)
    os.posix_fadvise(fd, probe.offset, probe.nbytes, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if w.pager.cached_share(probe.offset, probe.nbytes) > 0:
        w.close()
        pytest.skip("this filesystem keeps pages in memory whatever is advised (tmpfs)")
    w.load_resident()
    m = Model(w, 64)
    m.prefill(PROMPT, 8)
    gone = _evicted_and_not_cached(w)
    assert gone
    for layer, e in gone:
        off, n = w.pager.extent((layer, e))
        assert w.pager.cached_share(off, n) == 0, (layer, e)
    assert w.pager.page_cache_policy == "drop evicted experts"
    w.close()


@pytest.mark.parametrize("share,decision", [(0.0, "drop"), (0.9, "keep")])
def test_auto_page_cache_decides_from_what_the_page_cache_kept(synthetic, monkeypatch, share, decision):
    """--page-cache auto scores the misses of evicted experts after the first RELOAD_SKIP (how much of
    each the page cache still held) and, after RELOAD_TRIAL of them, keeps or drops evicted experts
    for the rest of the run (a drop also drops what the trial had kept); the report says which and
    why."""
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "RELOAD_SKIP", 2)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 4)
    w = ModelWeights(synthetic, cache_bytes=2 * ModelWeights(synthetic).expert_extent_bytes)
    p = w.pager
    p.cached_share = lambda off, n: share
    assert not p.drop_evicted and "deciding" in p.page_cache_policy
    at_decision, dropped = [], []

    class Noted(set):                  # what the trial left evicted, and what was held, when it decides
        def clear(self):
            at_decision.append((set(self), set(p._cache) | set(p._inflight)))
            super().clear()
    p._evicted = Noted()
    note = p._evicted_pages

    def recorded(key, off, n, **kw):
        if p.drop_evicted:
            dropped.append(key)
        note(key, off, n, **kw)
    p._evicted_pages = recorded
    w.load_resident()
    m = Model(w, 64)
    m.prefill(PROMPT, 8)
    for _ in range(3):
        m.forward([5])
    assert w.pager.stats.reloads == 4
    assert w.pager.drop_evicted == (decision == "drop")
    # a drop decision lets go at once of what the trial kept (evicted experts not read again)
    (left, held), = at_decision
    assert left - held
    assert (left - held <= set(dropped)) == (decision == "drop")
    assert w.pager.page_cache_policy == f"{decision} evicted experts (auto: {share:.0%} of 4 evicted experts " \
                                        f"were still cached when needed again)"
    w.close()
    proc = kimi_run("--weights", synthetic, "--prompt", "hello", "--max-tokens", 2, "--json", "--page-cache", "drop",
                    "--io", "mmap")
    assert json.loads(proc.stdout)["stats"]["page_cache_policy"] == "drop evicted experts", proc.stderr
    # --io auto (the default) drops by not letting the pages in: O_DIRECT reads from the start, timed
    # against the mapping's (IoTrial) from the third decode step
    stats = json.loads(kimi_run("--weights", synthetic, "--prompt", "hello", "--max-tokens", 2, "--json",
                                "--page-cache", "drop").stdout)["stats"]
    assert stats["page_cache_policy"] == "not used (O_DIRECT reads)"
    assert stats["io"] == "auto: O_DIRECT pread (a trial of O_DIRECT reads against the mapping under way when " \
                          "the run ended)"


def test_unused_guesses_are_not_evictions_and_an_uncapped_run_keeps_the_mapping(synthetic, monkeypatch):
    """A guess whose expert was not routed to says nothing about memory pressure: read again later, it
    is no reload of an evicted expert. With a cache that holds every expert nothing is evicted, so
    --io auto never times O_DIRECT against the mapping there (counted, warm runs' guesses had it do so,
    and a noisy win sent each expert's first use to the disk: 57 against 99 tok/s)."""
    from kimistream.runtime import pager as P
    from kimistream.runtime import weights as W
    monkeypatch.setattr(P, "RELOAD_SKIP", 0)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 1)
    monkeypatch.setattr(W, "GUESS_IDLE_READS", 1 << 30)        # guess though the file is in the page cache
    w = ModelWeights(synthetic, io="auto", prefetch="auto")
    first = w.pager
    w.load_resident()
    m = Model(w, 128)
    tokens = list(generate(m, PROMPT, 24, Sampler(0.0), 8))
    assert first.stats.prefetch_wasted_bytes > 0 and first.stats.evictions == 0     # guesses went unused
    assert first.stats.reloads == 0 and not first.keep_trial
    assert first.page_cache_policy == "keep (auto: the cache holds every expert, none is evicted)"
    assert w.pager is first and isinstance(first, P.MmapPager) and first.io_trial is None
    w.close()
    # short of every expert by one, the pager decides, and only evicted experts read again count
    total = len(w._extents("expert"))
    w = ModelWeights(synthetic, io="auto", prefetch="auto", cache_bytes=(total - 1) * w.expert_extent_bytes)
    w.load_resident()
    assert list(generate(Model(w, 128), PROMPT, 24, Sampler(0.0), 8)) == tokens
    st = w.pager.stats
    assert st.prefetch_wasted_bytes > 0 and st.reloads <= st.evictions
    w.close()
    # an eviction still counts: a cache of two experts makes the same run score its reloads
    w = ModelWeights(synthetic, io="mmap", cache_bytes=2 * w.expert_extent_bytes)
    w.load_resident()
    assert list(generate(Model(w, 128), PROMPT, 24, Sampler(0.0), 8)) == tokens
    assert w.pager.stats.evictions > 0 and w.pager.stats.reloads > 0
    w.close()


@pytest.mark.parametrize("faster", ["drop", "keep"])
def test_auto_page_cache_times_both_policies_when_the_share_does_not_tell(synthetic, monkeypatch, faster):
    """With a middling share of evicted experts still cached, --page-cache auto times decode steps
    (Telemetry hands each step's wall time to the pager) keeping, then dropping (the first step after
    the switch not scored), and stays with the faster (dropping by a margin); the switch keeps what
    keeping had left in the page cache (re-read later if keeping stays), a decision to drop lets it go."""
    from kimistream.runtime import pager as P
    from kimistream.runtime.telemetry import Telemetry
    monkeypatch.setattr(P, "RELOAD_SKIP", 2)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 4)
    w = ModelWeights(synthetic, cache_bytes=2 * ModelWeights(synthetic).expert_extent_bytes)
    p = w.pager
    p.cached_share = lambda off, n: 0.5
    steps = []
    observe = p.observe_step

    def timed(seconds, scored=True):    # the step's time as the policy in force makes it (slow after a switch)
        steps.append(p.drop_evicted)
        slow = p.drop_evicted != (faster == "drop")
        observe((0.03 if slow else 0.02) + (0.5 if len(steps) > 1 and steps[-1] != steps[-2] else 0.0))
    p.observe_step = timed
    w.load_resident()
    m = Model(w, 64)
    tokens = list(generate(m, PROMPT, 12, Sampler(0.0), 8, telemetry=Telemetry(p)))
    assert p.stats.reloads == 4 and len(tokens) == 12
    n = P.TIMED_STEPS * len(P.TIMED_ORDER)
    assert steps[:n] == [d for d in P.TIMED_ORDER for _ in range(P.TIMED_STEPS)]
    assert set(steps[n:]) == {faster == "drop"} and len(steps) == 11
    assert p.page_cache_policy == (f"{faster} evicted experts (auto: 50% of 4 evicted experts were still cached "
                                   f"when needed again; {20 if faster == 'drop' else 30}.0 ms per step dropping "
                                   f"them, {30 if faster == 'drop' else 20}.0 keeping)")
    # an expert evicted while keeping stays in the page cache through a dropping window, and goes at a
    # decision to drop
    kept = []
    p._deciding, p.drop_evicted = True, False
    p._evicted_pages(("x", 0), 0, 4096)
    p._evicted_pages = lambda key, off, n: kept.append(key)
    p.extent = lambda key: (0, 4096)
    p._set_dropping(True)
    assert kept == [] and p._evicted == {("x", 0)}
    p._decide(True)
    assert kept == [("x", 0)] and not p._evicted
    w.close()


def test_mmap_reads_in_flight_count_against_the_cache_and_spare_the_layers_experts(synthetic):
    """The mmap pager reserves room for a read when it starts (its pages arrive in memory before they
    are mapped): cached plus in-flight bytes never exceed the cache. Reading a layer's missing experts
    never evicts the experts of that layer already cached."""
    from kimistream.runtime.pager import MmapPager
    w = ModelWeights(synthetic, cache_bytes=3 * ModelWeights(synthetic).expert_extent_bytes)
    p = w.pager
    assert isinstance(p, MmapPager)
    seen = []
    start = p._start_prefetch

    def checked(key, speculative=True):
        start(key, speculative)
        seen.append(p.cached_bytes + p.inflight_bytes)
    p._start_prefetch = checked
    for e in (0, 1, 2):
        p.get(1, e)
    assert list(p._cache) == [(1, 0), (1, 1), (1, 2)]          # (1, 0) is the least recent
    p.fetch_ahead(1, [0, 3])                                     # (1, 0) about to be used, (1, 3) missing
    assert (1, 0) in p._cache and (1, 1) not in p._cache        # the room came from (1, 1)
    p.get(1, 0), p.get(1, 3)
    assert p.inflight_bytes == 0 and p.cached_bytes <= p.capacity
    p.prefetch(2, [4, 5, 6, 7])                                  # more guesses than the cache holds
    assert p.cached_bytes + p.inflight_bytes <= p.capacity and len(p._inflight) <= 3
    p.note_routed(2, [4])                                        # the other guesses were wrong
    assert all(k == (2, 4) for k in p._inflight)
    assert max(seen) <= p.capacity
    w.close()


def test_plan_config_overrides_reproduce_the_fitted_plan(tmp_path):
    """When a class goes down more than one rung, --plan-config's printed overrides still give the
    plan it fitted (one override per class, at its final codec), and a model without routed experts
    is held to the budget too."""
    import re as _re
    from kimistream.formats import memplan
    from kimistream.formats.config import ModelConfig
    cfg_path = DATA / "kimi-k2-instruct-config.json"
    proc = kimi_run("--plan-config", cfg_path, "--quant", "q4", "--memory-budget", "6G", "--max-context", 4096, "--json")
    rep = json.loads(proc.stdout)
    overrides = _re.findall(r"--override '([^']+)'", proc.stderr)
    assert rep["resident_steps"] and len(overrides) == len({s["class"] for s in rep["resident_steps"]})
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    p = PrecisionPlan.from_preset("q4", overrides).for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    assert memplan.of_config(cfg, p)[0].resident == rep["memory_plan"]["resident"]
    dense = json.loads((Path(__file__).resolve().parent.parent / "models" / "stdlib-moe" / "config.json").read_text())
    dense["first_k_dense_replace"] = dense["num_hidden_layers"]
    (tmp_path / "dense.json").write_text(json.dumps(dense))
    proc = kimi_convert("--synthetic", tmp_path / "dense.json", "--quant", "q2", "--memory-budget", "1M", "--dry-run")
    assert proc.returncode == 2 and "cannot hold this model" in proc.stderr


@pytest.fixture(scope="module")
def synthetic_q2(tmp_path_factory):
    d = tmp_path_factory.mktemp("synq2")
    (d / "config.json").write_text(json.dumps(GEOMETRY))
    return write_synthetic(d / "config.json", d / "q2.kst", PrecisionPlan.from_preset("q2"), seed=2)


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_warm_decode_steps_equal_the_general_expert_path(synthetic_q2, io, monkeypatch):
    """A decode step whose experts are all in memory takes them in one pass (ExpertProvider.held) and
    one kernel call with everything else worked out once (kernels.MoEStep): the same logits, hits,
    misses and experts touched as the general path (routed, together, moe_decode), under a cache that
    evicts and one that does not."""
    from kimistream.runtime import kernels
    path = synthetic_q2
    steps = []
    monkeypatch.setattr(kernels.MoEStep, "__call__",
                        lambda self, *a, _call=kernels.MoEStep.__call__: steps.append(1) or _call(self, *a))
    expert = max(e.nbytes for e in WeightFile(path).extents if e.kind == "expert")
    for cache in (6 * expert, 100 * expert):         # evicting; every expert of the 3 MoE layers
        seen = []
        for fast in (True, False):
            w = ModelWeights(path, io=io, cache_bytes=cache)
            if not fast:
                w.held = lambda layer, experts: None
            w.load_resident()
            m = Model(w, 128)
            logits = np.stack([m.forward([t]) for t in PROMPT * 2])
            st = w.pager.stats
            # pread's reads of a layer's missing experts finish on helper threads: whether one is
            # ready when asked (a hit) depends on timing there, the experts asked for do not
            counts = (st.hits, st.misses) if io == "mmap" else (st.hits + st.misses,)
            seen.append((logits, counts, len(w.experts_touched), w.expert_bytes_touched))
            w.close()
        np.testing.assert_array_equal(seen[0][0], seen[1][0])
        assert seen[0][1:] == seen[1][1:], (cache, seen[0][1:], seen[1][1:])
    assert steps                                    # the one-call path really ran


def test_observed_decode_steps_see_every_expert_and_the_one_call_step_returns_after(synthetic_q2, monkeypatch):
    """While calibration observes, a decode step takes the experts one at a time (their inputs are
    seen); afterwards the one-call step runs again."""
    from kimistream.runtime import kernels, quality
    steps = []
    monkeypatch.setattr(kernels.MoEStep, "__call__",
                        lambda self, *a, _call=kernels.MoEStep.__call__: steps.append(1) or _call(self, *a))
    w = ModelWeights(synthetic_q2)
    w.load_resident()
    m = Model(w, 64)
    seen = set()
    with quality.observing(m, lambda name, x: seen.add(name)):
        for t in PROMPT[:6]:
            m.forward([t])
    assert any(".mlp.experts." in n for n in seen) and any("kv_b_proj" in n for n in seen)
    assert not steps
    for t in PROMPT[:6]:
        m.forward([t])
    assert steps
    w.close()


def test_the_run_summary_says_how_many_threads_decode_ran_on(synthetic):
    """Without --threads the decode steps' time chooses (runtime/threadtune.py) and the summary says
    what was chosen; --threads N is taken as given."""
    proc = kimi_run("--weights", synthetic, "--prompt", "hello", "--max-tokens", 2, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "(auto: " in json.loads(proc.stdout)["stats"]["threads"] or json.loads(proc.stdout)["stats"]["threads"] == "1"
    proc = kimi_run("--weights", synthetic, "--prompt", "hello", "--max-tokens", 2, "--json", "--threads", 1)
    assert json.loads(proc.stdout)["stats"]["threads"] == "1 (--threads)", proc.stderr


def test_io_auto_moves_to_o_direct_reads_when_evicted_pages_are_to_be_dropped(synthetic_q2, monkeypatch):
    """--io auto reads experts through the mapping until --page-cache auto decides to drop evicted
    experts' pages; from the next model step an O_DIRECT pread pager takes over (nothing then enters
    the page cache to be dropped), with the same counters, and the mapping's pager gives back all it
    held. The logits are those of mmap up to the handover and after it those of reads into a pool
    (where the shared expert runs apart from the routed ones: the same up to float rounding), the
    one-call decode step (whose shared expert lay in the mapping) included."""
    from kimistream.runtime import kernels
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "RELOAD_SKIP", 2)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 4)
    steps = []
    monkeypatch.setattr(kernels.MoEStep, "__call__",
                        lambda self, *a, _call=kernels.MoEStep.__call__: steps.append(type(w.pager)) or _call(self, *a))
    expert = max(e.nbytes for e in WeightFile(synthetic_q2).extents if e.kind == "expert")
    runs = {}
    for io in ("mmap", "auto"):
        w = ModelWeights(synthetic_q2, io=io, cache_bytes=40 * expert)
        first = w.pager
        first.cached_share = lambda off, n: 0.0          # as under a cap: evicted experts' pages gone
        w.load_resident()
        m = Model(w, 128)
        logits, mapped = [], 0
        for t in PROMPT * 2:
            logits.append(m.forward([t]))
            mapped += w.pager is first
        st = w.pager.stats
        runs[io] = (np.stack(logits), st.hits + st.misses, w.pager, first, w.io_policy, mapped)
        w.close()
    mapped = runs["auto"][5]
    assert 0 < mapped < len(PROMPT) * 2
    np.testing.assert_array_equal(runs["auto"][0][:mapped], runs["mmap"][0][:mapped])
    np.testing.assert_allclose(runs["auto"][0], runs["mmap"][0], atol=0.1)
    assert runs["auto"][1] == runs["mmap"][1]                  # the same experts asked for
    _, _, pager, first, policy, _ = runs["auto"]
    assert isinstance(pager, P.PreadPager) and pager.direct and pager.stats is first.stats
    assert not first._cache and first.cached_bytes == 0
    assert pager.page_cache_policy.startswith("drop evicted experts (auto: 0% of 4") and \
        pager.page_cache_policy.endswith("; then O_DIRECT reads, which leave nothing to drop")
    # and from there on O_DIRECT reads are timed against the mapping (IoTrial: no steps timed here)
    assert policy == "auto: O_DIRECT pread (a trial of O_DIRECT reads against the mapping under way when the run ended)"
    mmap_pager = runs["mmap"][2]
    assert isinstance(mmap_pager, P.MmapPager) and mmap_pager.drop_evicted   # --io mmap: drops, stays
    assert P.MmapPager in steps and P.PreadPager in steps      # one-call steps before and after


def test_a_pread_pool_of_one_layers_experts_takes_them_together_only_when_nothing_can_evict_them(synthetic):
    """Reads into a pool hold a layer's n experts at once in n slots under LRU in a run that never
    guessed (they are then the most recent entries); once guesses were made (an abandoned one's read
    still lands in a slot) or under LFRU (which may pick among the older half) it takes 2n."""
    from kimistream.runtime.pager import PreadPager
    wf = WeightFile(synthetic)
    expert = max(e.nbytes for e in wf.extents if e.kind == "expert")
    for policy, guess, slots, expect in [("lru", False, 2, True), ("lru", True, 2, False), ("lfru", False, 2, False),
                                         ("lfru", True, 4, True), ("lru", False, 1, False)]:
        p = PreadPager(wf, slots * expert, policy)
        if guess:
            p.prefetch(1, [])
        assert p.holds_together(2) == expect, (policy, guess, slots)
        p.close()
    wf.close()
    # and the output is the same with a pool of exactly one token's experts (top-2), LRU, no guesses
    ref_logits, ref_tokens, _ = _run(synthetic)
    logits, tokens, stats = _run(synthetic, io="pread", cache_bytes=2 * expert, prefetch="off")
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens and stats.evictions > 0


def test_a_pread_pool_takes_a_layers_experts_together_again_once_guessing_has_stopped(synthetic):
    """Guessing stopped for the run (the guess trial or the recall said so): once no guess's read is
    in flight, n slots hold a layer's n experts together again (until then a guess may hold one)."""
    import threading
    from kimistream.runtime.pager import PreadPager
    wf = WeightFile(synthetic)
    p = PreadPager(wf, 2 * PreadPager(wf, 0).slot_bytes)
    gate = threading.Event()
    for _ in range(p.threads):              # the pool's threads held: the guess's read waits in flight
        p._pool.submit(gate.wait)
    try:
        p.prefetch(2, [5])
        assert not p.holds_together(2)
        p.stop_guessing()
        assert not p.holds_together(2)      # the guess is still being read
    finally:
        gate.set()
    p._pool.submit(lambda: None).result()
    p._pool.shutdown(wait=True)
    assert p.holds_together(2)
    p.close()
    wf.close()


def test_io_auto_keeps_the_mapping_where_o_direct_cannot_be_had(synthetic, monkeypatch):
    """A filesystem that refuses O_DIRECT (tmpfs): --io auto stays with the mapping, dropping evicted
    experts' pages as --io mmap does, and the page-cache policy says why; with --page-cache drop it
    maps from the start."""
    from kimistream.runtime import pager as P

    def refuse(self, wf, *a, **kw):
        raise P.ExpertReadError(f"{wf.path}: cannot open for O_DIRECT reads: Invalid argument")
    monkeypatch.setattr(P.PreadPager, "__init__", refuse)
    w = ModelWeights(synthetic, io="auto", cache_bytes=2 * ModelWeights(synthetic).expert_extent_bytes)
    first = w.pager
    first._decide(True)
    assert first.wants_direct
    w.step_begins()
    assert w.pager is first and not first.wants_direct and first.drop_evicted
    assert first.page_cache_policy.endswith("; O_DIRECT reads unavailable (Invalid argument)")
    w.close()
    w = ModelWeights(synthetic, io="auto", page_cache="drop")
    assert isinstance(w.pager, P.MmapPager) and w.pager.drop_evicted
    assert w.pager.page_cache_policy.endswith("; O_DIRECT reads unavailable (Invalid argument)")
    assert w.io_policy == "auto: mmap"              # no promise of O_DIRECT reads it cannot make
    w.close()


@pytest.mark.parametrize("share", [0.5, 0.7, 0.95])
def test_io_auto_reads_with_o_direct_below_a_share_and_times_keeping_against_it_above(synthetic, monkeypatch, share):
    """Under --io auto, dropping means O_DIRECT reads, which beat keeping at shares of evicted experts
    still cached well short of a clear keep (RELOAD_DIRECT): such a share goes to O_DIRECT at once,
    with no timed windows (--io mmap times keeping against dropping mapped pages there, see above);
    from that share on, however high, keeping the mapping's pages is timed against O_DIRECT reads
    themselves: the hand-over to O_DIRECT starts an IoTrial whose mapped windows keep them."""
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "RELOAD_SKIP", 2)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 4)
    monkeypatch.setattr(P, "IO_TRIAL_SKIP", 100)      # (the trial's windows: the test below)
    w = ModelWeights(synthetic, io="auto", cache_bytes=2 * ModelWeights(synthetic).expert_extent_bytes)
    first = w.pager
    first.cached_share = lambda off, n: share
    w.load_resident()
    m = Model(w, 64)
    m.prefill(PROMPT, 8)
    for _ in range(3):
        m.forward([5])
    assert first.stats.reloads == 4 and first._timed is None
    assert isinstance(w.pager, P.PreadPager) and w.pager.direct
    found = f"{share:.0%} of 4 evicted experts were still cached when needed again"
    if share < P.RELOAD_DIRECT:
        assert w.pager.page_cache_policy.startswith(f"drop evicted experts (auto: {found}")
        assert w.pager.io_trial is not None and not w.pager.io_trial.keep_mapped
    else:
        trial = w.pager.io_trial
        assert trial is not None and trial.running and trial.keep_mapped
        assert trial.keep_policy == f"keep evicted experts (auto: {found})"
        assert w.pager.page_cache_policy == "not used (O_DIRECT reads)"
        assert "a trial of O_DIRECT reads against keeping them under way" in w.io_policy
    w.close()


def _pool_tokens(path, cache_bytes: int, n: int) -> list:
    """The greedy tokens of a run reading experts with O_DIRECT into a pool: the reference the trials'
    hand-overs between pagers must reproduce."""
    ref = ModelWeights(path, io="pread", direct=True, cache_bytes=cache_bytes)
    ref.load_resident()
    tokens = list(generate(Model(ref, 64), PROMPT, n, Sampler(0.0), 8))
    ref.close()
    return tokens


@pytest.mark.parametrize("faster", ["mapped", "direct"])
def test_keeping_pages_timed_against_o_direct_hands_over_to_a_mapping_that_keeps_them(synthetic_q2, monkeypatch,
                                                                                      faster):
    """The trial of keeping evicted experts' pages against O_DIRECT reads: its mapped windows, and its
    verdict when the mapping wins, read through a mapping whose evicted experts' pages stay in the page
    cache (not dropped, as in the trial --page-cache drop starts); the run summary says which won and
    what the share was. The tokens are a pool read's."""
    from kimistream.runtime import pager as P
    from kimistream.runtime.telemetry import Telemetry
    monkeypatch.setattr(P, "RELOAD_SKIP", 2)
    monkeypatch.setattr(P, "RELOAD_TRIAL", 4)
    monkeypatch.setattr(P, "IO_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "IO_TRIAL_STEPS", 2)
    expert = max(e.nbytes for e in WeightFile(synthetic_q2).extents if e.kind == "expert")
    ref_tokens = _pool_tokens(synthetic_q2, 4 * expert, 24)
    observe, mapped_pagers = P.IoTrial.observe, []

    def timed(trial, seconds, scored=True):
        observe(trial, 0.02 if trial.direct == (faster == "direct") else 0.03, scored)
    monkeypatch.setattr(P.IoTrial, "observe", timed)
    monkeypatch.setattr(P.MmapPager, "__init__", lambda self, *a, _i=P.MmapPager.__init__, **k:
                        mapped_pagers.append(k.get("page_cache")) or _i(self, *a, **k))
    w = ModelWeights(synthetic_q2, io="auto", cache_bytes=4 * expert)
    first = w.pager
    first.cached_share = lambda off, n: 0.8
    w.load_resident()
    tokens = list(generate(Model(w, 64), PROMPT, 24, Sampler(0.0), 8, telemetry=Telemetry(first)))
    assert tokens == ref_tokens
    trial = w.pager.io_trial
    assert trial is not None and trial.keep_mapped and not trial.running
    windows = mapped_pagers[1:]                  # the trial's mapped windows' (and verdict's) page-cache modes
    assert windows and set(windows) == {"keep"}
    found = "keep evicted experts (auto: 80% of 4 evicted experts were still cached when needed again)"
    if faster == "mapped":
        assert isinstance(w.pager, P.MmapPager) and not w.pager.drop_evicted
        assert w.pager.page_cache_policy == found
        assert w.io_policy.startswith("auto: mmap, evicted experts kept (timed 20.0 and 20.0 ms a step through "
                                      "the mapping keeping evicted experts' pages against 30.0 and 30.0")
    else:
        assert isinstance(w.pager, P.PreadPager) and w.pager.direct
        assert w.io_policy.startswith("auto: O_DIRECT pread (timed 30.0 ms a step through the mapping keeping "
                                      "evicted experts' pages against 20.0 with O_DIRECT reads; keeping them lost")
    w.close()


def test_io_trial_times_o_direct_against_the_mapping_in_alternating_windows(monkeypatch):
    """IoTrial: after IO_TRIAL_SKIP steps, windows of O_DIRECT and mapped reads alternate; a window
    after a switch does not score its first step, nor is a step a thread trial ran scored; the mapping
    stays only when its steps took less than the margin of O_DIRECT's in each mapped window against
    the O_DIRECT window before it, so the first pair it loses ends the trial; a trial that met no step
    of one kind keeps O_DIRECT."""
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "IO_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "IO_TRIAL_STEPS", 3)
    monkeypatch.setattr(P, "IO_TRIAL_ORDER", (True, False, True, False))

    def run(direct_s, mapped_s, unscored=()):
        t, modes = P.IoTrial(), []
        for i in range(1 + 3 * 4 + 3):
            modes.append(t.direct)
            # a step after a switch, or one a thread trial ran: far off, so that scoring it would show
            odd = i in unscored or (i > 1 and modes[-1] != modes[-2])
            mapped = mapped_s[min(i, 12) // 7] if isinstance(mapped_s, tuple) else mapped_s
            t.observe(9.0 if odd else (direct_s if t.direct else mapped), scored=i not in unscored)
        return t, modes

    t, modes = run(0.020, 0.018)
    assert modes[:13] == [True] * 4 + [False] * 3 + [True] * 3 + [False] * 3
    assert not t.running and not t.direct and modes[13:] == [False] * 3
    assert t.times == [[0.020] * 3, [0.018] * 2, [0.020] * 2, [0.018] * 2]
    assert t.note == "timed 18.0 and 18.0 ms a step through the mapping against 20.0 and 20.0 with O_DIRECT reads"
    # within the margin: O_DIRECT stays, and the first pair the mapping loses ends the trial
    t, modes = run(0.020, 0.0195, unscored={2, 8})
    assert t.direct and not t.running and modes[7:] == [True] * 9 and t.times[2:] == [[], []]
    assert len(t.times[0]) == 2 and t.times[1] == [0.0195] * 2
    assert t.note == ("timed 19.5 ms a step through the mapping against 20.0 with O_DIRECT reads; "
                      "the mapping lost, 2 windows left out")
    t, modes = run(0.020, (0.0199, 0.010))              # lost the first pair, would have won the second
    assert t.direct and modes[7:] == [True] * 9 and "19.9 ms" in t.note and "10.0" not in t.note
    # the mapping far ahead in one window (the disk slowed the O_DIRECT window before it) but not in the
    # other: O_DIRECT stays, although on the average of all four the mapping would have
    t, modes = run(0.020, (0.010, 0.0199))
    assert t.direct and modes[13:] == [True] * 3 and "10.0 and 19.9 ms" in t.note
    t, _ = run(0.020, 0.010, unscored=set(range(16)))
    assert t.direct and not t.running and "met no step" in t.note


def test_io_auto_hands_over_between_o_direct_and_the_mapping_as_its_trial_says(synthetic_q2, monkeypatch):
    """--io auto --page-cache drop reads with O_DIRECT from the start and times that against reads
    through the mapping with evicted experts dropped: the provider hands over at step boundaries as the
    trial's windows say (Telemetry passing each decode step on, whichever pager it holds), the pagers
    share their counters, a pool given up returns its pages, and the faster way stays, said in the run
    summary's io policy. The logits stay those of a pool read up to float rounding (the shared expert
    runs apart from the routed ones there)."""
    from kimistream.runtime import pager as P
    from kimistream.runtime.telemetry import Telemetry
    monkeypatch.setattr(P, "IO_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "IO_TRIAL_STEPS", 2)
    expert = max(e.nbytes for e in WeightFile(synthetic_q2).extents if e.kind == "expert")
    ref_tokens = _pool_tokens(synthetic_q2, 6 * expert, 14)
    for faster in ("mapped", "direct"):
        monkeypatch.undo()
        monkeypatch.setattr(P, "IO_TRIAL_SKIP", 1)
        monkeypatch.setattr(P, "IO_TRIAL_STEPS", 2)
        observe = P.IoTrial.observe
        ways, retired = [], []
        def timed(trial, seconds, scored=True):
            ways.append(trial.direct)
            observe(trial, 0.02 if trial.direct == (faster == "direct") else 0.03, scored)
        monkeypatch.setattr(P.IoTrial, "observe", timed)
        monkeypatch.setattr(P.PreadPager, "retire",
                            lambda self, _r=P.PreadPager.retire, _seen=retired: _seen.append(self) or _r(self))
        guessed = []                # whether the mapping's trial was running at each guess
        monkeypatch.setattr(P.ExpertPager, "prefetch", lambda self, layer, experts, _p=P.ExpertPager.prefetch:
                            guessed.append(self.io_trial.running) or _p(self, layer, experts))
        w = ModelWeights(synthetic_q2, io="auto", page_cache="drop", cache_bytes=6 * expert, prefetch="auto")
        assert w.pager.guess_trial is not None
        first = w.pager
        assert isinstance(first, P.PreadPager) and first.direct and first.io_trial is not None
        w.load_resident()
        tokens = list(generate(Model(w, 64), PROMPT, 14, Sampler(0.0), 8, telemetry=Telemetry(first)))
        assert tokens == ref_tokens
        if faster == "mapped":
            assert ways[:9] == [True] * 3 + [False] * 2 + [True] * 2 + [False] * 2
            assert set(ways[9:]) == {False} and len(ways) == 13
        else:                   # the mapping lost the first pair: the trial ends there
            assert ways == [True] * 3 + [False] * 2 + [True] * 8
        # no guess in either way's windows (a pool has room for them where a mapping has none); the
        # guess trial comes after
        assert guessed and not any(guessed)
        p = w.pager
        assert p.stats is first.stats and p.io_trial is first.io_trial and not p.io_trial.running
        assert isinstance(p, P.PreadPager if faster == "direct" else P.MmapPager) and p.drop_evicted != (faster == "direct")
        assert first in retired and not first._cache
        # the retired pool's pages are given back: its bytes read as zeros again
        assert not np.frombuffer(first._arena, np.uint8).any()
        assert p.stats.misses > 0 and p.stats.evictions > 0
        assert p.page_cache_policy == ("not used (O_DIRECT reads)" if faster == "direct" else "drop evicted experts")
        how = "O_DIRECT pread" if faster == "direct" else "mmap, evicted experts dropped"
        if faster == "direct":
            assert w.io_policy == (f"auto: {how} (timed 30.0 ms a step through the mapping against 20.0 with "
                                   f"O_DIRECT reads; the mapping lost, 2 windows left out)")
        else:
            assert w.io_policy == (f"auto: {how} (timed 20.0 and 20.0 ms a step through the mapping against "
                                   f"30.0 and 30.0 with O_DIRECT reads)")
        w.close()


def test_a_trial_that_began_after_the_mapping_hears_of_the_steps_from_the_first_pager(synthetic_q2, monkeypatch):
    """The run's telemetry holds the first pager. When that is the mapping, and the trial of O_DIRECT
    reads against it only starts at the hand-over, the steps passed to the retired first pager reach
    the trial (they did not: the trial never left its first window)."""
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "IO_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "IO_TRIAL_STEPS", 2)
    expert = max(e.nbytes for e in WeightFile(synthetic_q2).extents if e.kind == "expert")
    w = ModelWeights(synthetic_q2, io="auto", cache_bytes=6 * expert)
    first = w.pager
    assert isinstance(first, P.MmapPager) and first.io_trial is None
    first.wants_direct = True                    # its page-cache policy came to dropping evicted experts
    w.step_begins()
    trial = w.pager.io_trial
    assert w.pager is not first and trial is not None and trial.direct
    first.observe_step(0.02)
    first.observe_step(0.02)
    first.observe_step(0.02)
    assert trial.steps == 3 and not trial.direct          # its first O_DIRECT window done: the mapping's turn
    w.close()


def test_guess_trial_times_guessing_against_not_in_alternating_windows(monkeypatch):
    """GuessTrial, IoTrial's windows for --prefetch auto: guessing is the incumbent; not guessing stays
    only when it wins each pair by the margin, and the first pair it loses ends the trial."""
    from kimistream.runtime import pager as P
    monkeypatch.setattr(P, "GUESS_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "GUESS_TRIAL_STEPS", 3)

    def run(guess_s, off_s):
        t, modes = P.GuessTrial(), []
        for i in range(1 + 3 * 4 + 3):
            modes.append(t.guess)
            odd = i > 1 and modes[-1] != modes[-2]
            t.observe(9.0 if odd else (guess_s if t.guess else off_s))
        return t, modes

    t, modes = run(0.030, 0.020)                # not guessing faster in both pairs: it stays
    assert modes[:13] == [True] * 4 + [False] * 3 + [True] * 3 + [False] * 3
    assert not t.running and not t.guess and modes[13:] == [False] * 3
    assert t.note == "timed 20.0 and 20.0 ms a step without guesses against 30.0 and 30.0 guessing"
    t, modes = run(0.020, 0.0195)               # within the margin: guessing stays, after one pair
    assert t.guess and not t.running and modes[7:] == [True] * 9
    assert t.note == "timed 19.5 ms a step without guesses against 20.0 guessing; not guessing lost, 2 windows left out"
    assert P.GuessTrial().note == "a trial of guessing against not guessing under way when the run ended"


@pytest.mark.parametrize("faster", ["guessing", "not guessing"])
def test_auto_prefetch_keeps_what_its_trial_timed_faster(synthetic, monkeypatch, faster):
    """--prefetch auto with a cache short of the file: the decode steps the run's telemetry passes on
    go to the pager's GuessTrial; guesses are made in its guessing windows only, and after it the
    faster way stays for the run, said in the run summary's prefetch policy; the thread tuner sits the
    trial out."""
    from kimistream.runtime import pager as P
    from kimistream.runtime.telemetry import Telemetry
    from kimistream.runtime.threadtune import ThreadTuner
    from kimistream.runtime import weights as W
    monkeypatch.setattr(W, "GUESS_IDLE_READS", 1 << 30)   # the fresh file is in the page cache: no pause
    monkeypatch.setattr(W, "GUESS_TRIAL", 1 << 30)        # nor the judgement of recall
    monkeypatch.setattr(P, "GUESS_TRIAL_SKIP", 1)
    monkeypatch.setattr(P, "GUESS_TRIAL_STEPS", 2)
    observe = P.GuessTrial.observe
    ways = []

    def timed(trial, seconds, scored=True):
        ways.append(trial.guess)
        observe(trial, 0.02 if trial.guess == (faster == "guessing") else 0.03, scored)
    monkeypatch.setattr(P.GuessTrial, "observe", timed)
    expert = ModelWeights(synthetic).expert_extent_bytes
    w = ModelWeights(synthetic, io="mmap", cache_bytes=6 * expert, prefetch="auto")
    assert w.pager.guess_trial is not None and "timed against no guesses" in w.prefetch_policy
    w.load_resident()
    tuned = []
    tuner = ThreadTuner(2, lambda n: None)
    monkeypatch.setattr(tuner, "observe_step", lambda s, scored=True: tuned.append(scored))
    m = Model(w, 64)
    guessed = []
    guess = w.guess
    monkeypatch.setattr(w, "guess", lambda layer, experts: guessed.append(len(ways)) or guess(layer, experts))
    tokens = list(generate(m, PROMPT, 14, Sampler(0.0), 8, telemetry=Telemetry(w.pager, tuner=tuner)))
    assert len(tokens) == 14
    trial = w.pager.guess_trial
    assert not trial.running and trial.guess == (faster == "guessing")
    if faster == "guessing":                    # not guessing lost the first pair: the trial ends there
        ran = 5
        assert ways == [True] * 3 + [False] * 2 + [True] * (len(ways) - 5)
    else:
        ran = 9
        assert ways == [True] * 3 + [False] * 2 + [True] * 2 + [False] * (len(ways) - 7)
    # no guess in a window without them (a decode step's guesses are made before its telemetry record)
    off_steps = {i for i, g in enumerate(ways) if not g}
    assert not any(i in off_steps for i in guessed)
    assert len(tuned) == len(ways) and not any(tuned[:ran]) and all(tuned[ran:])   # the tuner sat the trial out
    if faster == "guessing":
        assert w.wants_guesses and w.prefetch_policy.startswith("next-layer (auto: timed 30.0 ms a step without guesses")
    else:
        assert not w.wants_guesses and w.prefetch_policy.startswith("off (auto: timed 20.0 and 20.0 ms a step without")
        assert not w.pager._guessed             # told the pager: no guess will take a slot again
    w.close()


def test_cgroup_memory_limit_read_from_v1_and_v2(tmp_path):
    """procfs.cgroup_memory_limit finds this process's cgroup (/proc/self/cgroup) and its limit: v1's
    memory controller's memory.limit_in_bytes, v2's memory.max; none where unlimited or unreadable."""
    from kimistream.formats import procfs
    proc = tmp_path / "cgroup"
    (tmp_path / "memory" / "jobs" / "a").mkdir(parents=True)
    (tmp_path / "memory" / "jobs" / "a" / "memory.limit_in_bytes").write_text("201916416\n")
    proc.write_text("5:devices:/\n4:memory:/jobs/a\n0::/\n")
    assert procfs.cgroup_memory_limit(str(proc), str(tmp_path)) == 201916416
    (tmp_path / "memory" / "jobs" / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert procfs.cgroup_memory_limit(str(proc), str(tmp_path)) is None
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "memory.max").write_text("max\n")
    proc.write_text("0::/u\n")
    assert procfs.cgroup_memory_limit(str(proc), str(tmp_path)) is None
    (tmp_path / "u" / "memory.max").write_text("268435456\n")
    assert procfs.cgroup_memory_limit(str(proc), str(tmp_path)) == 268435456
    assert procfs.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None


def test_process_status_is_the_kernels_own_and_a_forked_childs_own():
    """procfs.status: /proc/self/status's Vm* and Rss* counters in bytes, each as the file gives it
    (read through a descriptor kept open); a forked child reads its own counters, not its parent's
    (its RSS grows by the 64 MiB it touches)."""
    import mmap
    import os
    from kimistream.formats import procfs
    procfs.status()
    want = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key.startswith(("Vm", "Rss")) and rest.split()[1:] == ["kB"]:
                want[key] = int(rest.split()[0]) * 1024
    got = procfs.status()
    assert got.keys() == want.keys() and {"VmRSS", "VmHWM", "RssAnon", "RssFile"} <= got.keys()
    assert got["VmPeak"] == want["VmPeak"] and got["VmHWM"] >= want["VmHWM"] > 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            before = procfs.status()["VmRSS"]
            buf = mmap.mmap(-1, 64 << 20)     # fresh pages (a heap kept by an earlier test could reuse resident ones)
            for off in range(0, len(buf), 4096):
                buf[off] = 1
            os.write(w, str(procfs.status()["VmRSS"] - before).encode())
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    said = os.read(r, 256).decode()
    os.waitpid(pid, 0)
    assert said.isdigit() and int(said) >= 60 << 20, said


def test_no_page_cache_room_only_under_a_hard_limit_and_a_cache_short_of_a_token():
    """O_DIRECT from the start (budget.no_page_cache_room) only when a cgroup limit leaves less than one
    layer's experts beside the budget and the cache holds fewer experts than a token routes to over
    all its layers: a budget on a machine with memory to spare, or a cache of a token's experts, leaves
    the decision to measurement. A plan that does not know a token's experts keeps the rule of one
    layer's."""
    import dataclasses

    from kimistream.runtime import budget as B
    plan = B.MemoryPlan(budget=200 << 20, baseline=60 << 20, resident=100 << 20, metadata=2 << 20,
                        kv_cache=9 << 20, activations=17 << 20, expert_cache=6 << 20, expert_bytes=1 << 20,
                        cache_experts=6, min_cache_experts=6, total_experts=704, token_experts=66)
    why = B.no_page_cache_room(plan, limit=200 << 20)
    assert why and "leaves 0 B" in why and "6 experts, fewer than the 66" in why
    assert B.no_page_cache_room(plan, limit=(200 + 5) << 20)                 # less than one layer's room
    assert B.no_page_cache_room(plan, limit=(200 + 6) << 20) is None         # one layer's experts fit beside
    assert B.no_page_cache_room(dataclasses.replace(plan, cache_experts=65), limit=200 << 20)
    assert B.no_page_cache_room(dataclasses.replace(plan, cache_experts=66), limit=200 << 20) is None
    unknown = dataclasses.replace(plan, token_experts=0)
    assert "only one layer's 6 experts" in B.no_page_cache_room(unknown, limit=200 << 20)
    assert B.no_page_cache_room(dataclasses.replace(unknown, cache_experts=7), limit=200 << 20) is None


def test_no_page_cache_room_when_memory_holds_a_small_share_of_the_experts():
    """O_DIRECT from the start also without a limit when all the memory the process and the page cache
    may use holds less than 15 % of the routed experts (Kimi K2 on a PC): the page cache could find
    few re-read experts. A model whose experts memory mostly holds is left to measurement, and the
    memory counted is no more than the cgroup's limit."""
    import dataclasses

    from kimistream.runtime import budget as B
    k2 = B.MemoryPlan(budget=8240 << 20, baseline=100 << 20, resident=7000 << 20, metadata=50 << 20,
                      kv_cache=300 << 20, activations=400 << 20, expert_cache=400 << 20, expert_bytes=13 << 20,
                      cache_experts=30, min_cache_experts=8, total_experts=384 * 60, token_experts=480)
    experts = 384 * 60 * (13 << 20)
    why = B.no_page_cache_room(k2, limit=None, memory=22 << 30)
    assert why and "holds 8% of the routed experts' 292.50 GiB" in why and "pays from 15%" in why
    assert B.no_page_cache_room(k2, limit=None, memory=int(0.15 * experts) + 1) is None
    assert B.no_page_cache_room(k2, limit=None, memory=int(0.15 * experts) - 1)
    small = dataclasses.replace(k2, expert_bytes=1 << 20, total_experts=704, cache_experts=88, token_experts=66,
                                budget=385 << 20)
    assert B.no_page_cache_room(small, limit=385 << 20, memory=385 << 20) is None       # ½ of the bench model
    assert B.no_page_cache_room(small, limit=None, memory=100 << 20)
    assert B.no_page_cache_room(k2, limit=None, memory=22 << 30, experts=100 << 30) is None     # the file's own bytes
    assert B.process_memory(limit=64 << 20) <= 64 << 20


def test_plan_counts_a_tokens_experts():
    """make_plan's token_experts: k routed experts in each MoE layer of the config (Kimi K2: 8 x 60)."""
    from kimistream.formats.config import ModelConfig
    from kimistream.formats.memplan import make_plan
    cfg = ModelConfig.from_hf(json.loads((DATA / "kimi-k2-instruct-config.json").read_text()))
    plan = make_plan(cfg, budget=8 << 30, baseline=0, resident=0, metadata=0, expert_bytes=1 << 20,
                     total_experts=384 * 60, max_context=64, chunk=16, expert_scratch=0, prefetch=False)
    assert plan.token_experts == 480


def test_no_page_cache_room_means_o_direct_reads_from_the_start(synthetic, monkeypatch, capsys):
    """When the memory limit leaves the page cache no room, or memory holds a sliver of the experts
    (budget.no_page_cache_room gives its reason), kimi-run's --io auto --page-cache auto drops evicted
    experts' pages from the first step, with no trial of keeping them; the run summary says why, and
    the tokens are those of a run that decides by measuring; --dry-run says so."""
    from kimistream.runtime import budget as B
    from kimistream.runtime import cli

    def run():
        assert cli.main(["--weights", str(synthetic), "--json", "--prefill-batch-size", "16", "--memory-budget",
                         "4G", "--max-context", "64", "--prompt", "abcdefghij", "--max-tokens", "6"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    free = run()
    monkeypatch.setattr(B, "no_page_cache_room", lambda plan, **_: "the memory limit of 4 GiB leaves 0 B beside it")
    tight = run()
    policy = "drop evicted experts (auto: the memory limit of 4 GiB leaves 0 B beside it)"
    assert tight["stats"]["page_cache_policy"] == policy and free["stats"]["page_cache_policy"] != policy
    assert tight["stats"]["io"] != free["stats"]["io"]          # O_DIRECT reads (or, without them, mapped pages dropped)
    assert tight["tokens"] == free["tokens"]
    monkeypatch.undo()
    monkeypatch.setattr(B, "process_memory", lambda limit=None: 1 << 20)     # memory for a sliver of the experts
    small = run()
    assert "of memory holds" in small["stats"]["page_cache_policy"] and small["stats"]["io"] == tight["stats"]["io"]
    assert small["tokens"] == free["tokens"]
    assert cli.main(["--weights", str(synthetic), "--memory-budget", "4G", "--max-context", "64", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "expert reads: O_DIRECT from the start, evicted experts not kept in the page cache (1.00 MiB of memory " \
           "holds" in err and "timed against" not in err
    # the file far larger than memory is left to O_DIRECT reads; under a memory limit they are timed
    # against reads through the mapping (pager.IoTrial; six tokens end inside its first window)
    assert "trial" not in small["stats"]["io"] and "trial" not in tight["stats"]["io"]
    monkeypatch.setattr(B, "limit_leaves_no_room", lambda plan, limit: "the memory limit of 4 GiB leaves 0 B")
    limited = run()
    assert limited["stats"]["io"] == ("auto: O_DIRECT pread (a trial of O_DIRECT reads against the mapping under way "
                                      "when the run ended)") and limited["tokens"] == free["tokens"]
    assert cli.main(["--weights", str(synthetic), "--memory-budget", "4G", "--max-context", "64", "--dry-run"]) == 0
    assert "timed against reads through the mapping in the first decode steps" in capsys.readouterr().err


def test_run_summary_says_how_many_moe_calls_overlapped(synthetic_q2, monkeypatch, capsys):
    """kimi-run's report counts the decode steps' MoE calls launched beside the interpreter, or says why
    there were none (experts too small to share between two threads; an expert cache that may evict),
    and the tokens do not depend on the overlap."""
    from kimistream.runtime import cli, kernels

    def run(*flags):
        assert cli.main(["--weights", str(synthetic_q2), "--json", "--prefill-batch-size", "16", "--max-context",
                         "64", "--prompt", "abcdefghij", "--max-tokens", "8", "--memory-budget", "4G", *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    small = run()
    assert small["stats"]["moe_overlap"].startswith("none of ")                     # too small to share
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "_threads", 2)
    shared = run()
    launched, _, calls = shared["stats"]["moe_overlap"].split()[:3]
    assert 0 < int(launched) <= int(calls)
    evicting = run("--io", "pread")
    assert evicting["stats"]["moe_overlap"].startswith("none: the expert cache may evict")
    assert small["tokens"] == shared["tokens"]


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_prompt_window_reads_each_layers_experts_once(synthetic, io, monkeypatch):
    """A prompt in one window a layer at a time, under a cache of 12 of a layer's 32 experts: every
    (layer, expert) it routes to is read once, some of them ahead of their use (the stream's
    read-ahead) and none evicted before it; chunk by chunk, experts are read again for later chunks.
    The logits are the chunk-by-chunk ones (f32 weights: to float rounding)."""
    from kimistream.runtime import pager as P
    expert = max(e.nbytes for e in WeightFile(synthetic).extents if e.kind == "expert")
    reads = []
    ahead = []
    cls = P.MmapPager if io == "mmap" else P.PreadPager
    real_load, real_ahead = cls._load, cls._start_prefetch

    def load(self, key):
        if key not in self._inflight:
            reads.append(key)
        return real_load(self, key)

    def start(self, key, speculative=True):
        n = len(self._inflight)
        real_ahead(self, key, speculative)
        if len(self._inflight) > n:
            reads.append(key)
            ahead.append(key)
    monkeypatch.setattr(cls, "_load", load)
    monkeypatch.setattr(cls, "_start_prefetch", start)

    def run(window):
        reads.clear(), ahead.clear()
        w = ModelWeights(synthetic, io=io, cache_bytes=12 * expert, prefetch="off")
        w.load_resident()
        assert w.pager.read_ahead_depth() == 4
        m = Model(w, 128)
        logits = m.prefill(PROMPT, 5, all_logits=False, window=window)
        w.close()
        return logits, list(reads), list(ahead)
    by_chunk, chunk_reads, _ = run(None)
    windowed, window_reads, window_ahead = run(len(PROMPT))
    assert len(window_reads) == len(set(window_reads))                      # each once
    assert len(chunk_reads) > len(set(chunk_reads)) >= len(set(window_reads))
    assert window_ahead and set(window_reads) >= set(window_ahead)
    assert np.abs(windowed - by_chunk).max() <= 1e-4 * np.abs(by_chunk).max()


def test_a_window_stops_between_layers_when_cancelled(synthetic):
    """cancelled() is asked before each layer of a window: a prompt cancelled in its first window
    leaves the cache where it was, and the next request runs as if it never happened."""
    w = ModelWeights(synthetic)
    w.load_resident()
    m = Model(w, 128)
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 2              # asked before the window and its first layer, then stop
    stats = GenerationStats()
    assert list(generate(m, PROMPT, 4, Sampler(0.0), 5, stats=stats, cancelled=cancelled, window=16)) == []
    assert stats.stop_reason == "cancelled" and m.cache.length == 0 and len(asked) == 3
    again = list(generate(m, PROMPT, 4, Sampler(0.0), 5, window=16))
    m.reset()
    assert again == list(generate(m, PROMPT, 4, Sampler(0.0), 5))


def test_prompt_window_plan_and_flag(synthetic):
    """The default window: none (one chunk) where the cache holds every expert, a window only saves
    reads of evicted ones; under a budget of fewer, what the cache leaves; Kimi
    K2 in 8.24 GB (a cache far short of a token's 480 experts) gives up all but 12 experts for 704
    tokens; --prompt-window is checked and planned as given."""
    proc = kimi_run("--weights", synthetic, "--dry-run", "--max-context", 256)
    assert proc.returncode == 0, proc.stderr
    assert "prompt window: none, the prompt goes chunk by chunk" in proc.stderr
    proc = kimi_run("--plan-config", DATA / "kimi-k2-instruct-config.json", "--quant", "q2",
                    "--memory-budget", "8.24G", "--max-context", 4096, "--json")
    assert "prompt window: 704 tokens" in proc.stderr
    assert json.loads(proc.stdout)["memory_plan"]["cache_experts"] == 12
    proc = kimi_run("--plan-config", DATA / "kimi-k2-instruct-config.json", "--quant", "q2",
                    "--memory-budget", "8.24G", "--max-context", 4096, "--prompt-window", 64, "--json")
    assert "prompt window" not in proc.stderr and json.loads(proc.stdout)["memory_plan"]["cache_experts"] == 18
    proc = kimi_run("--weights", synthetic, "--prompt", "hi", "--prompt-window", 0)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == "kimi-run: error: --prompt-window must be >= 1"


def test_a_long_window_projects_in_blocks_and_matches_chunk_by_chunk(synthetic):
    """A window longer than PROJECTION_TOKENS goes through the attention's projections a block of whole
    chunks at a time (the last block shorter): the logits of every position are the chunk-by-chunk
    ones (f32 weights: to float rounding)."""
    from kimistream.formats.memplan import projection_block
    assert [projection_block(c, w) for c, w in ((32, 2464), (64, 704), (6, 20), (300, 1000), (8, 300))] == \
        [256, 256, 20, 300, 256]
    ids = [int(i) for i in np.random.RandomState(3).randint(0, 512, 300)]
    w = ModelWeights(synthetic)
    w.load_resident()
    m = Model(w, 320)
    by_chunk = m.prefill(ids, 8, all_logits=True)
    m.reset()
    windowed = m.window(ids, 8, all_logits=True)
    assert m.cache.length == 300
    assert np.abs(windowed - by_chunk).max() <= 1e-4 * np.abs(by_chunk).max()


def _file_bytes(wf, name, n):
    with open(wf.path, "rb") as f:
        f.seek(wf.tensors[name].offset)
        return f.read(n)


def test_a_read_ahead_never_takes_the_slot_of_an_expert_in_use(synthetic):
    """A pool whose slots all hold the experts handed out for the computation under way (a layer's,
    pinned by get_many or held): guesses at the next layer find no slot to take and are dropped,
    instead of evicting one of them and reading over its bytes while a kernel multiplies them (tokens
    had changed in 3 runs of 36 under tight budgets); a stream's expert is pinned alone."""
    from kimistream.runtime.pager import PreadPager
    wf = WeightFile(synthetic)
    slot = PreadPager(wf, 0).slot_bytes
    for policy in ("lru", "lfru"):
        p = PreadPager(wf, 3 * slot, policy)
        views = p.get_many(1, [0, 1, 2])
        p.prefetch(2, [0, 1, 2])
        p.fetch_ahead(2, [3])
        p._pool.submit(lambda: None).result()
        p._pool.shutdown(wait=True)
        for vs in views:
            for name, _, _, buf, _ in vs:
                assert bytes(buf) == _file_bytes(wf, name, buf.nbytes), (policy, name)
        assert p.held(1, [0, 1, 2]) is not None and p.stats.prefetch_bytes == 0
        p.close()
    p = PreadPager(wf, 3 * slot)
    p.get_many(1, [0, 1, 2])
    p.get(1, 3)                     # a stream's next expert: the others are no longer pinned
    assert p.held(1, [3]) is not None
    p.close()
    wf.close()


def test_a_read_ahead_lands_in_one_step(synthetic, monkeypatch):
    """A get() between a read ahead entering the cache and its ready flag (the flag was set after
    the lock was let go) read the expert again into a second slot and lost the first: the pool
    shrank for good. The read lands, and is marked ready, under one lock."""
    import threading
    from kimistream.runtime.pager import PreadPager
    wf = WeightFile(synthetic)
    slot = PreadPager(wf, 0).slot_bytes
    p = PreadPager(wf, 6 * slot)
    for _ in range(p.threads):       # the pool's threads started before Event.set is slowed down
        p._pool.submit(time.sleep, 0.05)
    p._pool.submit(lambda: None).result()
    real_set, in_pool = threading.Event.set, threading.Event()

    def slow_set(ev):               # widen the gap on the pool's thread
        if threading.current_thread().name.startswith("kimi-prefetch") and ev is not in_pool:
            real_set(in_pool)
            time.sleep(0.2)
        real_set(ev)
    monkeypatch.setattr(threading.Event, "set", slow_set)
    p.fetch_ahead(1, [3])
    in_pool.wait(5)
    p.get(1, 3)
    monkeypatch.setattr(threading.Event, "set", real_set)
    p._pool.shutdown(wait=True)
    assert len(p._free) + len(p._cache) + len(p._inflight) == p.slots == 6
    assert p.cached_bytes == sum(-(-e.nbytes // 4096) * 4096 for e in p._cache.values())
    p.close()
    wf.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_layers_experts_are_computed_as_their_reads_land_with_the_sums_of_one_call(synthetic_q2, io, monkeypatch):
    """One token whose experts are being read: the fused call starts on the leading experts that have
    landed while the later reads go on (the first run's computation begins before the last read has
    landed), and runs in routing order, the shared expert last, give the logits of one call."""
    from kimistream.runtime import kernels
    from kimistream.runtime.pager import MmapPager, PreadPager
    path = synthetic_q2
    expert = max(e.nbytes for e in WeightFile(path).extents if e.kind == "expert")
    warm = ModelWeights(path, io=io)
    warm.load_resident()
    m = Model(warm, 128)
    ref = np.stack([m.forward([t]) for t in PROMPT[:8]])
    warm.close()

    overlapped = []
    pager = PreadPager if io == "pread" else MmapPager
    slow = "_read_into" if io == "pread" else "_willneed"
    real_read, real_moe = getattr(pager, slow), kernels.moe_decode

    def slow_read(self, *a):
        time.sleep(0.01)
        real_read(self, *a)

    def moe(*a, **kw):              # (prefetch off: every read under way is of the layer computing)
        with w.pager._lock:
            overlapped.append(any(not ent.ready.is_set() for ent in w.pager._inflight.values()))
        return real_moe(*a, **kw)
    monkeypatch.setattr(pager, slow, slow_read)
    monkeypatch.setattr(kernels, "moe_decode", moe)
    w = ModelWeights(path, io=io, cache_bytes=6 * expert, prefetch="off")
    w.load_resident()
    m = Model(w, 128)
    logits = np.stack([m.forward([t]) for t in PROMPT[:8]])
    w.close()
    np.testing.assert_array_equal(logits, ref)
    assert any(overlapped), overlapped
