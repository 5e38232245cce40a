"""Malformed metadata gets one line naming the file and the problem, never a traceback: a config.json
that is not an object, wrongly typed values (strings or booleans for integers, a string for
rope_scaling, YaRN without a factor or with a non-numeric one, a non-integer eos), JSON nested
deeper than the parser's recursion limit, a weight file whose header documents have the wrong type or
whose config disagrees with its tensors (kimi-verify reports those too), a plain .npy as --imatrix."""

import json
import shutil

import pytest

from test_cli import convert

CASES = {
    "not an object": (None, "[1, 2]", "not a JSON object"),
    "nested JSON": (None, '{"a":' * 100000 + "1" + "}" * 100000, "not valid JSON"),
    "string for an integer": ({"hidden_size": "64"}, None, "hidden_size"),
    "boolean for an integer": ({"num_attention_heads": True}, None, "num_attention_heads"),
    "string for an expert count": ({"n_routed_experts": "8"}, None, "n_routed_experts"),
    "string for a float": ({"rms_norm_eps": "1e-6"}, None, "rms_norm_eps"),
    "string eos": ({"eos_token_id": "2"}, None, "eos_token_id"),
    "rope_scaling a string": ({"rope_parameters": None, "rope_scaling": "yarn"}, None, "rope_scaling must be an object"),
    "YaRN without factor": ({"rope_parameters": None, "rope_scaling": {"type": "yarn"}}, None, "needs a factor"),
    "YaRN factor not a number": ({"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": "x"}}, None,
                                 "not a number"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_config_is_one_line(tiny_ckpt, tmp_path, case):
    changes, raw, words = CASES[case]
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    if raw is not None:
        (ck / "config.json").write_text(raw)
    else:
        cfg = json.loads((ck / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (ck / "config.json").write_text(json.dumps(cfg))
    proc = convert(ck, "-o", tmp_path / "m.kst", "--quant", "f32", "--calibration", "none", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config.json" in lines[0] and words in lines[0], proc.stderr
    assert not (tmp_path / "m.kst").exists()


def rewrite_header(src, dst, mutate):
    """A copy of weight file src whose header JSON is changed by mutate (and its digest redone, so
    only the semantic checks can catch it)."""
    from kimistream.formats import weightfile as W
    from kimistream.formats.checksum import header_digest
    raw = src.read_bytes()
    magic, version, alignment, hoff, hlen, data_start, size, _ = W._PREFIX.unpack(raw[:W.PREFIX_SIZE])
    header = json.loads(raw[hoff:hoff + hlen])
    mutate(header)
    hb = json.dumps(header).encode()
    assert hoff + len(hb) <= data_start
    prefix = W._PREFIX.pack(magic, version, alignment, hoff, len(hb), data_start, size, header_digest(hb))
    dst.write_bytes(prefix + raw[W.PREFIX_SIZE:hoff] + hb + b" " * (data_start - hoff - len(hb)) + raw[data_start:])
    return dst


HEADER_CASES = {
    "config not an object": (lambda h: h.__setitem__("config", [1]), "config is not an object"),
    "config value of the wrong type": (lambda h: h["config"].__setitem__("num_hidden_layers", "2"),
                                       "num_hidden_layers"),
    "tokenizer not an object": (lambda h: h.__setitem__("tokenizer", "x"), "tokenizer is not an object"),
    "plan not an object": (lambda h: h.__setitem__("plan", [1]), "plan is not an object"),
    "config disagrees with the tensors": (lambda h: h["config"].__setitem__(
        "num_hidden_layers", h["config"]["num_hidden_layers"] + 1), "is not in the file"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_weight_file_header_semantics(tiny_kst, tmp_path, case):
    """kimi-run refuses in one line, and kimi-verify no longer says OK for a file kimi-run cannot run."""
    from test_cli import kimi_run, run
    mutate, words = HEADER_CASES[case]
    bad = rewrite_header(tiny_kst, tmp_path / "bad.kst", mutate)
    proc = kimi_run("--weights", bad, "--prompt", "hi", "--max-tokens", "1", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(bad) in errors[0] and words in errors[0], proc.stderr
    proc = run("convert.verify_cli", bad, "--json", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and words in proc.stdout


def test_plain_npy_as_imatrix(tiny_ckpt, tmp_path):
    import numpy as np
    npy = tmp_path / "plain.npy"
    np.save(npy, np.zeros(3))
    proc = convert(tiny_ckpt, "-o", tmp_path / "m.kst", "--quant", "q2", "--imatrix", npy, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "plain.npy" in lines[0] and "not an importance matrix" in lines[0]
