"""Malformed metadata gets one line naming the file and the problem, never a traceback: a config.json
that is not an object, wrongly typed values (strings or booleans for integers, a string for
rope_scaling, YaRN without a factor or with a non-numeric one, a non-integer eos), and JSON nested
deeper than the parser's recursion limit."""

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
