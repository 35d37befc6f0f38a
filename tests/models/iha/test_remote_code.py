"""save_pretrained / from_pretrained, Auto classes, remote code in a process that never imports iha, `iha push`."""

import ast
import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from testing_utils import left_padded_batch, run_without_the_project, tiny_iha_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import iha
from iha.cli.main import main as iha_main
from iha.cli.main import run
from iha.conversion.writers import AUTO_MAPS, CODE_FILES, GEMMA3_CODE_FILES, MODEL_FOLDER, TRAVELLING_FILES
from iha.hub.model_card import how_to_load_section, update_model_card
from iha.hub.push import upload_operations


def test_auto_classes_resolve_to_iha():
    from testing_utils import TINY

    config = AutoConfig.for_model("iha", **TINY)
    assert type(config) is iha.IHAConfig
    assert type(AutoModelForCausalLM.from_config(config)) is iha.IHAForCausalLM
    assert type(AutoModel.from_config(config)) is iha.IHAModel


def test_save_load_round_trip_keeps_logits(tmp_path):
    model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3, iha_collapse_mode="global")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"]["AutoConfig"] == "configuration_iha.IHAConfig"
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_iha.IHAForCausalLM"
    assert (tmp_path / "configuration_iha.py").is_file() and (tmp_path / "modeling_iha.py").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is iha.IHAForCausalLM
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        logits = loaded(input_ids, attention_mask=attention_mask).logits
    assert torch.equal(logits, expected)


