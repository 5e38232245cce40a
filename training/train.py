"""Train a tiny DeepseekV3-architecture MoE language model on CPU.

The script is self-contained and deterministic up to wall-clock effects (the
number of optimizer steps depends on how fast the machine is):

  1. build a text corpus (CPython stdlib sources or man1 pages), holding out
     ~2% of the files by a hash of their name;
  2. train a byte-level BPE tokenizer (4096 tokens) on the training files;
  3. train a transformers ``DeepseekV3ForCausalLM`` (MLA attention, 1 dense +
     4 MoE layers, 16 routed experts, top-3, 1 shared expert) for a fixed
     wall-clock budget, with DeepSeek's auxiliary-loss-free load balancing of
     the router bias ``e_score_correction_bias``;
  4. save the model in bfloat16 (Hugging Face layout) with the tokenizer,
     reload it, and report held-out loss, expert routing skew and greedy samples
     in ``OUT/TRAINING.md``.

Example:
    python training/train.py --corpus stdlib --out models/stdlib-moe \
        --heldout-out data/stdlib-heldout.txt --minutes 22 --seed 0
"""

import argparse
import glob
import gzip
import hashlib
import json
import math
import os
import re
import sys
import time

# With the default (spinning) OpenMP wait policy, two torch threads slow down
# 3-4x when other processes compete for the two cores; sleeping waits avoid it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (must come after the OpenMP setting)
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
VOCAB_SIZE = 4096
SEQ_LEN = 256  # tokens predicted per training sequence (a BOS is prepended)
HELDOUT_MODULUS = 50  # a file is held out when hash(name) % 50 == 0, i.e. ~2%
HELDOUT_CAP_CHARS = 200_000
MAX_POSITIONS = 1024
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# No trailing spaces: byte-level BPE glues a space to the following word, so a
# prompt ending in a bare space is out of distribution.
SAMPLE_PROMPTS = {"stdlib": ["def", "import", "class"], "manpages": ["NAME\n", "The"]}


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------- corpus


def stdlib_documents():
    """Yield (name, text) for every .py file of the CPython stdlib, sorted by path."""
    root = os.path.dirname(os.__file__)
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, root)
        if name.split(os.sep)[0] in ("site-packages", "dist-packages"):
            continue  # third-party code, not the stdlib
        with open(path, "rb") as f:
            yield name, f.read().decode("utf-8", errors="replace")


# Character escapes that carry meaning; everything else of the form \x is dropped.
ROFF_NAMED_CHARS = {"em": "--", "en": "-", "hy": "-", "mi": "-", "lq": '"', "rq": '"', "oq": "'",
                    "cq": "'", "aq": "'", "dq": '"', "bu": "*", "co": "(c)", "rg": "(R)",
                    "tm": "(TM)", "ti": "~", "ha": "^", "rs": "\\", "ga": "`", "fm": "'", "mu": "x"}
ROFF_KEEP_MACROS = {".SH", ".SS", ".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB", ".SM"}


def roff_to_text(source):
    """Crudely turn a man page in roff into plain text.

    Control lines (starting with '.' or "'") are dropped, except that the text
    of section headings and font macros (.SH NAME, .B -v, ...) is kept.
    In-line escapes such as \\fB, \\fI, \\fR, \\-, \\(em and \\*(lq are
    replaced by their plain-text meaning or removed.
    """
    out = []
    for line in source.splitlines():
        line = re.sub(r'\\".*', "", line)  # roff comment
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            if macro not in ROFF_KEEP_MACROS or not rest.strip():
                continue
            line = rest.replace('"', "")
        line = line.replace("\\e", "\x00")  # protect literal backslashes
        line = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", line)  # font changes
        line = re.sub(r"\\s[+-]?\d+", "", line)  # size changes
        line = re.sub(r"\\\((..)", lambda m: ROFF_NAMED_CHARS.get(m.group(1), ""), line)
        line = re.sub(r"\\\[(\w+)\]", lambda m: ROFF_NAMED_CHARS.get(m.group(1), ""), line)
        line = re.sub(r"\\\*(\[[^\]]*\]|\(..|.)", "", line)  # string interpolation
        line = re.sub(r"\\[-~ 0]", lambda m: "-" if m.group(0) == "\\-" else " ", line)
        line = re.sub(r"\\.", "", line)  # \& \% \| \^ \c and anything else
        out.append(line.replace("\x00", "\\").rstrip())
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out))
    return text.strip() + "\n"


