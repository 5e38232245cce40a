"""Our safetensors reader against the `safetensors` library on the same malformed files: every file
the library refuses, ours refuses with a one-line SafetensorsError naming the file, and the files it
reads we read alike (a header with leading spaces, too). The rules: header a JSON object, each entry a
known dtype,
a shape of non-negative integers and data_offsets [begin, end] of its exact size, the entries tiling
the data buffer in order with no overlap, gap or trailing bytes."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kimistream.formats.safetensors import SafetensorsError, SafetensorsFile


def write(path, header: dict, data: bytes, raw_header: bytes | None = None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def good():
    """Two tensors: a [2, 3] float32 at 0..24 and a [4] float32 at 24..40."""
    hdr = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}
    return hdr, np.arange(10, dtype="<f4").tobytes()


def mutate(kind):
    hdr, data = good()
    raw = None
    if kind == "overlap":
        hdr["b"]["data_offsets"] = [16, 32]
        data = data[:32]
    elif kind == "gap":
        hdr["b"]["data_offsets"] = [28, 44]
        data = data + b"\0" * 4
    elif kind == "shifted":
        hdr["a"]["data_offsets"] = [4, 28]
        hdr["b"]["data_offsets"] = [28, 44]
        data = data + b"\0" * 4
    elif kind == "trailing":
        data = data + b"\0" * 8
    elif kind == "wrong_size":
        hdr["a"]["shape"] = [2, 2]
    elif kind == "shape_string":
        hdr["a"]["shape"] = ["2", 3]
    elif kind == "shape_negative":
        hdr["a"]["shape"] = [-2, -3]
    elif kind == "offsets_float":
        hdr["a"]["data_offsets"] = [0.0, 24]
    elif kind == "reversed_offsets":
        hdr["a"]["data_offsets"] = [24, 0]
    elif kind == "past_end":
        data = data[:-4]
    elif kind == "not_object":
        raw = b"[1, 2]  "
    elif kind == "metadata_not_strings":
        hdr["__metadata__"] = {"format": 1}
    elif kind == "unknown_dtype":
        hdr["a"]["dtype"] = "F12"
    return hdr, data, raw


KINDS = ["overlap", "gap", "shifted", "trailing", "wrong_size", "shape_string", "shape_negative",
         "offsets_float", "reversed_offsets", "past_end", "not_object",
         "metadata_not_strings", "unknown_dtype"]


@pytest.mark.parametrize("kind", KINDS)
def test_refused_like_the_library(tmp_path, kind):
    path = write(tmp_path / "m.safetensors", *mutate(kind))
    with pytest.raises(Exception):
        load_file(str(path))                        # the reference refuses it ...
    with pytest.raises(SafetensorsError) as e:      # ... and so do we, in one line naming the file
        SafetensorsFile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_valid_files_read_alike(tmp_path):
    hdr, data = good()
    for path in (write(tmp_path / "m.safetensors", hdr, data),
                 write(tmp_path / "s.safetensors", hdr, data, b"  " + json.dumps(hdr).encode())):
        ref = load_file(str(path))
        st = SafetensorsFile(path)
        for k in ref:
            np.testing.assert_array_equal(st.read(k), ref[k])
        st.close()
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((i + 1, 3)).astype(np.float32) for i in range(5)}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "np"})
    st = SafetensorsFile(tmp_path / "lib.safetensors")
    for k, v in tensors.items():
        np.testing.assert_array_equal(st.read(k), v)
    st.close()
