"""Checkpoint plumbing shared by the trained drafter heads (Medusa, EAGLE, ReDrafter).

Each head keeps its own layouts (which tensors, which config keys, how a reference checkpoint is
renamed); what is the same for all of them lives here: a directory holding one weights file and a
`config.json`, tensors read from safetensors or a torch pickle, a state dict loaded with shape
checks, the heads shipped in `specdecode/heads/<model>/<method>/`, the size check against the
target, and a draft vocabulary (the token ids a head drafts from: stored beside its weights, read
through the target's LM head over just those columns). `what` names the head in error messages
("EAGLE", "Medusa", ...), so a user sees which checkpoint is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor, nn

from specdecode.errors import SpecDecodeError
from specdecode.layers.lm_head import DraftHead
from specdecode.models.transformer import Transformer

CONFIG = "config.json"
DRAFT_VOCAB = "draft_vocab"  # optional tensor of a weights file: the ids the head drafts from
M = TypeVar("M", bound=nn.Module)
SHIPPED = Path(__file__).resolve().parents[1] / "heads"


def save(out: Path, weights: str, tensors: dict[str, Tensor], config: dict[str, Any]) -> Path:
    """Write `tensors` to `out/weights` (safetensors) and `config` to `out/config.json`.

    One config key per line, each value on its line: a fitted tree of dozens of paths stays
    readable. Each file is replaced atomically, so a crash never leaves half a checkpoint."""
    from safetensors.torch import save_file

    from specdecode.models.cache import atomic_file

    with atomic_file(out / weights) as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp))
    text = "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in config.items()) + "\n}\n"
    with atomic_file(out / CONFIG) as tmp:
        tmp.write_text(text)
    return out


class SavableHead(Protocol):
    """A drafter head that `save_head` can write: the name of its weights file, and what it saves
    besides its state dict."""

    WEIGHTS: ClassVar[str]

    def state_dict(self) -> dict[str, Tensor]: ...

    def saved(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Its config (a fitted tree included) and the tensors stored as they are (not cast)."""
        ...


def save_head(
    head: SavableHead,
    out: str | Path,
    target: str,
    dtype: torch.dtype = torch.float16,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `head` in specdecode's layout to the directory `out`; weights stored as `dtype`,
    `extra` added to its config."""
    config, tensors = head.saved()
    state = {name: t.detach().to("cpu", dtype) for name, t in head.state_dict().items()}
    meta = {"target": target, "dtype": str(dtype).removeprefix("torch.")}
    return save(Path(out), head.WEIGHTS, {**state, **tensors}, {**config, **(extra or {}), **meta})


def read_config(directory: Path) -> dict[str, Any]:
    """`directory/config.json` as a dict; {} when there is none (a reference checkpoint may lack it)."""
    file = directory / CONFIG
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"{file} is not valid JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def read_tensors(file: Path, what: str) -> dict[str, Tensor]:
    """The tensors of a safetensors file, or of a torch pickle (.bin / .pt, as reference repos ship)."""
    try:
        if file.suffix in (".bin", ".pt"):
            state = torch.load(file, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file

            state = load_file(str(file))
    except Exception as exc:  # safetensors and torch.load raise many types for a damaged file
        raise SpecDecodeError(f"cannot read {what} weights {file}: {exc}") from None
    if not isinstance(state, dict):
        raise SpecDecodeError(f"{file} does not hold a state dict")
    return state


def load_state(module: nn.Module, state: dict[str, Tensor], source: Path, what: str) -> None:
    """Load `state` into `module`, naming the first missing or mis-shaped weight (torch's own error
    lists every key, which hides the one that matters). Extra tensors in `state` are ignored."""
    expected = module.state_dict()
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise SpecDecodeError(f"{source} is missing {what} weights, e.g. {missing[0]!r}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise SpecDecodeError(
                f"{source}: weight {name} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}"
            )
    module.load_state_dict({name: state[name] for name in expected})


def open_directory(path: str | Path, what: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory `path` (user-expanded) and its config ({} when it has none)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise SpecDecodeError(f"{what} {root}: no such directory")
    return root, read_config(root)


def check_method(root: Path, config: dict[str, Any], method: str, a_what: str) -> None:
    """specdecode's layout names its method in the config: a head of another kind (or a missing
    config) next to our weights file is an error, not a guess. `a_what` is e.g. "an EAGLE"."""
    if config.get("method") != method:
        raise SpecDecodeError(f"{root / CONFIG} is missing or not {a_what} config (method != {method!r})")


def reference_file(root: Path, names: tuple[str, ...]) -> Path | None:
    """The first of a reference layout's weights files (by preference) that `root` holds."""
    return next((root / name for name in names if (root / name).is_file()), None)


