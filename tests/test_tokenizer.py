"""runtime.tokenizer against reference tokenizers we did not write: transformers' AutoTokenizer for
`tokenizer.json`, and transformers' TikTokenConverter (with Kimi's split pattern) for `tiktoken.model`."""

import json
import random

import pytest
import tokfixtures as fx

from kimistream.runtime.tokenizer import KIMI_PATTERN, Tokenizer, TokenizerError

MESSAGES = [
    {"role": "system", "content": "Be brief.", "meta": {"lang": "fr", "ids": [1, 2]}},
    {"role": "user", "content": "Bonjour — ça va? 日本語 🙂\n\tcode:\r\n  x = 1234567"},
    {"role": "assistant", "content": "Oui <|im_end|> merci.", "tool_calls": None},
    {"role": "user", "content": "Et toi?"},
]


def load(kind, d, *names):
    return Tokenizer(kind, {n: (d / n).read_bytes() for n in names})


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("hf")
    fx.write_hf_dir(d)
    ours = load("hf", d, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    return ours, AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def tt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken")
    n_base = fx.write_tiktoken_dir(d, chat_template=fx.CHAT_TEMPLATE)
    return load("tiktoken", d, "tiktoken.model", "tokenizer_config.json"), fx.tiktoken_reference(d, n_base)


@pytest.fixture(params=["hf", "tt"])
def pair(request):
    return request.getfixturevalue(request.param)


def random_texts(n=300, seed=0):
    """Short strings mixing letters of many scripts and cases, marks, digits, punctuation and whitespace."""
    pool = list("aZsStTmMdDlL'’ \t\n\r1234567890.,!?-_(){}<>|&#") + list(
        "\u017f\u212a\u0130\u0131éßǅʰ\u0301\u0308中文日本アー한🙂🏽\u200d"
        "\u00a0\u3000\u2028\u0085٣²Ⅻاל\u05b0\ufeff\x0b\x1c")
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 16))) for _ in range(n)]


@pytest.mark.parametrize("name", fx.SAMPLES)
def test_encode_matches_reference(pair, name):
    ours, ref = pair
    text = fx.SAMPLES[name]
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_random_text_matches_reference(pair):
    ours, ref = pair
    for text in random_texts():
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize("name", fx.SAMPLES)
def test_decode_round_trip(pair, name):
    ours, ref = pair
    ids = ours.encode(fx.SAMPLES[name], add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids) == fx.SAMPLES[name]
    for i in range(len(ids)):  # prefixes may end inside a UTF-8 sequence
        assert ours.decode(ids[:i]) == ref.decode(ids[:i])
    with_bos = [ours.bos_id, *ids, ours.eos_id]
    assert ours.decode(with_bos, skip_special_tokens=True) == ref.decode(with_bos, skip_special_tokens=True)


def test_ids_and_sizes(pair):
    ours, ref = pair
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.vocab_size == len(ref)


def test_hf_adds_bos_from_post_processor(hf):
    ours, _ = hf
    assert ours.encode("hi")[0] == ours.bos_id != ours.encode("hi", add_special_tokens=False)[0]


def test_tiktoken_special_token_ids(tt):
    ours, ref = tt
    assert KIMI_PATTERN == fx.KIMI_PAT
    n_base = ours.vocab_size - 256
    for i, name in enumerate(fx.kimi_special_names(n_base)):
        assert ours.encode(f"a{name}b") == ref(f"a{name}b")["input_ids"]
        assert ours.encode(name) == [n_base + i] == [ref.convert_tokens_to_ids(name)]


