"""The settings of a conversion, typed: one name and one type per setting.

- `IHAConversionOptions`: what the converted model computes (pseudo-heads, which layers, mask, positions, collapse).
  `llama_to_iha`, `plan_conversion`, `convert_checkpoint` and `iha-sft --iha_options` take it.
- `CheckpointOptions`: how `convert_checkpoint` reads the source and writes and checks the IHA folder.

The `iha-convert` flags are generated from these fields (`--num_pseudo_heads` from `num_pseudo_heads`, ...), so a
setting added here is a flag there too. The field metadata holds what the command line shows (`help`, `choices`,
`aliases`, `group`) and, for the settings that become an `IHAConfig` field of another name, that name
(`config_field`: `mask_mode` is the config's `iha_mask_mode`).

```python
>>> from iha.conversion import IHAConversionOptions, llama_to_iha
>>> iha_model = llama_to_iha(model, IHAConversionOptions(num_pseudo_heads=4, layers="hybrid"))
>>> iha_model = llama_to_iha(model, num_pseudo_heads=4, layers="hybrid")  # the same, by keyword
```
"""

import dataclasses
import json
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# The `IHAConfig` fields these settings fill, with their choices and defaults, are the config's own: one set, in the
# file that owns what an IHA layer is and travels with the weights.
from ..models.iha.layer_iha import FIELD_CHOICES, FIELD_DEFAULTS
from .errors import ConversionError


# Output dtypes `--dtype` accepts besides "auto" (each is the name of a torch dtype).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# The bar for "exact" in fp32; see `verify_conversion` for how deep models are judged.
EXACT_ATOL = 1e-5
# An exact conversion may differ from the source by fp32 rounding only: allow this multiple of the source model's
# own rounding noise (its logits under sdpa vs eager attention), which grows with depth.
NOISE_MULTIPLE = 4.0


def config_choice(config_field: str, help_text: str, default: str | None = None):
    """A setting that fills the `IHAConfig` field `config_field`, with that field's choices and (unless a conversion
    needs another, given here) its default."""
    default = FIELD_DEFAULTS[config_field] if default is None else default
    metadata = {"choices": FIELD_CHOICES[config_field], "config_field": config_field, "help": help_text}
    return field(default=default, metadata=metadata)


@dataclass
class IHAConversionOptions:
    """What the converted model computes. The defaults give an exact conversion: every layer becomes an IHA layer
    with the source's own window, positions are shared by the pseudo-tokens of a token (the one default that differs
    from the config's, the paper's virtual positions), the mask is the paper's flat causal mask and the collapse starts
    on the last pseudo-head. Sliding IHA layers see the paper's flat window of W * P virtual tokens, whose last
    pseudo-head sees exactly the source's window of W tokens."""

    num_pseudo_heads: int = field(
        default=FIELD_DEFAULTS["num_pseudo_heads"], metadata={"help": "pseudo-heads per head", "aliases": ["-P"]}
    )
    layers: str | list[int] = field(
        default="all",
        metadata={
            "help": "which layers become IHA: 'all' (default, exact), 'hybrid' (the paper's 4 sliding IHA : 1 global "
            "standard layout, changes the function), or indices like '0,1,5' (others stay standard attention)"
        },
    )
    training_length: int | None = field(
        default=None,
        metadata={
            "help": "with --layers hybrid: the sequence length you will train at; the window is N/(2 P^2) tokens "
            "(default: max_position_embeddings)"
        },
    )
    mask_mode: str = config_choice(
        "iha_mask_mode", "flat_causal (the paper's) or token_causal (a pseudo-token sees all of its own token)"
    )
    position_mode: str = config_choice("iha_position_mode", "virtual is the paper's, not exact", default="shared")
    collapse_mode: str = config_choice("iha_collapse_mode", "collapse R: [H, P] or [H, H, P]")
    collapse_init: str = config_choice(
        "iha_collapse_init", "initial collapse; with flat_causal only 'last' is exact, with token_causal all are"
    )

    def __post_init__(self):
        if not is_integer(self.num_pseudo_heads) or self.num_pseudo_heads < 1:
            raise ValueError(f"`num_pseudo_heads` must be an integer >= 1, got {self.num_pseudo_heads!r}.")
        if not isinstance(self.layers, str):
            try:
                self.layers = [operator.index(index) for index in self.layers]
            except TypeError:
                raise ValueError(
                    "`layers` must be 'all', 'hybrid', or layer indices ('0,1,5' or a list of integers), "
                    f"got {self.layers!r}."
                ) from None
        if self.training_length is not None and (not is_integer(self.training_length) or self.training_length < 1):
            raise ValueError(f"`training_length` must be a positive integer or None, got {self.training_length!r}.")
        check_choices(self)

    def config_fields(self) -> dict:
        """The `IHAConfig` fields these settings fill directly, under the config's names."""
        values = {"num_pseudo_heads": self.num_pseudo_heads}
        for setting in dataclasses.fields(self):
            if "config_field" in setting.metadata:
                values[setting.metadata["config_field"]] = getattr(self, setting.name)
        return values

    @classmethod
    def from_json(cls, text: str) -> "IHAConversionOptions":
        """The settings from a JSON object such as '{"num_pseudo_heads": 4, "layers": "hybrid"}'."""
        try:
            values = json.loads(text)
        except ValueError as error:
            raise ValueError(f"The IHA settings {text!r} are not valid JSON ({error}).") from None
        if not isinstance(values, dict):
            raise ValueError(
                f"The IHA settings must be a JSON object like '{{\"num_pseudo_heads\": 2}}', got {text!r}."
            )
        return settings_from(cls, values, {})[0]


