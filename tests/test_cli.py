import json
import random
from pathlib import Path

import pytest

from comix.cli import main
from comix.config import ConfigError, load_config


def _user_dirs(root):
    rng = random.Random(0)
    words = {"alice": "the cat sat on a mat".split(), "bob": "der hund lief im park".split(),
             "carol": "def return import class".split()}
    for user, vocab in words.items():
        (root / user).mkdir(parents=True)
        for i in range(20):
            (root / user / f"{i}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(60)))
    return root


TINY = ["model=tiny-llama", "train.rounds=2", "train.local_steps=2", "train.batch_size=2", "train.seq_len=32",
        "train.tau=2", "train.router_steps=1", "train.eval_every=1", "data.test_tokens=256",
        "data.valid_tokens=512", "train.eval_splits=[valid,test]"]


def test_cli_runs_comigs_end_to_end_on_user_folders(tmp_path, capsys, monkeypatch):
    import logging

    from comix.engines import inprocess
    from comix.progress import step

    def noted_step(*args):  # a method's INFO line, as DeepFusion logs its clusters and premise
        logging.getLogger("comix.test").info("a method's note")
        step(*args)
    monkeypatch.setattr(inprocess, "phase_step", noted_step)
    from comix import runner
    clock = iter(range(0, 10**6, 30))  # 30 s between the phase's calls: a line every other one
    monkeypatch.setattr(runner, "_clock", lambda: next(clock))
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    args = ["run", f"corpus={data}", f"run_dir={run}", "methods=[pretrained,local,comigs-1g1s]", *TINY]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "| comigs-1g1s |" in out and "| pretrained |" in out and "alice" in out
    # piped (no terminal, as under nohup): a finished phase and the methods' INFO lines reach the log
    assert "comigs-1g1s round 2: clients trained 3/3" in " ".join(err.split())
    mid = [line for line in err.splitlines() if "comigs-1g1s round" in line and "clients trained" in line
           and "3/3" not in line]
    assert len(mid) == 2  # a minute apart within a phase (2/3 of each round), not a line a client
    assert "comigs-1g1s a method's note" in " ".join(err.split())
    assert logging.getLogger("comix").level == logging.NOTSET and not logging.getLogger("comix").handlers
    results = json.loads((run / "results.json").read_text())
    assert [r["method"] for r in results] == ["pretrained", "local", "comigs-1g1s"]
    rows = [json.loads(x) for x in (run / "comigs-1g1s" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 and {"train_loss", "valid_ppl", "test_ppl", "gates", "bytes_up", "bytes_down"} <= set(rows[0])
    assert (run / "results.md").read_text().count("|") > 10
    # resuming a finished run recomputes nothing and prints the same table
    assert main(["run", "--resume", str(run)]) == 0
    assert "| comigs-1g1s |" in capsys.readouterr().out


@pytest.mark.parametrize("override,needle", [
    ("train.foo=1", "unknown config key 'train.foo'"),
    ("train.rounds=abc", "config key 'train.rounds' expects int"),
    ("methods=[nope]", "unknown method 'nope'"),
    ("train.load_balance=max", "train.load_balance must be"),
    ("data.mode=sideways", "data.mode must be"),
])
def test_bad_config_values_one_line_errors(override, needle, capsys):
    assert main(["run", override]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_bad_inputs_name_the_culprit(tmp_path, capsys):
    assert main(["run", "model=no-such-model-xyz", "corpus=topics"]) == 2
    assert "unknown model spec 'no-such-model-xyz'" in capsys.readouterr().err
    (tmp_path / "empty" / "dave").mkdir(parents=True)
    assert main(["run", "model=tiny-llama", f"corpus={tmp_path / 'empty'}"]) == 2
    assert "dave holds no text" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    data = _user_dirs(tmp_path / "data")
    assert main(["run", "model=tiny-llama", f"corpus={data}", "train.seq_len=100000"]) == 2
    assert "train.seq_len = 100000 exceeds the context of model tiny-llama" in capsys.readouterr().err


def test_bad_inputs_fail_before_the_model_loads_and_leave_no_run_directory(tmp_path, capsys, monkeypatch):
    import comix.models
    monkeypatch.setattr(comix.models, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    run = tmp_path / "run"
    assert main(["run", "model=/nonexistent/model", "corpus=topics", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model: /nonexistent/model does not exist" in err and len(err.splitlines()) == 1
    (tmp_path / "empty").mkdir()
    assert main(["run", "model=tiny-llama", f"corpus={tmp_path / 'empty'}", f"run_dir={run}"]) == 2
    assert "has no client sub-directories" in capsys.readouterr().err
    assert not run.exists()


def test_version_and_run_help_lists_methods_and_keys(capsys):
    from comix import __version__
    with pytest.raises(SystemExit):
        main(["--version"])
    assert __version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "comigs-1g1s" in out and "fedavg-moe" in out and "train.rounds=3" in out and "dropout=" in out


def test_ctrl_c_names_the_resume_command(tmp_path, capsys, monkeypatch):
    import comix.runner
    data = _user_dirs(tmp_path / "data")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(comix.runner, "run_spec", interrupted)
    assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *TINY]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the rich header, one line, no traceback
    assert last == f"comix: interrupted; continue with: comix run --resume {tmp_path / 'run'}"


def test_base_model_dropout_is_a_config_value_for_every_architecture():
    import torch
    from comix.models import load_base_model
    x = torch.randint(0, 256, (2, 16))
    for spec in ("tiny-gpt2", "tiny-llama"):
        for p, same in ((0.0, True), (0.5, False)):
            model, _ = load_base_model(spec, dropout=p)
            model.train()
            with torch.no_grad():
                assert torch.equal(model(input_ids=x).logits, model(input_ids=x).logits) == same, (spec, p)
    gpt2 = load_base_model("tiny-gpt2")[0]
    assert gpt2.config.resid_pdrop == 0.0 and gpt2.config.attn_pdrop == 0.0  # HF's 0.1 overridden


def test_configs_in_repo_all_load():
    from pathlib import Path
    files = sorted(Path(__file__).parents[1].joinpath("configs").rglob("*.yaml"))
    assert files
    for f in files:
        assert load_config(str(f)).methods, f
    with pytest.raises(ConfigError):
        load_config(None, ["nokey"])


def test_compare_grid_tables_curves_and_skip(tmp_path, capsys):
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "grid"
    args = ["compare", f"corpus={data}", f"run_dir={run}", *TINY, "--methods", "pretrained", "local",
            "hetlora:ranks=[4,8,8],reg=0.05", "--seeds", "1", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = (run / "compare.md").read_text()
    assert "| hetlora:ranks=[4,8,8],reg=0.05 |" in table and "| local |" in table and "alice" in table
    res = json.loads((run / "compare.json").read_text())
    means = [res["local"][s]["mean_test_ppl"] for s in ("1", "2")]
    assert means[0] != means[1]  # seeds differ ...
    import statistics
    assert f"{statistics.fmean(means):.2f} ({statistics.pstdev(means):.2f})" in table  # ... mean (std) over them
    hetlora_dir = run / "seed2" / "hetlora__ranks=_4_8_8_reg=0.05"
    cfg = json.loads((hetlora_dir / "results.json").read_text())
    assert cfg["method"] == "hetlora:ranks=[4,8,8],reg=0.05"
    for png in ("curves.png", "curves_per_user.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"
    assert "| local |" in out
    # a second invocation skips every finished run
    assert main(["compare", "--resume", str(run)]) == 0
    assert capsys.readouterr().err.count("done earlier") == 6
    # a resumed grid is the one it started: --methods or --seeds beside --resume is one line, not ignored
    for extra in (["--methods", "fedavg"], ["--seeds", "3"]):
        assert main(["compare", "--resume", str(run), *extra]) == 2
        assert f"drop {extra[0]}" in capsys.readouterr().err


def test_method_spec_errors_name_the_option(tmp_path, capsys):
    for spec, msg in (("local:reg=1", "local has no options"), ("hetlora:nope=1", "hetlora.nope"),
                      ("hetlora:data.mode=ood", "would change the data"), ("nosuch", "unknown method")):
        assert main(["compare", "model=tiny-llama", f"run_dir={tmp_path / 'x'}", "--methods", spec]) == 2
        assert msg in capsys.readouterr().err


def test_many_clients_read_as_rows_and_the_console_shows_a_summary(tmp_path, capsys):
    """A 1000-column table cannot be read: past MANY_USERS users the
    per-user table lists users as rows, the console shows mean / min / max per method, and no
    per-user figure is drawn; a few users keep CoMiGS's layout (methods as rows)."""
    from comix.api import results_table
    from comix.comparison import MANY_USERS
    names = [f"u{i}" for i in range(MANY_USERS + 4)]
    result = {"method": "local", "metric": "test_ppl", "mean": 2.5,
              "per_user": {u: {"test_ppl": 1.0 + i} for i, u in enumerate(names)}}
    wide = results_table([result], names[:3])
    assert wide.splitlines()[0] == "| method | u0 | u1 | u2 | mean |"
    tall = results_table([result], names).splitlines()
    assert tall[0] == "| user | local |" and tall[2] == "| u0 | 1.00 |" and tall[-1] == "| mean | 2.50 |"
    data = tmp_path / "data"
    for c in ("a", "b"):
        (data / c).mkdir(parents=True)
        for i in range(30):
            (data / c / f"{i}.txt").write_text(f"{c} words {i} " * 25)
    run = tmp_path / "grid"
    many = [f"corpus={data}", *TINY, "train.rounds=1", "train.eval_every=1", "data.clients=12", "data.alpha=0.5",
            "data.valid_tokens=128", "data.test_tokens=128", "train.eval_splits=[test]"]
    assert main(["run", f"run_dir={tmp_path / 'one'}", *many, "methods=[local]"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| method | users | mean | min | max |\n") and "| local | 12 |" in out
    assert "| client11 |" in (tmp_path / "one" / "results.md").read_text()
    assert main(["compare", f"run_dir={run}", *many, "--methods", "local", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| local |" in out and "client11" not in out and "per user:" in out
    md = (run / "compare.md").read_text()
    assert "| client11 |" in md
    assert (run / "curves.png").exists() and not (run / "curves_per_user.png").exists()
    assert not (run / "global-model.png").exists()  # no global model was scored


# -- every failure one line, resume strict ------------------------------------------------
def _fails(capsys, argv, message, code=2):
    from comix.cli import main
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    # one line of error (a run that had started printed its header first), never a traceback
    assert err[-1].startswith("comix: error: ") and message in err[-1], err
    assert not any("Traceback" in ln or ln.startswith("comix: error") for ln in err[:-1]), err
    return err[-1]


def test_bad_values_name_their_key_before_anything_loads(tmp_path, capsys):
    run = tmp_path / "run"
    for override, message in (("threads=-3", "threads must be >= 0 (0 = torch's default), got -3"),
                              ("train.lr=-1", "train.lr must be > 0, got -1"),
                              ("data.alpha=-1", "data.alpha must be > 0, got -1"),
                              ("train.seq_len=300", "train.seq_len = 300 exceeds the context of model tiny-llama (256")):
        _fails(capsys, ["run", "model=tiny-llama", f"run_dir={run}", "methods=[local]", override], message)
        assert not run.exists()
    (tmp_path / "bad.yaml").write_text("model: tiny-llama\ntrain: {rounds: 2\n")
    _fails(capsys, ["run", str(tmp_path / "bad.yaml")], "is not valid YAML at line 3, column 1")
    (tmp_path / "file").write_text("x")
    _fails(capsys, ["run", "model=tiny-llama", f"run_dir={tmp_path / 'file' / 'run'}"], "is a file, not a directory")


def test_a_non_utf8_user_file_is_named(tmp_path, capsys):
    for u in ("a", "b"):
        (tmp_path / "data" / u).mkdir(parents=True)
        (tmp_path / "data" / u / "0.txt").write_text("words " * 50)
    (tmp_path / "data" / "b" / "1.txt").write_bytes(b"ok \xff\xfe bad")
    _fails(capsys, ["run", "model=tiny-llama", f"corpus={tmp_path / 'data'}", f"run_dir={tmp_path / 'run'}"],
           f"{tmp_path / 'data' / 'b' / '1.txt'} is not UTF-8 text (byte 0xff at offset 3)")


def test_resume_refuses_a_changed_config_and_a_corrupt_checkpoint(tmp_path, capsys):
    from comix.cli import main
    run = tmp_path / "run"
    base = ["run", "model=tiny-llama", f"run_dir={run}", "methods=[local]", "train.rounds=2", "train.local_steps=1",
            "train.batch_size=2", "train.seq_len=32", "data.valid_tokens=256", "data.test_tokens=256", "keep_checkpoints=true"]
    assert main(base) == 0
    capsys.readouterr()
    line = _fails(capsys, ["run", "--resume", str(run), "lora.r=4"], "the config differs from the one the run started with")
    assert "lora.r (8 -> 4)" in line
    text = (run / "config.yaml").read_text().replace("rounds: 2", "rounds: 3")
    (run / "config.yaml").write_text(text)
    assert "train.rounds (2 -> 3)" in _fails(capsys, ["run", "--resume", str(run)], "differs")
    (run / "config.yaml").write_text(text.replace("rounds: 3", "rounds: 2"))
    (run / "local" / "results.json").unlink()  # unfinished: resume reads its checkpoint
    ckpt = run / "local" / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    _fails(capsys, ["run", "--resume", str(run), "threads=1"], f"checkpoint {ckpt} is corrupt")


def test_resume_accepts_a_key_comix_gained_since_the_run_started_only_at_its_default(tmp_path, capsys):
    import json

    from comix.cli import main
    run = tmp_path / "run"
    assert main(["run", "model=tiny-llama", f"run_dir={run}", "methods=[local]", "train.rounds=1", "train.local_steps=1",
                 "train.batch_size=2", "train.seq_len=32", "data.valid_tokens=256", "data.test_tokens=256"]) == 0
    lock = run / "config.lock.json"
    started = json.loads(lock.read_text())
    del started["train.rouge"]  # a run saved by a comix that had no train.rouge yet
    lock.write_text(json.dumps(started))
    capsys.readouterr()
    assert "train.rouge (None -> 'rouge-score')" in _fails(capsys, ["run", "--resume", str(run), "train.rouge=rouge-score"],
                                                           "differs")
    assert main(["run", "--resume", str(run)]) == 0
    assert "keys added to comix since the run started, at their defaults: train.rouge" in capsys.readouterr().out


def test_a_full_disk_while_writing_says_so_and_keeps_the_previous_file(tmp_path):
    import errno

    from comix.files import atomic_write
    target = tmp_path / "checkpoint.pt"
    target.write_text("previous")

    def full(p):
        Path(p).write_text("half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 522752 vs 522640")
    with pytest.raises(OSError) as info:
        atomic_write(target, full)
    assert info.value.errno == errno.ENOSPC and "no space left" in str(info.value) and "intact" in str(info.value)
    assert target.read_text() == "previous" and [f.name for f in tmp_path.iterdir()] == ["checkpoint.pt"]
    with pytest.raises(RuntimeError, match="boom"):  # any other failure is not dressed up as a full disk
        atomic_write(target, lambda p: (_ for _ in ()).throw(RuntimeError("boom")))


def test_a_cache_folder_built_by_two_processes_at_once_keeps_the_first_and_replaces_only_an_incomplete_one(tmp_path):
    # pytest-xdist's workers on a fresh machine all built the byte tokenizer's cache: the later
    # renames failed with ENOTEMPTY (seen on a 16-core GPU machine, 2026-11-27)
    from comix.files import publish_dir

    def built(name, text):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
        return tmp_path / name
    target = tmp_path / "byte-tokenizer"
    publish_dir(built(".a", "first"), target, "tokenizer.json")
    publish_dir(built(".b", "second"), target, "tokenizer.json")  # finished later: dropped, the winner's readers undisturbed
    assert (target / "tokenizer.json").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == [target.name]
    (target / "tokenizer.json").unlink()
    (target / "vocab.txt").write_text("an older layout")
    publish_dir(built(".c", "third"), target, "tokenizer.json")
    assert (target / "tokenizer.json").read_text() == "third" and not (target / "vocab.txt").exists()


def test_model_shaped_options_are_checked_from_the_config_all_at_once(tmp_path, capsys, monkeypatch):
    """DeepFusion's device specs and stages against the base's sizes, every problem in
    one line naming deepfusion.devices / deepfusion.stages and the model, before any weights or
    data load and before the run directory exists; methods=[] is refused."""
    import comix.models
    monkeypatch.setattr(comix.models, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    run = tmp_path / "run"
    common = ["run", "model=tiny-llama", f"run_dir={run}", "train.rounds=1", "data.public_frac=0.1"]
    line = _fails(capsys, [*common, "methods=[deepfusion,ofa-kd]", "deepfusion.devices=[prune:1:1536,prune:9:32:64,base]"],
                  "deepfusion.devices: 'prune:1:1536' on the base (llama with 64 ffn): ffn = 1536 must lie in [1, 64]")
    assert "layers = 9 must lie in [1, 2]" in line and "width = 64 must lie in [1, 32]" in line
    assert "(model tiny-llama)" in line and line.count("ffn = 1536") == 1  # once, though two methods share it
    line = _fails(capsys, [*common, "methods=[deepfusion]", "deepfusion.devices=[prune:1:32,base]",
                           "deepfusion.stages=2", "deepfusion.queries=64"],
                  "deepfusion.stages = 2 exceeds the 1 blocks of 'prune:1:32'")
    assert "the base" not in line  # the base has 2 blocks: enough
    # FedKMT has no stage features: its stages are never used, so never refused
    from comix.models.base import model_config
    from comix.specs import build_algorithm
    cfg = load_config(overrides=["model=tiny-llama", "train.rounds=1", "deepfusion.devices=[prune:1:32]",
                                 "deepfusion.stages=2", "deepfusion.queries=64"])
    assert build_algorithm(cfg, "fedkmt", 4).check_model(model_config("tiny-llama")) == []
    assert build_algorithm(cfg, "deepfusion", 4).check_model(model_config("tiny-llama")) != []
    assert not run.exists()
    _fails(capsys, ["run", "model=tiny-llama", f"run_dir={run}", "methods=[]"], "methods is empty")


def test_a_newcomer_s_first_minutes(tmp_path, capsys, monkeypatch):
    """K parts 3-4: specs with brackets need no quotes; --help names models and corpora; `comix
    data` loads no model and refuses an unknown corpus first; one file mode per run; `comix run`
    says that it runs one seed of a grid; the domains are the columns of a server-scored table."""
    from comix.api import scored_names
    from comix.config import method_list

    assert load_config(overrides=["methods=[fedavg,hetlora:ranks=[16,16,32,32],reg=0.05,local]"]).methods == \
        ["fedavg", "hetlora:ranks=[16,16,32,32],reg=0.05", "local"]
    assert method_list("[fedavg,'fedavg:privacy.clip=0.05,privacy.noise_multiplier=1']") == \
        ["fedavg", "fedavg:privacy.clip=0.05,privacy.noise_multiplier=1"]
    # `compare --methods a b key=value`: the key=value after the specs is an override, not a method
    _fails(capsys, ["compare", "model=tiny-llama", "--methods", "fedavg", "hetlora:reg=0.05", "threads=-1"],
           "threads must be >= 0")
    _fails(capsys, ["compare", "model=tiny-llama", "--seeds", "1", "2", "threads=-1"], "threads must be >= 0")
    with pytest.raises(SystemExit):
        main(["compare", "--seeds", "1", "x"])
    assert "invalid int value: 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "smollm2-135m" in out and "multilingual" in out and "qa-open" in out
    import comix.models
    monkeypatch.setattr(comix.models, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(comix.models.base, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["data", "topics", "model=tiny-llama"]) == 0
    assert "TRAIN" in capsys.readouterr().out
    _fails(capsys, ["data", "no-such-corpus"], "unknown corpus 'no-such-corpus'")
    monkeypatch.undo()
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["run", f"corpus={data}", f"run_dir={run}", "methods=[fedavg]", "seeds=[1,2]", *TINY]) == 0
    assert "runs seed 42 only" in capsys.readouterr().err.replace("\n", " ")
    modes = {f.name: f.stat().st_mode & 0o777 for f in run.rglob("*") if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # results.json (atomic) and metrics.jsonl (appended) alike
    users = [type("U", (), {"name": n})() for n in ("client0", "client1")]
    assert scored_names([{"per_user": {"med": {}, "code": {}}}], users) == ["code", "med"]
    assert scored_names([{"per_user": {"client1": {}, "client0": {}}}], users) == ["client0", "client1"]


def test_an_unreachable_hub_fails_at_once_in_one_line(monkeypatch, capsys, tmp_path):
    """K: offline, a hub id that is not cached is one line after one 2-second connect attempt, not
    ~46 s of retries."""
    import socket
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tried = []

    def refuse(addr, timeout=None, *a, **k):
        tried.append((addr, timeout))
        raise OSError("network is unreachable")
    monkeypatch.setattr(socket, "create_connection", refuse)
    t0 = time.perf_counter()
    _fails(capsys, ["run", "model=no-org/no-such-model-xyz", f"run_dir={tmp_path / 'run'}"],
           "unknown model spec 'no-org/no-such-model-xyz'")
    assert time.perf_counter() - t0 < 30 and tried and tried[0][0][1] == 443 and tried[0][1] <= 2
    assert not (tmp_path / "run").exists()