def test_tiktoken_splits_long_runs_like_kimi(tt):
    """Kimi encodes <=400k-char windows and <=25k-char runs of (non-)whitespace separately."""
    ours, ref = tt
    text = "x" + "ab" * 12_500 + " " * 25_003 + "z" + " quick" * 66_000 + " the end"
    chunks = list(fx.kimi_chunks(text))
    assert [len(c) for c in chunks] == [25_000, 25_001, 349_999, 46_013]  # cuts split 'ab', ' quick'
    expected = [i for c in chunks for i in ref(c, add_special_tokens=False)["input_ids"]]
    assert expected != ref(text, add_special_tokens=False)["input_ids"]  # the split is visible
    assert ours.encode(text) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_reference(pair, add_generation_prompt):
    ours, ref = pair
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.render_chat(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert ours.encode(got, add_special_tokens=False) == ref(want, add_special_tokens=False)["input_ids"]


def test_render_chat_raise_exception(hf):
    ours, _ = hf
    with pytest.raises(TokenizerError, match="system message must come first"):
        ours.render_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_render_chat_without_template(tmp_path):
    n_base = fx.write_tiktoken_dir(tmp_path)
    ours = load("tiktoken", tmp_path, "tiktoken.model", "tokenizer_config.json")
    assert ours.vocab_size == n_base + 256
    with pytest.raises(TokenizerError, match="no chat template"):
        ours.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("model, line", [
    (b"YQ== 0\nYg==\n", 2),          # rank missing
    (b"YQ== 0\nYg== one\n", 2),      # rank not an integer
    (b"YQ== 0\n\nYg== 1 2\n", 3),    # extra field
    (b"YQ= 0\n", 1),                 # bad base64 padding
])
def test_malformed_tiktoken_line(model, line):
    with pytest.raises(TokenizerError, match=rf"tiktoken\.model line {line}: expected 'BASE64 RANK'"):
        Tokenizer("tiktoken", {"tiktoken.model": model, "tokenizer_config.json": b"{}"})


def test_tiktoken_ranks_must_be_dense():
    with pytest.raises(TokenizerError, match="ranks are not 0..1"):
        Tokenizer("tiktoken", {"tiktoken.model": b"YQ== 0\nYg== 5\n", "tokenizer_config.json": b"{}"})


def test_malformed_config():
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer("tiktoken", {"tiktoken.model": b"YQ== 0\n", "tokenizer_config.json": b"{"})


HOSTILE_TEMPLATES = {
    "a loop that prints nothing": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                   "longer than"),
    "unbounded recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "division by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "a huge string": ("{{ 'x' * 1000000000 }}", "exceed"),
    "a huge output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output exceeds"),
    "a huge power": ("{{ 10 ** 10000000 }}", "exponent"),
    "a syntax error": ("{% for %}", "TemplateSyntaxError"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_are_bounded(hf, case):
    """A chat template is code from the model's files: whatever it does, rendering ends within the
    time bound with one line saying why."""
    import time
    ours, _ = hf
    template, words = HOSTILE_TEMPLATES[case]
    saved = ours.chat_template
    ours.chat_template = template
    try:
        t0 = time.monotonic()
        with pytest.raises(TokenizerError, match=words) as e:
            ours.render_chat([{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)
    finally:
        ours.chat_template = saved


def test_chat_markers(pair):
    """The template's role markers and the one token each is; None where the vocabulary splits one."""
    ours, _ = pair
    markers = ours.chat_markers()
    assert "<|im_start|>" in markers and "<|im_end|>" in markers
    for m, i in markers.items():
        ids = ours.encode(m, add_special_tokens=False)
        assert i == (ids[0] if len(ids) == 1 else None)
    assert any(i is not None for i in markers.values())
    ours.chat_template = "<|im_start|>{{ messages[0].content }}<|not_a_token|>"
    try:
        assert ours.chat_markers()["<|not_a_token|>"] is None
    finally:
        ours.chat_template = ours.config.get("chat_template") or fx.CHAT_TEMPLATE


def test_generation_config_names_more_ids_that_end_generation(tmp_path):
    """generation_config.json's eos_token_id (one id or several) ends generation beside the eos token,
    as transformers' generate() does: Kimi K2 Instruct ends a turn with <|im_end|>, which only that
    file names. A malformed one, or a tokenizer_config.json that is not an object, is one error."""
    n_base = fx.write_tiktoken_dir(tmp_path)
    files = {n: (tmp_path / n).read_bytes() for n in ("tiktoken.model", "tokenizer_config.json")}
    plain = Tokenizer("tiktoken", files)
    assert plain.stop_ids == {n_base + 1}                                   # [EOS]
    im_end = plain.token_id("<|im_end|>")
    for eos, want in ((im_end, {n_base + 1, im_end}), ([im_end, 7], {n_base + 1, im_end, 7}), (None, {n_base + 1})):
        gen = json.dumps({"eos_token_id": eos, "max_length": 128}).encode()
        assert Tokenizer("tiktoken", {**files, "generation_config.json": gen}).stop_ids == want
    for bad in (b'{"eos_token_id": "2"}', b'{"eos_token_id": [1, -3]}', b'{"eos_token_id": true}', b"[1]"):
        with pytest.raises(TokenizerError, match="generation_config.json: "):
            Tokenizer("tiktoken", {**files, "generation_config.json": bad})
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not a JSON object"):
        Tokenizer("tiktoken", {**files, "tokenizer_config.json": b"[]"})


def test_kimi_run_stops_at_generation_config_eos(monkeypatch, capsys):
    """kimi-run stops where generation_config.json says generation ends (the bundled model, greedy:
    its third token made an end-of-generation id)."""
    from kimistream.runtime import cli
    from kimistream.runtime import tokenizer as T

    def run():
        assert cli.main(["--prompt", "def ", "--max-tokens", "6", "--json", "--temperature", "0"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    free = run()
    assert len(free["tokens"]) == 6 and free["stats"]["stop_reason"] == "max tokens"
    third = free["tokens"][2]
    assert third not in free["tokens"][:2]
    monkeypatch.setattr(T, "_generation_stop_ids", lambda files: {third})
    stopped = run()
    assert stopped["tokens"] == free["tokens"][:3] and stopped["stats"]["stop_reason"] == "eos"