def test_remote_code_loads_in_a_process_without_iha(tmp_path):
    model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=2, iha_mask_mode="token_causal")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "logits": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["iha"] = None  # a process that never imports the package: any attempt would fail loudly
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            logits = model(io["input_ids"], attention_mask=io["attention_mask"]).logits
        print("max_abs_diff", (logits - io["logits"]).abs().max().item())
        generated = model.generate(io["input_ids"], attention_mask=io["attention_mask"], max_new_tokens=3,
                                   do_sample=False, pad_token_id=0)
        print("generated", generated.shape[1])
        """
    )
    # A clean environment: no editable install path, no tests dir, a cwd without the package.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_abs_diff 0.0" in result.stdout
    assert f"generated {input_ids.shape[1] + 3}" in result.stdout


# What the files that travel with the weights may import: the standard library, torch, transformers, and each other;
# and two packages every transformers release in the range requires: huggingface_hub, whose strict dataclasses its
# configurations (and so IHA's) are declared with, and packaging, which parses the release's version.
ALLOWED_PACKAGES = {"torch", "transformers", "huggingface_hub", "packaging"}


def imports_outside_the_folder(path) -> list[str]:
    """Every import of the module at `path` (top level or inside a function) that is neither the standard library, an
    allowed package, nor a single-dot import of another travelling file."""
    travelling_modules = {name.removesuffix(".py") for name in TRAVELLING_FILES}
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            if node.level != 1 or node.module not in travelling_modules:
                found.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
            continue
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in ALLOWED_PACKAGES and top not in sys.stdlib_module_names:
                found.append(f"{path.name}:{node.lineno}: import {name}")
    return found


def test_travelling_files_import_only_torch_transformers_and_each_other():
    assert set(CODE_FILES) < set(TRAVELLING_FILES) and "naive_iha.py" not in TRAVELLING_FILES
    found = [line for name in TRAVELLING_FILES for line in imports_outside_the_folder(MODEL_FOLDER / name)]
    assert not found, found


# What every folder written so far carries: a folder converted before the files moved into iha/models/iha/ names
# these files in its `auto_map` and holds exactly these, so the names are a contract, not a detail.
FOLDER_CODE_FILES = {
    "iha": [
        "configuration_iha.py",
        "layer_iha.py",
        "masking_iha.py",
        "mixing_iha.py",
        "modeling_iha.py",
        "version_iha.py",
    ],
    "iha_gemma3": ["configuration_iha_gemma3.py", "modeling_iha_gemma3.py"],
}
# The most lines of code a folder may carry (every code file a Gemma 3 folder writes, the most of any): what a user
# auditing remote code reads, against ~600 for transformers' own Llama model and configuration.
FOLDER_LINE_BUDGET = 1500


def test_a_folder_carries_at_most_the_line_budget():
    lines = sum(len((MODEL_FOLDER / name).read_text(encoding="utf-8").splitlines()) for name in TRAVELLING_FILES)
    assert lines <= FOLDER_LINE_BUDGET, f"the folder's code files hold {lines} lines"


def test_the_configuration_files_import_no_torch():
    # Like transformers' own configurations: a config or tokenizer loads where torch is absent (mlx-lm on a Mac).
    # The modules they import, transitively, are the folder's own; none may import torch.
    from transformers.dynamic_module_utils import get_relative_imports

    for name in ("configuration_iha", "configuration_iha_gemma3"):
        modules, frontier = set(), {name}
        while frontier:
            modules |= frontier
            frontier = {
                sibling for module in frontier for sibling in get_relative_imports(MODEL_FOLDER / f"{module}.py")
            }
            frontier -= modules
        torch_imports = [line for module in sorted(modules) for line in torch_imports_of(MODEL_FOLDER / f"{module}.py")]
        assert not torch_imports, (name, torch_imports)


def torch_imports_of(path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        found += [f"{path.name}:{node.lineno}: {name}" for name in names if name.split(".")[0] == "torch"]
    return found


def test_the_travelling_files_and_auto_map_keep_the_names_folders_already_carry():
    assert sorted(CODE_FILES) == FOLDER_CODE_FILES["iha"]
    assert sorted(GEMMA3_CODE_FILES) == FOLDER_CODE_FILES["iha_gemma3"]
    for model_type, auto_map in AUTO_MAPS.items():
        for class_path in auto_map.values():
            module, _, name = class_path.partition(".")
            assert f"{module}.py" in FOLDER_CODE_FILES[model_type], class_path
            assert hasattr(getattr(iha, name, None) or getattr(iha.models.iha, name), "from_pretrained"), class_path


def test_the_import_rule_catches_what_would_break_a_folder_without_the_package(tmp_path):
    module = tmp_path / "modeling_iha.py"
    module.write_text(
        "import math\nimport torch\nfrom .version_iha import x\nfrom iha.utils import y\nimport safetensors\n"
        "from ..models import z\nfrom .naive_iha import reference_forward\n"
        "def f():\n    import numpy\n"
    )
    assert imports_outside_the_folder(module) == [
        "modeling_iha.py:4: import iha.utils",
        "modeling_iha.py:5: import safetensors",
        "modeling_iha.py:6: from ..models import ...",
        "modeling_iha.py:7: from .naive_iha import ...",
        "modeling_iha.py:9: import numpy",
    ]


def card_folder(tmp_path):
    """A saved tiny IHA model with a card that loads it from its own folder, as every writer of the package leaves."""
    folder = tmp_path / "tiny-iha"
    tiny_iha_model().save_pretrained(folder)
    update_model_card(folder, title="tiny", sections={"How to load": how_to_load_section(str(folder))})
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("")
    return folder


def test_push_uploads_a_card_for_the_repo_and_leaves_the_folder_alone(tmp_path):
    folder = card_folder(tmp_path)
    (folder / "checkpoint-2").mkdir()  # training state stays home: it holds pickles and is not the model
    (folder / "checkpoint-2" / "optimizer.pt").write_bytes(b"")
    (folder / "training_args.bin").write_bytes(b"")
    card_before = (folder / "README.md").read_bytes()
    operations = {operation.path_in_repo: operation for operation in upload_operations(folder, "someone/tiny-iha")}
    assert set(operations) == {"README.md", "config.json", "generation_config.json", "model.safetensors", *CODE_FILES}
    uploaded_card = operations["README.md"].path_or_fileobj.decode()
    assert 'from_pretrained("someone/tiny-iha")' in uploaded_card and str(folder) not in uploaded_card
    assert (folder / "README.md").read_bytes() == card_before


def test_iha_push_offline_names_itself_and_changes_nothing(tmp_path, capsys):
    folder = card_folder(tmp_path)
    card_before = (folder / "README.md").read_bytes()
    capsys.readouterr()
    assert iha_main(["push", str(folder), "someone/tiny-iha"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("iha push: error: Uploading")
    assert f"retry with `iha push {folder} someone/tiny-iha`" in err and "iha-convert" not in err
    assert (folder / "README.md").read_bytes() == card_before


@pytest.mark.parametrize(
    "main, argv, usage",
    [
        (iha_main, ["push"], "usage: iha push"),
        (iha_main, ["convert", "push"], "usage: iha convert push"),
        (functools.partial(run, "convert"), ["push"], "usage: iha-convert push"),  # the iha-convert console script
    ],
)
def test_push_help_names_the_command_that_was_run(main, argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_push_refuses_a_folder_that_is_not_iha(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert iha_main(["push", str(tmp_path), "someone/x"]) == 2
    assert "not an IHA checkpoint folder" in capsys.readouterr().err


# --- a folder without the package: correct, only slower ------------------------------------------------------------

# Layouts whose fast paths (with the package) differ from transformers' own functions (without it): blocked sliding
# windows and attention per packed document on SDPA, the dense-mask SDPA on CPU, the widened sliding caches.
WITHOUT_PACKAGE_LAYOUTS = {
    "global": dict(num_key_value_heads=2, num_pseudo_heads=2),
    "paper hybrid": dict(
        num_hidden_layers=5,
        num_key_value_heads=2,
        **iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=24),
    ),
}
PACKED_LENGTHS = [70, 6, 40]


def package_outputs(model, io_path):
    """Logits of a long left-padded batch (the blocked path's length) and of a packed row, and greedy tokens past the
    window, as computed here with the package's fast paths; saved for a process without the package."""
    input_ids, attention_mask = left_padded_batch(seq_len=72)
    packed = torch.randint(
        3, model.config.vocab_size, (1, sum(PACKED_LENGTHS)), generator=torch.Generator().manual_seed(3)
    )
    packed_positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
        packed_logits = model(packed, position_ids=packed_positions, use_cache=False).logits
        generated = model.generate(
            input_ids[:, -9:], attention_mask=attention_mask[:, -9:], max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    outputs = dict(input_ids=input_ids, attention_mask=attention_mask, logits=logits, packed=packed)
    outputs.update(packed_positions=packed_positions, packed_logits=packed_logits, generated=generated)
    torch.save(outputs, io_path)
    return outputs


@pytest.mark.parametrize("layout", list(WITHOUT_PACKAGE_LAYOUTS))
def test_a_folder_without_the_package_gives_the_packages_logits_and_tokens(layout, tmp_path, monkeypatch):
    from iha.attention import sdpa

    model = tiny_iha_model(**WITHOUT_PACKAGE_LAYOUTS[layout])
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    plans = []  # the package's fast paths really run here
    for name in ("blocked_local_attention", "per_document_attention"):
        kernel = getattr(sdpa, name)
        monkeypatch.setattr(
            sdpa, name, lambda *a, _kernel=kernel, _name=name, **k: plans.append(_name) or _kernel(*a, **k)
        )
    package_outputs(model, tmp_path / "io.pt")
    # Every layer of the global layout is a full IHA layer (packed rows: per document); the paper's hybrid has sliding
    # IHA layers (blocked) and standard global ones.
    assert set(plans) == {"per_document_attention" if layout == "global" else "blocked_local_attention"}
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["iha"] = None  # a process that never imports the package
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert not any(name.startswith("iha|") for name in ALL_ATTENTION_FUNCTIONS)
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            logits = model(io["input_ids"], attention_mask=io["attention_mask"]).logits
            packed = model(io["packed"], position_ids=io["packed_positions"], use_cache=False).logits
            generated = model.generate(io["input_ids"][:, -9:], attention_mask=io["attention_mask"][:, -9:],
                                       max_new_tokens=8, do_sample=False, pad_token_id=0)
        real = io["attention_mask"].bool()
        print("logits", (logits - io["logits"])[real].abs().max().item())
        print("packed", (packed - io["packed_logits"]).abs().max().item())
        print("tokens", torch.equal(generated, io["generated"]))
        """
    )
    result = run_without_the_project(script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert float(lines["logits"]) < 1e-5 and float(lines["packed"]) < 1e-5, lines
    assert lines["tokens"] == "True"


def test_continuous_batching_without_the_package_is_refused_with_the_fix(monkeypatch):
    from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig

    model = tiny_iha_model(num_pseudo_heads=2)
    monkeypatch.delitem(AttentionInterface._global_mapping, "iha|paged")
    generation_config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    small = ContinuousBatchingConfig(num_blocks=4, page_size=16, max_batch_tokens=16)
    with pytest.raises(ValueError, match=r"installed iha package provides: pip install iha, and import iha"):
        model.generate_batch([[3, 4, 5]], generation_config=generation_config, continuous_batching_config=small)
