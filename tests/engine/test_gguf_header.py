"""kvrt's GGUF header reader against ``gguf.GGUFReader``, the format's own reader: every
field of the embedded model and of zoo models, value and type; damaged files refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from kvrt import ModelLoadError
from kvrt._engine.embedded import embedded_model_path
from kvrt._engine.gguf_header import HeaderError, read_header
from kvrt._engine.model_files import read_gguf_metadata
from tests.support.models import tiny, zoo_path


def _reference(path: str | Path) -> dict[str, tuple[Any, int, int | None]]:
    reader = gguf.GGUFReader(str(path))
    out: dict[str, tuple[Any, int, int | None]] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file's counts
            continue
        sub = int(f.types[1]) if len(f.types) > 1 else None
        out[key] = (f.contents(), int(f.types[0]), sub)
    return out


def _every_type(folder: Path) -> Path:
    """A GGUF file holding a field of every value type and an array of each."""
    t = gguf.GGUFValueType
    path = folder / "every-type.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    scalars = {
        t.UINT8: 7, t.INT8: -7, t.UINT16: 65535, t.INT16: -300, t.UINT32: 1 << 31,
        t.INT32: -(1 << 30), t.FLOAT32: 0.1, t.BOOL: True, t.STRING: "héllo ⟨tool⟩",
        t.UINT64: 1 << 40, t.INT64: -(1 << 40), t.FLOAT64: 1e-300,
    }  # fmt: skip
    for vtype, value in scalars.items():
        writer.add_key_value(f"one.{vtype.name}", value, vtype)
        many = [value, value] if vtype is not t.BOOL else [True, False, True]
        writer.add_key_value(f"many.{vtype.name}", many, t.ARRAY, sub_type=vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_every_field_equals_the_format_readers(tmp_path: Path) -> None:
    """Every value type, scalar and array, field by field (the format's reader takes 4 s
    over a real model's tokenizer: the zoo's files, written from it, check that below)."""
    path = _every_type(tmp_path)
    mine = read_header(path, lambda key: True)
    reference = _reference(path)
    assert list(mine) == list(reference) and len(mine) >= 20
    for key, (value, vtype, sub) in reference.items():
        assert mine[key][1:] == (vtype, sub), key
        assert mine[key][0] == value, key


def test_skipped_keys_are_left_out() -> None:
    fields = read_header(embedded_model_path(), lambda key: not key.startswith("tokenizer."))
    assert "general.architecture" in fields and not any(k.startswith("tokenizer.") for k in fields)


def test_a_zoo_model_carries_the_embedded_models_vocabulary(engine: Any) -> None:
    """The zoo copies the tokenizer it reads: llama.cpp loads the copy with the embedded
    model's vocabulary, token for token."""
    tokens = read_header(embedded_model_path(), lambda k: k == "tokenizer.ggml.tokens")
    words = tokens["tokenizer.ggml.tokens"][0]
    zoo = read_header(zoo_path("llama"), lambda k: k.startswith("tokenizer."))
    assert zoo["tokenizer.ggml.tokens"][0] == words and len(words) == engine.facts.n_vocab
    sample = "Hello, wörld! <|im_start|>user\n  def f(x): return x ** 2"
    assert tiny().tokenize(sample, parse_special=True) == engine.tokenize(
        sample, parse_special=True
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"",
        lambda data: b"GGML" + data[4:],
        lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:],
        lambda data: data[: len(data) // 50],
        lambda data: data[:24] + b"\xff" * 8 + data[32:],  # the first key's length
    ],
    ids=["empty", "magic", "version", "cut", "length"],
)
def test_a_damaged_header_is_refused_with_a_reason(damage: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(embedded_model_path().read_bytes()[: 4 << 20]))
    with pytest.raises(HeaderError):
        read_header(bad, lambda key: True)
    with pytest.raises(ModelLoadError, match="cannot read GGUF metadata"):
        read_gguf_metadata(bad)
