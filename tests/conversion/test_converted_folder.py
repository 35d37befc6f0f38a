"""What a converted folder carries beside its weights: a tokenizer that loads like the source's (also in a process
without the package). Its licenses and model card: tests/hub/test_model_card.py."""

import json
import os
import subprocess
import sys

import pytest
from testing_utils import make_source

from iha import conversion as convert


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer of a converted folder
# ---------------------------------------------------------------------------------------------------------------

TOKENIZER_PROBE = """
import sys
sys.modules["iha"] = None  # a process that never imports the package
from transformers import AutoTokenizer
trust = {trust}
for folder in sys.argv[1:]:
    tokenizer = AutoTokenizer.from_pretrained(folder, **({{"trust_remote_code": True}} if trust else {{}}))
    print("RESULT", type(tokenizer).__name__, tokenizer.encode("Weng earns 12/60 = $0.2 per minute."), flush=True)
"""


def load_tokenizers_elsewhere(folders, tmp_path, trust_remote_code: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    return subprocess.run(
        [sys.executable, "-I", "-c", TOKENIZER_PROBE.format(trust=trust_remote_code), *map(str, folders)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,  # a prompt would read EOF at once instead of waiting
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["llama3", "qwen2_sliding", "mistral_full"])
def test_converted_tokenizer_loads_like_the_source(kind, tmp_path):
    """Same class, same ids as the source's tokenizer, also where the source's tokenizer_config names no class
    (AutoTokenizer then goes by the model type, which differs: `iha` against `llama` / `qwen2`)."""
    from testing_utils import build_tiny_tokenizer

    source = make_source(kind, tmp_path / "source")
    build_tiny_tokenizer(source)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    del tokenizer_config["tokenizer_class"]
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    convert.convert_checkpoint(source, tmp_path / "iha", verify=False, show_progress=False)

    with_remote_code = load_tokenizers_elsewhere([source, tmp_path / "iha"], tmp_path, trust_remote_code=True)
    assert with_remote_code.returncode == 0, with_remote_code.stderr[-3000:]
    source_line, converted_line = [line for line in with_remote_code.stdout.splitlines() if line.startswith("RESULT")]
    assert converted_line == source_line
    assert "Do you wish to run the custom code" not in with_remote_code.stdout + with_remote_code.stderr
    assert "model of type" not in with_remote_code.stderr

    # Without trust_remote_code, transformers reads config.json (whose auto_map names the IHA code) before the
    # tokenizer and asks about remote code; with no one to answer, it must still give the source's tokenizer.
    without = load_tokenizers_elsewhere([tmp_path / "iha"], tmp_path, trust_remote_code=False)
    assert without.returncode == 0, without.stderr[-3000:]
    assert [line for line in without.stdout.splitlines() if "RESULT" in line][0].endswith(source_line)