def manpage_documents():
    """Yield (name, text) for every section-1 man page, deduplicated across symlinks."""
    paths = sorted({os.path.realpath(p) for p in glob.glob("/usr/share/man/man1/*.gz")})
    for path in paths:
        with gzip.open(path, "rb") as f:
            text = roff_to_text(f.read().decode("utf-8", errors="replace"))
        if len(text) >= 200:  # skip ".so" redirects and empty stubs
            yield os.path.basename(path), text


def is_heldout(name):
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def build_corpus(corpus):
    docs = stdlib_documents() if corpus == "stdlib" else manpage_documents()
    train, heldout = [], []
    for name, text in docs:
        (heldout if is_heldout(name) else train).append((name, text))
    # Cap each held-out file so that one long file cannot fill the whole budget.
    heldout_text = "\n\n".join(truncate_lines(text, HELDOUT_CAP_CHARS // 16) for _, text in heldout)
    return train, heldout, truncate_lines(heldout_text, HELDOUT_CAP_CHARS)


def truncate_lines(text, limit):
    """Cut text to at most `limit` characters, at a line boundary."""
    if len(text) <= limit:
        return text
    return text[: text.rfind("\n", 0, limit) + 1]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts):
    """Byte-level BPE; encoding a string prepends <|begin_of_text|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def save_tokenizer(tok, out):
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def encode_stream(tok, texts):
    """Concatenate documents as doc EOS doc EOS ... into one int32 token tensor."""
    eos_id = tok.token_to_id(EOS)
    ids = []
    batch = 256
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- model


def make_config(bos_id, eos_id, experts=16, top_k=3):
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=192,
        num_hidden_layers=5,
        first_k_dense_replace=1,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        num_nextn_predict_layers=0,  # no multi-token-prediction module is trained
        # Not read by transformers; they describe the router the way the original
        # DeepSeek-V3 / Kimi-K2 config.json files do.
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
    )


class RouterRecorder:
    """Forward hooks on every MoE gate that keep the top-k expert indices of the last call."""

    def __init__(self, model):
        self.indices = {}
        self.gates = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.gates[i] = gate
                self.handles.append(gate.register_forward_hook(self._hook(i)))

    def _hook(self, layer_idx):
        def hook(module, inputs, output):
            _, _, topk_indices = output
            self.indices.setdefault(layer_idx, []).append(topk_indices.detach())
        return hook

    def counts(self, layer_idx):
        idx = torch.cat([t.flatten() for t in self.indices.get(layer_idx, [])])
        return torch.bincount(idx, minlength=self.gates[layer_idx].num_experts).double()

    def clear(self):
        self.indices.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def balance_router_bias(recorder, speed):
    """DeepSeek-V3 auxiliary-loss-free balancing: push each expert's bias toward mean load."""
    for layer_idx, gate in recorder.gates.items():
        load = recorder.counts(layer_idx)
        step = speed * torch.sign(load.mean() - load)
        gate.e_score_correction_bias += step.to(gate.e_score_correction_bias.dtype)
    recorder.clear()


def lr_at(step, elapsed, budget, peak, warmup_steps):
    """Linear warmup over steps, then cosine decay to 10% over the wall-clock budget."""
    warm = min(1.0, (step + 1) / warmup_steps)
    progress = min(1.0, elapsed / budget)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model, lr, weight_decay):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(stream, batch_size, bos_id, gen):
    starts = torch.randint(0, len(stream) - SEQ_LEN, (batch_size,), generator=gen)
    rows = [stream[s:s + SEQ_LEN] for s in starts.tolist()]
    body = torch.stack(rows).long()
    bos = torch.full((batch_size, 1), bos_id, dtype=torch.long)
    return torch.cat([bos, body], dim=1)


