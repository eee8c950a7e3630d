"""Stateful OpenVINO IRs for GGUF models, built once into kvrt's cache folder.

A quantized GGUF is first rewritten to F16 (Q4 weights convert with real quality loss
otherwise), then ``openvino_genai.LLMPipeline(..., enable_save_ov_model=True)`` writes the
IR beside it. The build happens in a temporary folder renamed into place, so an
interrupted build never leaves a half model behind; folders of builds whose process died
are removed by the next build, and when two processes build the same IR at once the
second to finish uses the first one's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvrt import ConfigError, ModelLoadError
from kvrt.backend import HeaderError, expand_path, file_digest, read_tensors, resolve_model_path

__all__ = ["IR_FILES", "IrInfo", "cache_root", "prepare_ir"]

IR_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
_INFO = "kvrt-ir.json"
CACHE_ENV = "KVRT_CACHE_DIR"

StageReport = Callable[[str, float], None]
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
    """Where built IRs are kept: ``$KVRT_CACHE_DIR/openvino``, by default under the home
    folder's ``.cache/kvrt``."""
    base = os.environ.get(CACHE_ENV)
    if base:
        if "\0" in base:
            raise ConfigError(f"{CACHE_ENV} holds a NUL character")
        return Path(base) / "openvino"
    try:
        home = Path.home()
    except RuntimeError:
        raise ConfigError(
            f"there is no home directory to keep built OpenVINO models in: set {CACHE_ENV} to "
            "a writable folder"
        ) from None
    return home / ".cache" / "kvrt" / "openvino"


def _cache_error(root: Path, exc: OSError) -> ConfigError:
    where = (
        f"{CACHE_ENV}={os.environ[CACHE_ENV]}"
        if os.environ.get(CACHE_ENV)
        else f"the default cache folder {root}"
    )
    return ConfigError(
        f"cannot keep built OpenVINO models in {where}: {exc.strerror or exc}; set {CACHE_ENV} "
        "to a writable folder"
    )


def _built(folder: Path) -> IrInfo | None:
    """The record of a complete IR kvrt built in ``folder``; None for anything else."""
    try:
        if not _is_ir(folder):
            return None
        return msgspec.json.decode((folder / _INFO).read_bytes(), type=IrInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def _clean_stale(root: Path) -> None:
    """Remove what killed builds left behind: build folders whose process is gone."""
    for entry in root.glob(".build-*"):
        pid = entry.name.split("-")[1]
        if pid.isdigit() and pid != str(os.getpid()) and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
    for entry in root.glob(".stale-*"):
        _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(work: Path, target: Path) -> IrInfo | None:
    """Rename the finished build into place. If another process finished the same build
    first, its IR is used (None returned); anything else in the way is moved aside."""
    for _ in range(3):
        try:
            work.rename(target)
            return _built(target)
        except OSError:
            theirs = _built(target)
            if theirs is not None:
                return theirs
        aside = target.with_name(f".stale-{os.getpid()}-{target.name}")
        try:
            target.rename(aside)
        except FileNotFoundError:
            continue
        _remove(aside)
    raise ModelLoadError(f"could not move the built OpenVINO model into {target}")


def _is_ir(folder: Path) -> bool:
    return all((folder / name).is_file() for name in IR_FILES)


def _user_ir(folder: Path) -> tuple[Path, IrInfo]:
    if not _is_ir(folder):
        missing = [name for name in IR_FILES if not (folder / name).is_file()]
        raise ModelLoadError(f"{folder} holds no OpenVINO IR (missing {', '.join(missing)})")
    found = _built(folder)
    if found is not None:
        return folder, found
    config = folder / "config.json"
    trained = heads = None
    arch = "unknown"
    if config.is_file():
        try:
            data = msgspec.json.decode(config.read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            raise ModelLoadError(f"cannot read {config}: {exc}") from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{config} does not hold a JSON object")
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
    src: Path, dst: Path, progress: StageReport | None
) -> tuple[str, str | None, int, int | None]:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "converting a GGUF file for OpenVINO writes one with the gguf package, which "
            "is not installed: pip install 'kvrt[openvino]' (or gguf)"
        ) from None
    import numpy as np

    fields, tensors = read_tensors(src, lambda key: True)
    file = np.memmap(src, dtype=np.uint8, mode="r")
    value_type = gguf.GGUFValueType
    arch = fields["general.architecture"][0]
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, (value, kind, sub) in fields.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            continue
        if key == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_key_value(
            key, value, value_type(kind), sub_type=None if sub is None else value_type(sub)
        )
    plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
    for n, tensor in enumerate(tensors):
        qtype = gguf.GGMLQuantizationType(tensor.ggml_type)
        shape = tuple(reversed(tensor.dims))
        count = int(np.prod(tensor.dims))
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        end = tensor.offset + count * size // block
        if end > file.size:
            raise HeaderError(f"tensor {tensor.name!r} runs past the end of the file")
        raw = file[tensor.offset : end]
        if qtype in plain:
            data = raw.view(plain[qtype]).reshape(shape).copy()
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            data = gguf.quants.dequantize(raw.reshape(byte_shape), qtype).astype(np.float16)
        writer.add_tensor(tensor.name, data)
        if progress is not None:
            progress("rewriting weights to F16", 0.5 * (n + 1) / len(tensors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    trained = fields.get(f"{arch}.context_length", (0,))[0]
    heads = fields.get(f"{arch}.attention.head_count", (None,))[0]
    return arch, fields.get("general.name", (None,))[0], int(trained), heads


def _reason(exc: Exception) -> str:
    """The message of an OpenVINO exception without its ``Exception from <source>:`` line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception from ")]
    return " ".join(lines) or type(exc).__name__


def prepare_ir(model: str | None, *, progress: StageReport | None = None) -> tuple[Path, IrInfo]:
    """The IR folder for ``model`` (a GGUF file, an IR folder, or ``None``: the embedded model)."""
    if model is not None and expand_path(model).is_dir():
        return _user_ir(expand_path(model))
    source = resolve_model_path(model)
    digest = file_digest(source)
    root = cache_root()
    target = root / f"{source.stem}-{digest[:16]}"
    found = _built(target)
    if found is not None:
        return target, found
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(root)
        work = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=root))
    except OSError as exc:
        raise _cache_error(root, exc) from None
    try:
        f16 = work / "model-f16.gguf"
        try:
            arch, name, trained, heads = _rewrite_f16(source, f16, progress)
        except OSError as exc:
            if exc.filename is not None and Path(exc.filename).parent == work:
                raise _cache_error(root, exc) from None
            raise ModelLoadError(
                f"cannot read model file {source}: {exc.strerror or exc}"
            ) from None
        except Exception as exc:  # the gguf reader's many ways of meeting a broken file
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelLoadError(f"{source} is not a readable GGUF model: {first}") from None
        if progress is not None:
            progress("converting to an OpenVINO IR", 0.6)
        import openvino_genai

        try:
            openvino_genai.LLMPipeline(str(f16), "CPU", enable_save_ov_model=True)
        except Exception as exc:
            raise ModelLoadError(
                f"openvino_genai {openvino_genai.__version__.split('-')[0]} cannot convert {source} "
                f"(architecture {arch!r}): {_reason(exc)}; give an OpenVINO IR folder "
                "instead, or use this model on the llama backend"
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
            published = _publish(work, target)
        except OSError as exc:
            raise _cache_error(root, exc) from None
        if progress is not None:
            progress("done", 1.0)
        return target, published or info
    finally:
        shutil.rmtree(work, ignore_errors=True)