@dataclass(frozen=True)
class Layouts:
    """How one kind of head is stored: specdecode's layout (`weights` + config naming `method`)
    and its reference implementation's (`reference_weights`, described by `reference_note` in
    the error that finds neither)."""

    what: str  # "Medusa heads", in messages
    method: str  # the config's "method"
    a_what: str  # "a Medusa", in the wrong-method message
    weights: str
    reference_weights: tuple[str, ...]
    reference_note: str  # " (Medusa reference)"


def load_either(
    path: str | Path,
    layouts: Layouts,
    ours: Callable[[Path, dict[str, Any]], M],
    reference: Callable[[Path, dict[str, Any]], M],
    dtype: torch.dtype,
    device: torch.device | str,
    reference_ok: Callable[[dict[str, Any]], bool] = lambda config: True,
) -> M:
    """A head from a directory in either layout: `ours(root, config)` where specdecode's weights
    file is there, else `reference(file, config)` on the reference's (when `reference_ok` accepts
    its config); in `dtype` on `device`, in eval mode."""
    root, config = open_directory(path, layouts.what)
    if (root / layouts.weights).is_file():
        check_method(root, config, layouts.method, layouts.a_what)
        module = ours(root, config)
    else:
        found = reference_file(root, layouts.reference_weights)
        if found is None or not reference_ok(config):
            raise SpecDecodeError(
                f"no {layouts.what} in {root}: expected {layouts.weights} + {CONFIG} (specdecode) or "
                f"{' / '.join(layouts.reference_weights)}{layouts.reference_note}"
            )
        module = reference(found, config)
    return module.to(device=device, dtype=dtype).eval()


def shipped(model_name: str, method: str, weights: str, what: str, plural: bool = False) -> Path:
    """The directory shipped for `model_name` and `method` (`heads/<model>/<method>/`), or an error
    that lists the models that have one and says how to train one."""
    path = SHIPPED / model_name / method
    if (path / weights).is_file():
        return path
    have = sorted(p.parent.name for p in SHIPPED.glob(f"*/{method}") if (p / weights).is_file())
    ship, some, arg = ("ship", "some", "heads") if plural else ("ships", "one", "head")
    raise SpecDecodeError(
        f"no {what} {ship} for model {model_name!r} (shipped for: {', '.join(have) or 'none'}); "
        f"train {some} with `specdecode train {method} --model {model_name} --data FILE --out DIR` "
        f"and pass {arg}=DIR"
    )


def check_fits(
    hidden_size: int, vocab_size: int, target: Transformer, source: str, plural: bool = False
) -> None:
    """A head reads the target's hidden states and drafts its token ids: both sizes must match."""
    cfg = target.config
    if hidden_size != cfg.hidden_size or vocab_size != cfg.vocab_size:
        was = "were" if plural else "was"
        raise SpecDecodeError(
            f"{source} {was} trained for another target: hidden size {hidden_size}, vocabulary "
            f"{vocab_size}; this target has hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}"
        )


def draft_vocab(tensors: dict[str, Tensor], vocab_size: int, file: Path) -> Tensor | None:
    """The draft vocabulary (V',) long, sorted, taken out of a checkpoint's `tensors` (None where it
    has none), or an error naming `file` when it is not a list of 1 .. V distinct ids below V."""
    vocab = tensors.pop(DRAFT_VOCAB, None)
    if vocab is None:
        return None
    if vocab.dim() != 1 or not 0 < vocab.numel() <= vocab_size:
        raise SpecDecodeError(f"{file}: {DRAFT_VOCAB} must list 1 to {vocab_size} ids")
    vocab = vocab.long()
    if bool(((vocab < 0) | (vocab >= vocab_size)).any()):
        raise SpecDecodeError(f"{file}: {DRAFT_VOCAB} holds ids outside the vocabulary of {vocab_size}")
    return torch.unique(vocab)


class DraftColumns:
    """The target's LM head over a head's draft vocabulary (all of it where None), as the target's
    kernels read it for drafts (`Transformer.approx_head`: approximate products where they offer
    them, a draft needs plausible, not exact, logits), made when first asked for and remade when
    the head or the vocabulary changes."""

    def __init__(self) -> None:
        self._made: tuple[tuple[Any, ...], DraftHead] | None = None

    def __call__(self, target: Transformer, vocab: Tensor | None) -> DraftHead:
        ids = None if vocab is None else (vocab.data_ptr(), vocab._version, vocab.numel())
        key = (target.head.key(), ids)
        if self._made is None or self._made[0] != key:
            self._made = key, target.approx_head(vocab)
        return self._made[1]
