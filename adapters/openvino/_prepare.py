"""Stateful OpenVINO IRs for GGUF models, built once into kvrt's cache folder.

A quantized GGUF is first rewritten to F16 (Q4 weights convert with real quality loss
otherwise), then ``openvino_genai.LLMPipeline(..., enable_save_ov_model=True)`` writes the
IR beside it. The build happens in a temporary folder renamed into place, so an
interrupted build never leaves a half model behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvrt._errors import ModelLoadError
from kvrt._model import file_digest, resolve_model_path

__all__ = ["IR_FILES", "IrInfo", "cache_root", "prepare_ir"]

IR_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
_INFO = "kvrt-ir.json"

Progress = Callable[[str, float], None]
"""Called with a stage description and the fraction done (0 to 1)."""


class IrInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What kvrt records about an IR it built (or reads from a user's export)."""

    source: str
    source_digest: str
    architecture: str
    name: str | None
    trained_context: int
    n_head: int | None = None


def cache_root() -> Path:
    base = os.environ.get("KVRT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvrt"
    )
    return Path(base) / "openvino"


def _is_ir(folder: Path) -> bool:
    return all((folder / name).is_file() for name in IR_FILES)


def _user_ir(folder: Path) -> tuple[Path, IrInfo]:
    if not _is_ir(folder):
        missing = [name for name in IR_FILES if not (folder / name).is_file()]
        raise ModelLoadError(f"{folder} holds no OpenVINO IR (missing {', '.join(missing)})")
    info_file = folder / _INFO
    if info_file.is_file():
        return folder, msgspec.json.decode(info_file.read_bytes(), type=IrInfo)
    config = folder / "config.json"
    trained = heads = None
    arch = "unknown"
    if config.is_file():
        data = msgspec.json.decode(config.read_bytes())
        trained = data.get("max_position_embeddings")
        arch = data.get("model_type", arch)
        heads = data.get("num_attention_heads")
    if not isinstance(trained, int):
        raise ModelLoadError(
            f"cannot tell the trained context of the IR in {folder}: add a config.json with "
            "max_position_embeddings"
        )
    return folder, IrInfo(
        source=str(folder),
        source_digest="",
        architecture=arch,
        name=None,
        trained_context=trained,
        n_head=heads if isinstance(heads, int) else None,
    )


def _rewrite_f16(
    src: Path, dst: Path, progress: Progress | None
) -> tuple[str, str | None, int, int | None]:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    name_field = reader.fields.get("general.name")
    trained_field = reader.fields.get(f"{arch}.context_length")
    heads_field = reader.fields.get(f"{arch}.attention.head_count")
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    total = len(reader.tensors)
    for n, tensor in enumerate(reader.tensors):
        qtype = tensor.tensor_type
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.array(tensor.data)
        else:
            data = gguf.quants.dequantize(tensor.data, qtype).astype(np.float16)
        writer.add_tensor(tensor.name, data)
        if progress is not None:
            progress("rewriting weights to F16", 0.5 * (n + 1) / total)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    trained = int(trained_field.contents()) if trained_field is not None else 0
    heads = int(heads_field.contents()) if heads_field is not None else None
    return arch, name_field.contents() if name_field is not None else None, trained, heads


def prepare_ir(model: str | None, *, progress: Progress | None = None) -> tuple[Path, IrInfo]:
    """The IR folder for ``model`` (a GGUF file, an IR folder, or ``None``: the embedded model)."""
    if model is not None and Path(model).expanduser().is_dir():
        return _user_ir(Path(model).expanduser())
    source = resolve_model_path(model)
    digest = file_digest(source)
    root = cache_root()
    target = root / f"{source.stem}-{digest[:16]}"
    if _is_ir(target) and (target / _INFO).is_file():
        return target, msgspec.json.decode((target / _INFO).read_bytes(), type=IrInfo)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        f16 = work / "model-f16.gguf"
        arch, name, trained, heads = _rewrite_f16(source, f16, progress)
        if progress is not None:
            progress("converting to an OpenVINO IR", 0.6)
        import openvino_genai

        try:
            openvino_genai.LLMPipeline(str(f16), "CPU", enable_save_ov_model=True)
        except Exception as exc:
            raise ModelLoadError(
                f"openvino_genai could not convert {source}: {str(exc).splitlines()[0]}"
            ) from exc
        f16.unlink()
        info = IrInfo(
            source=str(source),
            source_digest=digest,
            architecture=arch,
            name=name,
            trained_context=trained,
            n_head=heads,
        )
        (work / _INFO).write_bytes(msgspec.json.encode(info))
        if not _is_ir(work):
            raise ModelLoadError(f"openvino_genai wrote no complete IR for {source}")
        try:
            work.rename(target)
        except OSError:
            if not _is_ir(target):  # not someone else's finished build: a real failure
                raise
        if progress is not None:
            progress("done", 1.0)
        return target, info
    finally:
        shutil.rmtree(work, ignore_errors=True)