def train(model, stream, bos_id, args):
    recorder = RouterRecorder(model)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60.0
    model.train()
    step, tokens, recent = 0, 0, []
    history = []
    start = time.time()
    while (elapsed := time.time() - start) < budget:
        lr = lr_at(step, elapsed, budget, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(stream, args.batch_size, bos_id, gen)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        balance_router_bias(recorder, args.bias_update_speed)
        step += 1
        tokens += args.batch_size * SEQ_LEN
        recent.append(loss.item())
        history.append(loss.item())
        if step % args.log_every == 0:
            biases = torch.cat([g.e_score_correction_bias for g in recorder.gates.values()])
            log(f"step {step:5d}  tokens {tokens / 1e6:6.2f}M  loss {sum(recent) / len(recent):.4f}  "
                f"lr {lr:.2e}  {tokens / (time.time() - start):6.0f} tok/s  "
                f"elapsed {(time.time() - start) / 60:5.1f}m  bias [{biases.min():+.3f}, {biases.max():+.3f}]")
            recent = []
    recorder.remove()
    loadavg = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    final = history[-50:]
    return {"steps": step, "tokens": tokens, "train_seconds": time.time() - start,
            "final_train_loss": sum(final) / len(final), "loadavg": loadavg}


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_heldout(model, tokenizer, text, batch_size=16):
    """Mean next-token loss over consecutive 256-token chunks, each prefixed with BOS.

    Also returns, per MoE layer, the fraction of routed (token, slot) picks per expert.
    """
    model.eval()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = [[tokenizer.bos_token_id] + ids[i:i + SEQ_LEN] for i in range(0, len(ids), SEQ_LEN)]
    recorder = RouterRecorder(model)
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        group = chunks[i:i + batch_size]
        for length in sorted({len(c) for c in group}):  # only the last chunk may be shorter
            x = torch.tensor([c for c in group if len(c) == length])
            logits = model(input_ids=x).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                  x[:, 1:].reshape(-1), reduction="sum")
            total_nll += nll.item()
            total_tokens += x[:, 1:].numel()
    routing = {}
    for layer_idx in recorder.gates:
        counts = recorder.counts(layer_idx)
        routing[layer_idx] = (counts / counts.sum()).tolist()
    recorder.remove()
    loss = total_nll / total_tokens
    return {"loss": loss, "ppl": math.exp(loss), "tokens": total_tokens, "routing": routing}


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts, new_tokens=60):
    samples = {}
    for prompt in prompts:
        x = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**x, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        samples[prompt] = tokenizer.decode(out[0], skip_special_tokens=False)
    return samples


def routing_table(routing):
    lines = ["| layer | " + " | ".join(f"e{e}" for e in range(len(next(iter(routing.values())))))
             + " | max/min | max/mean |",
             "|---" * (len(next(iter(routing.values()))) + 3) + "|"]
    for layer_idx, frac in routing.items():
        mean = 1.0 / len(frac)
        ratio = max(frac) / max(min(frac), 1e-12)
        lines.append(f"| {layer_idx} | " + " | ".join(f"{f:.3f}" for f in frac)
                     + f" | {ratio:.1f} | {max(frac) / mean:.2f} |")
    return "\n".join(lines)


