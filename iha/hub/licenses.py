"""The licenses of a model folder the package writes (converted, fine-tuned, merged, carded).

Two things hold a license there. The IHA code files next to the weights (`configuration_iha.py`, `modeling_iha.py`,
...) are this package's, under its Apache-2.0 LICENSE, which every such folder carries. The weights come from the
base model and keep its license: that is the card's `license:` (what the Hub shows), e.g. `gemma` for a Gemma base,
and any LICENSE file the base brought stays as it is (then the package's goes in beside it as `LICENSE-iha`).
Where the base states no license, the card says so and names the package's.
"""

import importlib.metadata
from pathlib import Path

from ..utils.atomic_files import write_text_atomic


DISTRIBUTION = "iha-transformers"
# The Hub's identifier of the package's own license (setup.py: license_expression="Apache-2.0").
PACKAGE_LICENSE = "apache-2.0"
LICENSE_NAME = "LICENSE"
# The package's LICENSE in a folder whose LICENSE is the base model's.
CODE_LICENSE_NAME = "LICENSE-iha"


def package_license_text() -> str:
    """The text of the package's LICENSE: from the installed metadata (PEP 639 puts it in `.dist-info/licenses/`),
    else from the source checkout this module lives in."""
    try:
        text = importlib.metadata.distribution(DISTRIBUTION).read_text(f"licenses/{LICENSE_NAME}")
    except importlib.metadata.PackageNotFoundError:
        text = None
    if text:
        return text
    checkout_license = Path(__file__).resolve().parents[2] / LICENSE_NAME  # iha/hub/licenses.py -> the checkout
    if checkout_license.is_file():
        return checkout_license.read_text(encoding="utf-8")
    raise FileNotFoundError(
        f"The package's {LICENSE_NAME} is neither in the installed metadata nor next to the package: reinstall it "
        "(`pip install .` in its source folder)."
    )


def write_code_license(folder: str | Path) -> str:
    """Put the package's LICENSE (the IHA code files') into `folder`; returns the name it has there."""
    folder, text = Path(folder), package_license_text()
    existing = folder / LICENSE_NAME
    if existing.is_file() and existing.read_text(encoding="utf-8", errors="replace") != text:
        name = CODE_LICENSE_NAME  # the base model's LICENSE stays where the Hub and users look for it
    else:
        name = LICENSE_NAME
    write_text_atomic(text, folder / name)
    return name


def license_card_parts(folder: str | Path, base_license: str | None, base: str) -> tuple[str, str]:
    """Write the package's LICENSE into `folder`; return the card's `license:` and its "License" section.

    `base_license` is the base model's license as its card names it (None where it states none); `base` names the
    base model in the text."""
    code_license = write_code_license(folder)
    code = f"The IHA code files next to the weights are Apache-2.0 (`{code_license}`)."
    if base_license is None:
        return PACKAGE_LICENSE, (
            f"{code} The weights come from `{base}`, whose files state no license: they keep the license of that "
            "model, which you should check before you publish or use them."
        )
    if base_license.lower() == PACKAGE_LICENSE:
        return (
            PACKAGE_LICENSE,
            f"Apache-2.0 (`{code_license}`): the weights, as those of `{base}`, and the IHA code files.",
        )
    return base_license, (
        f"The weights are derived from `{base}` and keep its license, `{base_license}` (the metadata above"
        + (f"; `{LICENSE_NAME}`" if code_license == CODE_LICENSE_NAME else "")
        + f"). {code}"
    )


__all__ = ["license_card_parts", "package_license_text", "write_code_license"]
