"""The command line as a person meets it: it answers before torch is imported, its help is the
live config's (every key described, grouped methods), built-in recipes run from any directory."""
import json
import subprocess
import sys
import time

import pytest

from comix.cli import main
from comix.cli_help import HELP_FILE, HIDDEN, PAPERS, build, render


def test_the_help_file_is_the_live_config_s():
    """cli_help.json is what `comix run --help` shows without torch; a key or method added to the
    code and not to it fails here (write it again: python -m comix.cli_help)."""
    assert json.loads(HELP_FILE.read_text()) == json.loads(json.dumps(build()))


def test_every_key_has_a_description_every_method_one_paper_and_internal_keys_stay_hidden():
    from comix.algorithms import METHODS
    content = build()
    assert all(note for _, _, note in content["keys"]), [k for k, _, n in content["keys"] if not n]
    grouped = [m for names in PAPERS.values() for m in names]
    assert sorted(grouped) == sorted(METHODS) and len(grouped) == len(set(grouped))
    text = render(content)
    assert not any(f"  {k}=" in text for k in HIDDEN)
    assert "smollm2-135m (the default, offline), gemma3-270m (offline)" in text
    assert text.count("\n  comix run") >= 2  # examples


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["run", "nokey=1"],
                                  ["compare", "--methods", "local", "train.rond=2"], ["recipes"]])
def test_the_command_line_answers_before_torch_is_imported(argv):
    code = ("import sys\nfrom comix.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)" % argv)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "TORCH False" in out.stdout, out.stdout[-500:] + out.stderr[-500:]
    assert time.time() - t0 < 30  # generous: a loaded CI machine; the bench of record is ~0.1 s


def test_a_mistyped_key_is_refused_in_one_line_with_the_key_it_resembles(capsys):
    assert main(["run", "train.rond=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["comix: error: unknown config key 'train.rond' (did you mean train.rounds?)"]
    assert main(["run", "fedamole.pool=12", "model=tiny-llama", "methods=[nonexistent]"]) == 2  # a section key passes
    assert "unknown config key" not in capsys.readouterr().err


def test_built_in_recipes_run_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    from comix.config import RECIPES, ConfigError, load_config
    monkeypatch.chdir(tmp_path)
    for name in ("small/table1-multilingual", "small/table1-multilingual.yaml", "configs/small/table1-multilingual.yaml"):
        assert load_config(name).methods == load_config(str(RECIPES / "small" / "table1-multilingual.yaml")).methods
    with pytest.raises(ConfigError, match="comix recipes lists them"):
        load_config("small/no-such-recipe")
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "small/table1-multilingual " in out and f"{len(list(RECIPES.rglob('*.yaml')))} recipes" in out


def test_a_run_and_an_export_print_no_library_warning_that_says_nothing_to_a_user(tmp_path):
    """bitsandbytes' 'cannot fetch a faster kernel from the hub' at import and the hub's 'cannot
    enable progress bars' on every export are comix's doing (offline; bars switched off)."""
    common = [sys.executable, "-m", "comix.cli"]
    run = subprocess.run([*common, "run", "model=tiny-llama", "methods=[fedavg]", "train.rounds=1", "train.local_steps=1",
                          "train.seq_len=32", "data.valid_tokens=512", "data.test_tokens=256",
                          f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-1000:]
    export = subprocess.run([*common, "export", str(tmp_path / "run"), "--user", "de", "--out", str(tmp_path / "de")],
                            capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-1000:]
    for err in (run.stderr, export.stderr):
        assert "kernels" not in err and "Cannot enable progress bars" not in err and "FutureWarning" not in err, err