def write_report(path, args, info):
    ev = info["eval"]
    bias_lines = "\n".join(
        f"- layer {i}: min {min(b):+.4f}, max {max(b):+.4f}, mean |b| {sum(abs(x) for x in b) / len(b):.4f}"
        for i, b in info["biases"].items())
    samples = "\n\n".join(f"Prompt `{p!r}`:\n\n```\n{s}\n```" for p, s in info["samples"].items())
    text = f"""# {os.path.basename(os.path.normpath(args.out))}

Tiny DeepseekV3-architecture MoE causal LM trained from scratch on CPU by
`training/train.py`. Weights are bfloat16; the router bias
`e_score_correction_bias` is rounded to bfloat16 precision but stored as
float32, the dtype the original DeepSeek-V3 checkpoints use for it.

## Command

```
{info["command"]}
```

## Data

- corpus: `{args.corpus}` ({info["corpus_desc"]})
- files: {info["n_train_files"]} train, {info["n_heldout_files"]} held out
  (held out when `int(sha1(name), 16) % {HELDOUT_MODULUS} == 0`)
- training text: {info["train_chars"] / 1e6:.1f} M characters = {info["train_stream_tokens"] / 1e6:.2f} M tokens
- held-out text: `{args.heldout_out}` ({info["heldout_chars"] / 1e3:.0f} K characters; each held-out file
  cut to {HELDOUT_CAP_CHARS // 16000} K characters, total capped at {HELDOUT_CAP_CHARS // 1000} K)
- tokenizer: byte-level BPE, vocab {VOCAB_SIZE}, trained on the training files only;
  special tokens {", ".join(f"`{t}`" for t in SPECIAL_TOKENS)} (ids 0-3); encoding prepends `{BOS}`

## Model

- `DeepseekV3ForCausalLM`: {info["n_params"]:,} parameters
  ({info["n_active"]:,} active per token), 5 layers (1 dense + 4 MoE), hidden 256,
  MLA attention (4 heads, q_lora 96, kv_lora 64, nope 32 + rope 16, v 32),
  16 routed experts (top-3, sigmoid scores, normalised, x2.5) + 1 shared expert, expert FFN 192

## Training

- AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak lr {args.lr},
  {args.warmup_steps} warmup steps then cosine to 10% over the wall-clock budget, grad clip {args.grad_clip}
- batch {args.batch_size} x {SEQ_LEN} tokens (+BOS), fp32, {torch.get_num_threads()} threads
  (`OMP_WAIT_POLICY={os.environ.get("OMP_WAIT_POLICY")}`)
- router bias: auxiliary-loss-free balancing, after every step
  `bias += {args.bias_update_speed} * sign(mean_load - load)` per MoE layer
- steps: {info["steps"]}, tokens seen: {info["tokens"] / 1e6:.2f} M
  ({info["tokens"] / info["train_stream_tokens"]:.2f} epochs)
- training wall time: {info["train_seconds"] / 60:.1f} min (budget {args.minutes} min);
  whole script: {info["total_seconds"] / 60:.1f} min; average {info["tokens"] / info["train_seconds"]:.0f} tokens/s
  (load average at the end of training: {info["loadavg"]}; the 2 cores may be shared with other jobs)
- final train loss (mean of last 50 steps): {info["final_train_loss"]:.4f}

## Held-out evaluation

Evaluated on the bfloat16 checkpoint reloaded in float32: the held-out text is
tokenized, cut into consecutive {SEQ_LEN}-token chunks, each prefixed with BOS.

- tokens: {ev["tokens"]}
- loss: {ev["loss"]:.4f} nats/token, perplexity: {ev["ppl"]:.2f}

Routing on held-out text (fraction of the top-3 picks that go to each expert):

{routing_table(ev["routing"])}

Router bias after training:

{bias_lines}

## Greedy samples (60 new tokens)

{samples}

## Versions

torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}
"""
    with open(path, "w") as f:
        f.write(text)