def grouped_setting(group: str, default, help_text: str, **metadata):
    """A setting the command line shows in its argument group `group`."""
    return field(default=default, metadata={"group": group, "help": help_text, **metadata})


@dataclass
class CheckpointOptions:
    """How `convert_checkpoint` reads the source checkpoint, and writes and checks the IHA folder."""

    dtype: str = grouped_setting("output", "auto", "default: keep the source's", choices=("auto", *DTYPE_NAMES))
    max_shard_size: int | str = grouped_setting("output", "5GB", "largest weight file, e.g. 5GB, 500MB")
    overwrite: bool = grouped_setting("output", False, "replace a non-empty output folder")
    base_model: str | None = grouped_setting("output", None, "Hub id to name as base model in the model card")
    allow_pickle: bool = grouped_setting(
        "source",
        False,
        "accept pickle (.bin) weights, read with torch.load(weights_only=True); refused by default",
    )
    revision: str | None = grouped_setting("source", None, "Hub revision (branch, tag or commit) of SOURCE")
    token: str | None = grouped_setting("source", None, "Hub token (default: the logged-in one)")
    cache_dir: str | None = grouped_setting(
        "source", None, "Hugging Face cache folder for Hub downloads (default: HF_HUB_CACHE)"
    )
    verify: bool = grouped_setting(
        "verification",
        True,
        "run the source and the converted model on a fixed batch and compare their logits (on by default)",
        no_help="skip that check: write the converted folder unverified",
    )
    tolerance: float | None = grouped_setting(
        "verification",
        None,
        f"max logit difference for exact settings (default: max({EXACT_ATOL:g}, {NOISE_MULTIPLE:g} x the source's "
        "own sdpa-vs-eager difference))",
    )

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConversionError(f"--dtype must be 'auto' or one of {list(DTYPE_NAMES)}, got {self.dtype!r}.")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ConversionError(f"--tolerance must be a positive number of logits, got {self.tolerance!r}.")
        parse_size(self.max_shard_size)

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_choices(options) -> None:
    for setting in dataclasses.fields(options):
        allowed = setting.metadata.get("choices")
        value = getattr(options, setting.name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"`{setting.name}` must be one of {list(allowed)}, got {value!r}.")


def parse_size(size: int | str) -> int:
    """5000000000, "5GB", "500MB", "2GiB" -> bytes (decimal units for KB/MB/GB as transformers reads them)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if not match:
        raise ConversionError(f"--max_shard_size must look like 5GB, 500MB or a number of bytes, got {size!r}.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    if number <= 0:
        raise ConversionError(f"--max_shard_size must be positive, got {size!r}.")
    factors = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    factors.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    return int(number * factors[unit])


def settings_from(options_class, given, keywords: dict) -> tuple:
    """(`given` as an `options_class`, the keywords that are none of its settings).

    `given` is an `options_class`, a mapping of its settings (e.g. parsed JSON), or None (the defaults); the
    keywords that name one of its settings are applied on top. A mapping with an unknown key is refused with the
    list of the settings there are.
    """
    names = [setting.name for setting in dataclasses.fields(options_class)]
    own = {name: value for name, value in keywords.items() if name in names}
    rest = {name: value for name, value in keywords.items() if name not in names}
    if given is None:
        return options_class(**own), rest
    if isinstance(given, options_class):
        return dataclasses.replace(given, **own), rest
    if isinstance(given, Mapping):
        unknown = sorted(str(key) for key in given if key not in names)
        if unknown:
            raise ValueError(
                f"Unknown {options_class.__name__} setting(s) {unknown}: the settings are {', '.join(names)}."
            )
        return options_class(**{**given, **own}), rest
    raise TypeError(f"Expected {options_class.__name__}, a dict of its settings or None, got {type(given).__name__}.")


def refuse_unknown_keywords(function_name: str, rest: dict, *options_classes) -> None:
    if rest:
        names = [setting.name for cls in options_classes for setting in dataclasses.fields(cls)]
        raise TypeError(
            f"{function_name}() got unknown setting(s) {sorted(rest)}: the settings are {', '.join(names)}."
        )


__all__ = ["CheckpointOptions", "IHAConversionOptions", "parse_size"]
