"""Test fixtures: tiny random DeepseekV3 checkpoints written by transformers itself (the reference),
with a small byte-level BPE tokenizer, and helpers to run the reference model."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE_TEXT = (
    "def main(argv):\n    return 0\n"
    "The quick brown fox jumps over the lazy dog. Ünïcödé — 日本語のテキスト, emoji 🙂!\n"
    "for i in range(10): print(i ** 2)\n"
) * 4


def make_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([SAMPLE_TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))


def tiny_config(**over) -> dict:
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               max_position_embeddings=512, tie_word_embeddings=False, routed_scaling_factor=2.5,
               norm_topk_prob=True, bos_token_id=0, eos_token_id=1,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.update(over)
    return cfg


def make_checkpoint(out: Path, seed: int = 0, dtype: str = "float32", **over):
    """Save a random DeepseekV3ForCausalLM (norms and router biases randomised too) in HF layout."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**tiny_config(**over))
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.to(getattr(torch, dtype)).save_pretrained(out)
    make_tokenizer(out, cfg.vocab_size)
    return model


def reference_logits(ckpt_dir: Path, ids) -> "np.ndarray":
    import torch
    from transformers import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def reference_greedy(ckpt_dir: Path, ids, n: int) -> list[int]:
    import torch
    from transformers import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([list(ids)])
        # An explicit mask: otherwise generate() masks prompt tokens that equal pad_token_id.
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
