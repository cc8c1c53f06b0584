"""The tokenizer of a canonical model directory: `tokenizer.json` plus the settings around it.

transformers is not a runtime dependency, so this reads the same files it does (`tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`, `chat_template.jinja`) and renders chat templates
the same way (a sandboxed Jinja environment with the helpers the templates expect).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"{path} is not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json, written either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation (e.g. roles out of order)."""
    raise SpecDecodeError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """JSON as templates expect it: not HTML-escaped, unlike Jinja's built-in `tojson`."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(
        self,
        backend: Any,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = backend  # tokenizers.Tokenizer
        self.config = dict(config or {})
        self._generation = dict(generation_config or {})
        self._model = dict(model_config or {})
        self._chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a model directory (a converted GGUF or a genuine Hugging Face one)."""
        from tokenizers import Tokenizer as Backend

        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise SpecDecodeError(f"{root} has no tokenizer.json (specdecode needs a fast tokenizer file)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:
            raise SpecDecodeError(f"{file} is not a valid tokenizer file ({exc})") from None
        config = _read_json(root / "tokenizer_config.json")
        template: Any = config.get("chat_template")
        jinja = root / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        elif template is None:
            template = _read_json(root / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # older files: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(
            backend,
            config,
            _read_json(root / "generation_config.json"),
            _read_json(root / "config.json"),
            template if isinstance(template, str) else None,
        )

    # -- special tokens -------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id for the whole vocabulary, added (special) tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def _special_id(self, name: str) -> int | None:
        text = _token_text(self.config.get(name))
        return None if text is None else self._tok.token_to_id(text)

    @property
    def bos_token(self) -> str | None:
        return _token_text(self.config.get("bos_token"))

    @property
    def eos_token(self) -> str | None:
        return _token_text(self.config.get("eos_token"))

    @property
    def bos_token_id(self) -> int | None:
        found = self._special_id("bos_token")
        if found is not None:
            return found
        ids = _ids(self._generation.get("bos_token_id")) or _ids(self._model.get("bos_token_id"))
        return ids[0] if ids else None

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: from the generation config, the model config and the tokenizer."""
        ids: list[int] = []
        own = self._special_id("eos_token")
        for value in (
            self._generation.get("eos_token_id"),
            self._model.get("eos_token_id"),
            own,
        ):
            ids += [i for i in _ids(value) if i not in ids]
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos_token(self) -> bool:
        return bool(self.config.get("add_bos_token", False))

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) map to their ids."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Format a conversation with the model's chat template (and tokenize it if asked)."""
        if not self._chat_template:
            raise SpecDecodeError("this model has no chat template; pass a plain prompt instead")
        text = self._render(messages, add_generation_prompt, extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self) -> Any:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self._chat_template or "")
        except TemplateError as exc:
            raise SpecDecodeError(f"the model's chat template is invalid: {exc}") from None

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]
    ) -> str:
        from jinja2 import TemplateError

        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise SpecDecodeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **{
                k: text
                for k, v in self.config.items()
                if k.endswith("_token") and (text := _token_text(v)) is not None
            },
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except SpecDecodeError:
            raise
        except TemplateError as exc:
            raise SpecDecodeError(f"the model's chat template failed: {exc}") from None
