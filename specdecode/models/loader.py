"""Turn whatever names a model (short name, GGUF file, model directory, hub id) into one local directory.

Everything downstream reads only the canonical Hugging Face directory, so this is the single place
that knows about the other forms. Every failure is a one-line `SpecDecodeError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig
from specdecode.models.gguf import GGUF_MAGIC, QUANTIZATIONS, load_gguf, source_gguf
from specdecode.models.registry import REGISTRY, fetch

ACTIVATIONS = ("float32", "int8")  # what the quantized products take as inputs (`load_target`)

if TYPE_CHECKING:
    from specdecode.models.transformer import Transformer

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_model_dir(path: Path) -> Path:
    """Check that `path` is a Hugging Face model directory specdecode can load, and return it."""
    if not (path / "config.json").is_file():
        raise SpecDecodeError(f"{path} is not a model directory: it has no config.json")
    ModelConfig.from_dir(path)  # unsupported architectures fail here, not deep inside the model code
    if any(path.glob("*.safetensors")):
        return path
    if any(path.glob("pytorch_model*.bin")):
        raise SpecDecodeError(
            f"{path} has only pytorch_model.bin weights; specdecode needs safetensors "
            "(re-save it with transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise SpecDecodeError(f"{path} has no model weights (no *.safetensors file)")


def _from_hub(repo_id: str) -> Path | None:
    """The downloaded snapshot of a hub repo, or None when there is no hub client or no network."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        local = snapshot_download(repo_id=repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception:
        return None
    return Path(local)


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """The canonical model directory for a short name, a `.gguf` file, a model directory or a hub id."""
    name = str(name_or_path).strip()
    if not name:
        raise SpecDecodeError("no model given")
    if name in REGISTRY:
        return load_gguf(fetch(name, progress=progress), progress=progress)
    path = Path(name).expanduser()
    if path.is_file():
        if _is_gguf(path):
            return load_gguf(path, progress=progress)
        raise SpecDecodeError(f"{path} is neither a .gguf file nor a model directory")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return load_gguf(ggufs[0], progress=progress)
        return check_model_dir(path)
    if path.suffix.lower() == ".gguf" or name.startswith(("/", "./", "../", "~")):
        raise SpecDecodeError(f"no such file or directory: {name}")
    if _HUB_ID.fullmatch(name):
        local = _from_hub(name)
        if local is not None:
            return check_model_dir(local)
    raise SpecDecodeError(
        f"unknown model {name!r}: not a known name ({', '.join(REGISTRY)}), a file, a directory, "
        "or a reachable hub id"
    )


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def load_target(
    path: Path,
    dtype: str | torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    activations: str = "float32",
) -> Transformer:
    """The model in the directory `path` (from `resolve_model`). dtype "auto": on a CPU a GGUF's
    weights as stored, in their block formats (float32 activations), anything else in float32; on
    a GPU bfloat16; "float32" / "bfloat16" / "float16": every weight dequantized to that dtype.
    `quantization` (q4_0, q4_1, q5_0, q8_0): a float checkpoint's linear weights and LM head
    quantized on load and run as a GGUF's are (CPU, float32 activations). `activations` "int8"
    (weights in block formats only): the quantized products round their inputs to int8 per group
    of 32 where that is faster (`Kernels.int8_activations`), as llama.cpp does; "float32" keeps
    the results those of the dequantized weights (transformers' on them)."""
    from specdecode.models.transformer import Transformer

    if activations not in ACTIVATIONS:
        raise SpecDecodeError(f"unknown activations {activations!r}: use one of {', '.join(ACTIVATIONS)}")
    if quantization is not None:
        quantization = _check_quantization(path, quantization, dtype)
        model = load_quantized(path, quantization, device)
    elif dtype == "auto" and device.type != "cpu":  # a GPU's matrix units and bandwidth are bfloat16's
        model = Transformer.from_dir(path, torch.bfloat16, device)
    elif dtype == "auto":
        model = Transformer.from_dir(path, torch.float32, device, stored=source_gguf(path))
    else:
        model = Transformer.from_dir(path, resolve_dtype(dtype), device)
    if activations == "int8":
        if model.kernels.quant is None or not model.runs_stored:
            raise SpecDecodeError(
                "activations=int8 needs weights in block formats on the CPU kernels: a GGUF with dtype "
                f"auto or a float checkpoint with quantization=... (here: dtype {dtype}, on {device}, "
                f"kernels {model.kernels.name})"
            )
        model.bind_kernels(model.kernels.int8_activations())
    return model


def load_quantized(path: Path, quantization: str, device: torch.device) -> Transformer:
    """The model in `path` with its linear weights and LM head quantized on load into
    `quantization` (one of `gguf.QUANTIZATIONS`), from its float weights: for a directory
    converted from a GGUF, the stored blocks dequantized and quantized again. The target refuses
    that (`load_target`: a GGUF runs as stored); a draft model may ask for it, fewer bytes per
    draft token (`DraftModelConfig.draft_dtype`)."""
    from specdecode.models.transformer import Transformer

    if device.type != "cpu":
        raise SpecDecodeError(f"quantization={quantization} runs on the CPU kernels, not on {device}")
    return Transformer.from_dir(
        path, torch.float32, device, stored=source_gguf(path), quantization=quantization
    )


def _check_quantization(path: Path, quantization: str, dtype: str | torch.dtype) -> str:
    """`quantization` in canonical form, or a SpecDecodeError saying why it cannot apply."""
    name = str(quantization).lower()
    if name not in QUANTIZATIONS:
        raise SpecDecodeError(f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if dtype not in ("auto", "float32", torch.float32):
        raise SpecDecodeError(f"quantization={name} computes in float32 (dtype auto or float32, not {dtype})")
    if source_gguf(path) is not None:
        raise SpecDecodeError(
            f"quantization={name}: the model is a GGUF, already quantized (dtype auto runs it as stored)"
        )
    return name


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype name or torch dtype checked against those the model runs in."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise SpecDecodeError(f"unsupported dtype {dtype}: use float32, bfloat16 or float16")
    try:
        return DTYPES[dtype]
    except KeyError:
        raise SpecDecodeError(
            f"unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16"
        ) from None


def resolve_device(device: str | None) -> torch.device:
    """`None`/"auto": CUDA when there is one, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SpecDecodeError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device!r} requested but no CUDA GPU is available")
    return dev