# --------------------------------------------------------------------------- main


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", choices=["stdlib", "manpages"], required=True)
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock training budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-out", required=True, help="where to write the held-out text")
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default 16)")
    p.add_argument("--top-k", type=int, default=3, help="experts per token (default 3)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bias-update-speed", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args()


def main():
    args = parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    if os.path.dirname(args.heldout_out):
        os.makedirs(os.path.dirname(args.heldout_out), exist_ok=True)
    info = {"command": "python " + " ".join(sys.argv)}

    train_docs, heldout_docs, heldout_text = build_corpus(args.corpus)
    with open(args.heldout_out, "w") as f:
        f.write(heldout_text)
    train_texts = [text for _, text in train_docs]
    info.update(n_train_files=len(train_docs), n_heldout_files=len(heldout_docs),
                train_chars=sum(map(len, train_texts)), heldout_chars=len(heldout_text),
                corpus_desc=("*.py under " + os.path.dirname(os.__file__) + ", site-packages excluded"
                             if args.corpus == "stdlib" else
                             "/usr/share/man/man1/*.gz, roff markup stripped, symlinks deduplicated"))
    log(f"corpus {args.corpus}: {len(train_docs)} train files ({info['train_chars'] / 1e6:.1f} M chars), "
        f"{len(heldout_docs)} held out, held-out text {len(heldout_text)} chars -> {args.heldout_out}")

    tok = train_tokenizer(train_texts)
    save_tokenizer(tok, args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    assert tokenizer("def f")["input_ids"] == tok.encode("def f").ids
    stream = encode_stream(tok, train_texts)
    info["train_stream_tokens"] = len(stream)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, training stream {len(stream) / 1e6:.2f} M tokens "
        f"({info['train_chars'] / len(stream):.2f} chars/token)")

    config = make_config(tok.token_to_id(BOS), tok.token_to_id(EOS), args.experts, args.top_k)
    model = DeepseekV3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    info["n_params"] = n_params
    info["n_active"] = n_params - expert_params * (1 - config.num_experts_per_tok / config.n_routed_experts)
    info["n_active"] = int(info["n_active"])
    log(f"model: {n_params:,} parameters ({n_params / 1e6:.2f} M), {info['n_active']:,} active per token, "
        f"experts implementation {model.config._experts_implementation}")

    info.update(train(model, stream, tok.token_to_id(BOS), args))
    log(f"trained {info['steps']} steps, {info['tokens'] / 1e6:.2f} M tokens in "
        f"{info['train_seconds'] / 60:.1f} min, final train loss {info['final_train_loss']:.4f}")

    model.eval()
    # Every tensor, the router bias included, is rounded to bfloat16; the bias is
    # then stored as float32, the dtype DeepSeek-V3 / Kimi-K2 checkpoints use for
    # it (so the bias values are exactly representable in both dtypes).
    model.to(torch.bfloat16)
    for layer in model.model.layers[config.first_k_dense_replace:]:
        gate = layer.mlp.gate
        gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    model.save_pretrained(args.out, safe_serialization=True)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)  # written 0600 by default
    del model

    reloaded = DeepseekV3ForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    info["biases"] = {i: layer.mlp.gate.e_score_correction_bias.tolist()
                      for i, layer in enumerate(reloaded.model.layers) if i >= config.first_k_dense_replace}
    info["eval"] = evaluate_heldout(reloaded, tokenizer, heldout_text)
    log(f"held-out: loss {info['eval']['loss']:.4f}, perplexity {info['eval']['ppl']:.2f} "
        f"over {info['eval']['tokens']} tokens")
    log("routing on held-out text (fraction of picks per expert):\n" + routing_table(info["eval"]["routing"]))
    info["samples"] = greedy_samples(reloaded, tokenizer, SAMPLE_PROMPTS[args.corpus])
    for prompt, text in info["samples"].items():
        log(f"--- greedy sample for {prompt!r}:\n{text}\n---")

    info["total_seconds"] = time.time() - t0
    write_report(os.path.join(args.out, "TRAINING.md"), args, info)
    log(f"wrote {args.out} in {info['total_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
