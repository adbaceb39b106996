"""Instruction tasks end to end: built-in sets, partitions saved with the run, task
metrics in the engines and reports, post-aggregation fine-tuning, soft prompts."""
import json
import lzma

import pytest
import torch

from comix.algorithms import make_algorithm
from comix.algorithms.base import ClientContext, ClientState
from comix.algorithms.training import TrainConfig
from comix.data import SplitConfig, describe_partition, load_corpus, make_user_data
from comix.data.instructions import BUILTIN_DIR, RELATIONS, instruction_file
from comix.eval.tasks import choice_accuracy, choice_losses, continuation_losses, generate_split, split_accuracy
from comix.models import LoRAConfig, inject_adapters, load_base_model


def test_builtin_sets_hold_ten_generation_tasks_and_a_three_label_classification():
    gen = load_corpus("instructions")
    tasks = {}
    for ex in gen.examples:
        tasks[ex.category] = tasks.get(ex.category, 0) + 1
        assert ex.instruction and ex.output
    assert gen.task == "generation" and len(tasks) >= 10 and min(tasks.values()) >= 100, tasks
    rel = load_corpus("relations")
    labels = {ex.output for ex in rel.examples}
    assert rel.task == "classification" and labels == set(RELATIONS) == set(rel.choices)
    assert all(ex.category == ex.output for ex in rel.examples)  # label skew partitions by the label
    size = sum(f.stat().st_size for f in BUILTIN_DIR.glob("*.jsonl.xz") if f.stem.split(".")[0] in
               ("instructions", "relations"))
    assert size < 15e6
    rows = [json.loads(ln) for ln in lzma.open(BUILTIN_DIR / "instructions.jsonl.xz", "rt")]
    assert all(r["source"] for r in rows)  # provenance of every example


@pytest.fixture(scope="module")
def tok():
    return load_base_model("tiny-llama")[1]


def test_task_partition_splits_each_client_80_10_10_with_the_caps_and_is_reproducible(tok):
    iset = load_corpus("instructions")
    cfg = SplitConfig(partition="task", clients=3, test_examples=7, seed=3)
    users = make_user_data(iset, tok, cfg)
    assert len(users) == 3 and all(u.task == "generation" for u in users)
    for u in users:
        n = sum(ex.category == u.name for ex in iset.examples)
        assert len(u.test) == 7 and len(u.valid) == min(200, round(0.1 * n))
        assert len(u.train) == n - round(0.1 * n) - round(0.1 * n)
        texts = [{(e.instruction, e.input, e.output) for e in u.tokens(s).examples} for s in ("train", "valid", "test")]
        assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
        assert {e.category for s in ("train", "valid", "test") for e in u.tokens(s).examples} == {u.name}
    again = make_user_data(iset, tok, cfg)
    assert describe_partition(again) == describe_partition(users)
    other = make_user_data(iset, tok, SplitConfig(partition="task", clients=3, test_examples=7, seed=4))
    assert describe_partition(other) != describe_partition(users)


def test_dirichlet_partition_of_the_classification_set_skews_labels(tok):
    users = make_user_data(load_corpus("relations"), tok, SplitConfig(partition="dirichlet", clients=4, alpha=0.1,
                                                                    seed=0))
    shares = [max(row["train"]["categories"].values()) / row["train"]["size"]
              for row in describe_partition(users).values()]
    assert all(u.task == "classification" and u.choices == RELATIONS for u in users)
    assert sum(shares) / len(shares) > 0.7  # alpha 0.1: most of a client's examples share one label


def test_bad_instruction_inputs_fail_with_one_line_naming_them(tmp_path, tok):
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2: field 'output'"):
        instruction_file(bad)
    bad.write_text('{"choices": ["Yes", "No"]}\n{"instruction": "a", "output": "Perhaps"}\n')
    with pytest.raises(ValueError, match="not one of the choices"):
        instruction_file(bad)
    with pytest.raises(ValueError, match="unknown task.*no-such-task"):
        make_user_data(load_corpus("instructions"), tok, SplitConfig(users=["no-such-task"]))
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        load_corpus("nope")


def _split(tok, examples):
    from comix.data.instructions import tokenize_examples
    return tokenize_examples(examples, tok)


def test_split_accuracy_scores_labels_as_the_prompt_text_reference(tok):
    model, _ = load_base_model("tiny-llama")
    exs = [e for e in load_corpus("relations").examples[::500]][:6]
    split = _split(tok, exs)
    losses = choice_losses(model, split, RELATIONS, batch_size=4)  # 2 forwards: 4 + 2 examples x 3 labels
    for i, ex in enumerate(exs):
        ref = continuation_losses(model, tok, ex.prompt(), list(RELATIONS))
        torch.testing.assert_close(losses[i], ref, rtol=1e-5, atol=1e-5)
    expected = 100 * choice_accuracy(model, tok, [e.prompt() for e in exs], list(RELATIONS), [e.output for e in exs])
    assert split_accuracy(model, split, RELATIONS) == pytest.approx(expected)


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(tok):
    model, _ = load_base_model("tiny-llama")
    exs = load_corpus("instructions").examples[::900][:5]  # prompts of different lengths
    split = _split(tok, exs)
    batched = generate_split(model, split, max_new_tokens=6, batch_size=5)
    single = [generate_split(model, split.subset(i, i + 1), max_new_tokens=6, batch_size=1)[0] for i in range(5)]
    assert batched == single


def _ctx_state(method, tok, **options):
    model, _ = load_base_model("tiny-llama")
    users = make_user_data(load_corpus("instructions"), tok, SplitConfig(clients=2, test_examples=2))
    algo = make_algorithm(method, LoRAConfig(), TrainConfig(batch_size=2, local_steps=2, rounds=2), 2, **options)
    m = inject_adapters(model, algo.adapter_config(0))
    from comix.engines.device import fresh_adapters
    state = ClientState(adapters=algo.adapters_of(fresh_adapters(m, 1)))
    return algo, ClientContext(0, m, users[0], algo.train), state


@pytest.mark.parametrize("method", ["fedit", "fedit-ft"])
def test_ft_variant_is_evaluated_on_its_locally_fine_tuned_model(tok, method):
    algo, ctx, state = _ctx_state(method, tok)
    payload = algo.upload_of(state.adapters)
    state, upload, _ = algo.client_round(ctx, state, payload)
    aggregate = {n: t + 1.0 for n, t in upload.items()}  # the server's next payload
    personal = algo.personal_adapters(ctx, state, aggregate)
    final = algo.client_finish(ctx, ClientState(adapters=dict(state.adapters)), aggregate).adapters
    for n in upload:
        want = state.adapters[n] if method == "fedit-ft" else aggregate[n]
        assert torch.equal(personal[n], want) and torch.equal(final[n], want)


@pytest.mark.parametrize("method", ["fedprompt", "fedptuning"])
def test_soft_prompts_train_only_the_prompt_and_start_from_the_text(tok, method):
    algo, ctx, state = _ctx_state(method, tok)
    trainable = [n for n, p in ctx.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("prompt_encoder.") for n in trainable)
    if method == "fedprompt":  # TEXT init: the word embeddings of the soft prompt's tokens
        ids = tok(algo.prompt.init_text)["input_ids"]
        emb = ctx.model.get_input_embeddings().weight[torch.tensor(ids)]
        torch.testing.assert_close(state.adapters["prompt_encoder.default.embedding.weight"], emb.float())
    else:
        assert state.adapters["prompt_encoder.default.embedding.weight"].shape[0] == 20
    base = {n: p.clone() for n, p in ctx.model.named_parameters() if not p.requires_grad}
    before = dict(state.adapters)
    state, upload, metrics = algo.client_round(ctx, state, algo.upload_of(state.adapters))
    assert set(upload) == set(before) and any(not torch.equal(upload[n], before[n]) for n in upload)
    assert all(torch.equal(p, base[n]) for n, p in ctx.model.named_parameters() if not p.requires_grad)
    assert metrics["train_loss"] > 0


def test_fedamole_embedding_set_is_held_out_of_training_examples(tok):
    algo, ctx, state = _ctx_state("fedamole", tok, pool=4, slots=4)
    train, aux = algo.split(ctx.data.train)
    assert len(aux) == int(0.05 * len(ctx.data.train)) and len(train) + len(aux) == len(ctx.data.train)
    trained = {tuple(t[:-1].tolist()) for t in train.ids}
    held = {tuple(t[:-1].tolist()) for t in aux.ids} - trained
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):  # every training batch comes from the training part only
        x, y = algo.train_batch(ctx, gen)
        for row, target in zip(x, y):
            n = int((target != -100).nonzero().max()) + 1  # the example's length (padding after it)
            assert tuple(row[:n].tolist()) in trained and tuple(row[:n].tolist()) not in held
    inputs = algo.embedding_inputs(aux)  # whole held-out examples, one per forward: no padding
    assert [tuple(x[0].tolist()) for x in inputs] == [tuple(t.tolist()) for t in aux.ids]
    assert 0 < len(inputs) <= algo.embed_examples


def test_a_run_on_an_instruction_set_reports_its_task_metric_and_saves_the_partition(tmp_path):
    from comix.cli import main
    rc = main(["compare", "model=tiny-llama", "corpus=relations", "data.partition=dirichlet", "data.clients=3",
               "data.test_examples=5", "data.valid_examples=3", "train.rounds=2", "train.local_steps=1",
               "train.batch_size=2", "train.eval_every=1", f"run_dir={tmp_path}", "--methods", "fedit", "fedit-ft",
               "fedamole:pool=6,slots=4", "--seeds", "1", "2"])
    assert rc == 0
    res = json.loads((tmp_path / "seed1" / "fedit" / "results.json").read_text())
    assert res["metric"] == "test_acc" and "mean_test_ppl" not in res
    accs = [u["test_acc"] for u in res["per_user"].values()]
    assert res["mean"] == pytest.approx(sum(accs) / 3) and all(a in (0, 20, 40, 60, 80, 100) for a in accs)
    rows = [json.loads(ln) for ln in (tmp_path / "seed1" / "fedit" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "test_acc" in r] == [1, 1, 1, 2, 2, 2]  # MTA[t] every round
    md = (tmp_path / "compare.md").read_text()
    assert "Test accuracy (%)" in md and "MTAL" in md and "fedit-ft" in md
    part = json.loads((tmp_path / "partition.json").read_text())
    assert set(part) == {"client0", "client1", "client2"} and part["client0"]["test"]["size"] == 5
    assert (tmp_path / "curves.png").exists()
    # the trivial baselines beside the table: the majority training label per client, from the partition
    from comix.comparison import majority_label_accuracy
    majority = majority_label_accuracy(part)
    by_hand = [100 * u["test"]["labels"][max(u["train"]["labels"], key=lambda c: (u["train"]["labels"][c], c))] /
               u["test"]["size"] for u in part.values()]
    assert majority == pytest.approx(sum(by_hand) / 3) and f"scores {majority:.2f}" in md
    for u, m in res["per_user"].items():  # each client's predictions counted, in label order
        assert sum(m["test_predicted"].values()) == 5 and list(m["test_predicted"]) == list(RELATIONS)
    assert "| fedit | " in md.split("Trivial baselines")[1]
    # Table IV: the upload column is the mean of what the clients sent, per client and round, in MB
    up = [r["bytes_up"] / 2**20 for s in (1, 2) for r in
          map(json.loads, (tmp_path / f"seed{s}" / "fedit" / "metrics.jsonl").read_text().splitlines())]
    row = next(ln for ln in md.splitlines() if ln.startswith("| fedit |") and "MB" not in ln and ln.count("|") == 10)
    assert row.split("|")[4].strip() == f"{sum(up) / len(up):.3g}"
    fedamole_row = next(ln for ln in md.splitlines() if ln.startswith("| fedamole:pool=6,slots=4 |") and ln.count("|") == 10)
    assert fedamole_row.split("|")[7].strip() != "-"  # RSEA time logged by the server
    # Fig. 8 is drawn for the run that assigns experts by relevance, and only for it
    assert (tmp_path / "assignment-fedamole__pool=6_slots=4.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "assignment-fedit.png").exists()


def test_data_seed_run_gives_each_seed_of_a_grid_its_own_partition_and_test_set(tmp_path, capsys):
    """data.seed: run draws the partition and the splits from each grid seed (the intervals over
    seeds then cover the data split); a fixed data.seed keeps one partition for every seed."""
    from comix.cli import main
    common = ["model=tiny-llama", "corpus=relations", "data.partition=dirichlet", "data.clients=3",
              "data.test_examples=5", "data.valid_examples=3", "train.rounds=1", "train.local_steps=1",
              "train.batch_size=2", "--methods", "local", "--seeds", "1", "2"]
    for name, seed in (("run", "run"), ("fixed", "7"), ("mapped", "{1: 7, 2: 2}")):
        assert main(["compare", f"data.seed={seed}", f"run_dir={tmp_path / name}", *common]) == 0
    parts = {s: json.loads((tmp_path / "run" / f"seed{s}" / "partition.json").read_text()) for s in (1, 2)}
    assert parts[1] != parts[2]
    assert not (tmp_path / "run" / "partition.json").exists()  # no one partition for the grid
    assert not (tmp_path / "fixed" / "seed1" / "partition.json").exists()
    sizes = {s: [u["train"]["size"] for u in parts[s].values()] for s in (1, 2)}
    assert sizes[1] != sizes[2]  # Dirichlet draws of their own
    # a stated data seed per grid seed: seed 1 on data seed 7's split (the fixed grid's), seed 2 on
    # data seed 2's (data.seed: run's for seed 2), and no one partition for the grid
    mapped = {s: json.loads((tmp_path / "mapped" / f"seed{s}" / "partition.json").read_text()) for s in (1, 2)}
    assert mapped[1] == json.loads((tmp_path / "fixed" / "partition.json").read_text()) != parts[1]
    assert mapped[2] == parts[2]
    assert not (tmp_path / "mapped" / "partition.json").exists()
    assert "each seed its own data split (data seeds {1: 7, 2: 2})" in (tmp_path / "mapped" / "compare.md").read_text()
    said = capsys.readouterr().err  # the console's: each seed's own token table, named by its data seed
    assert "seed 1: data seed 7" in said and "seed 2: data seed 2" in said


def test_a_data_seed_mapping_without_a_grid_seed_fails_before_the_run_directory(tmp_path, capsys):
    from comix.cli import main
    assert main(["compare", "model=tiny-llama", "corpus=relations", "data.seed={1: 7}", "--seeds", "1", "2",
                 "--methods", "local", f"run_dir={tmp_path / 'r'}"]) != 0
    assert "data.seed gives no data seed for seed(s) [2]" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_one_label_share_counts_the_clients_whose_model_answers_one_label_only():
    from comix.comparison import majority_label_accuracy, one_label_share
    result = {"per_user": {"a": {"test_predicted": {"Synonym": 5, "Antonym": 0}},
                           "b": {"test_predicted": {"Synonym": 3, "Antonym": 2}},
                           "c": {"test_predicted": {"Synonym": 0, "Antonym": 4}}, "d": {}}}
    assert one_label_share(result) == pytest.approx(200 / 3)
    part = {"a": {"train": {"labels": {"Synonym": 9, "Antonym": 1}}, "test": {"labels": {"Synonym": 1, "Antonym": 3}}},
            "b": {"train": {"labels": {"Synonym": 2, "Antonym": 2}}, "test": {"labels": {"Synonym": 2, "Antonym": 2}}}}
    assert majority_label_accuracy(part) == pytest.approx((25 + 50) / 2)  # a tie goes to the later name


def test_evaluation_runs_without_dropout_and_restores_the_mode(tok):
    from comix.engines.device import evaluate
    model, _ = load_base_model("tiny-gpt2", dropout=0.3)
    users = make_user_data(load_corpus("relations"), tok, SplitConfig(partition="dirichlet", clients=2,
                                                                    test_examples=6, valid_examples=4, max_len=250))
    train = TrainConfig(eval_splits=["valid", "test"], eval_batch_size=4)
    model.train()
    first, second = evaluate(model, users[0], train), evaluate(model, users[0], train)
    assert first == second and set(first) == {"valid_ppl", "test_ppl", "test_acc", "test_predicted"} and model.training


@pytest.mark.parametrize("rouge", ["rouge", "rouge-score"])
def test_a_generation_client_reports_the_chosen_rouge_and_the_other_beside_it(tok, rouge, monkeypatch):
    """``train.rouge`` picks the run's metric (default: the authors' ``rouge`` package); the same
    generations scored by the other implementation are reported beside it. The planted answers are
    the references upper-cased: 0 for the case-sensitive package, 100 for rouge_score."""
    from comix.engines.device import evaluate
    from comix.eval import tasks
    model, _ = load_base_model("tiny-llama")
    user = make_user_data(load_corpus("instructions"), tok, SplitConfig(clients=2, test_examples=3))[0]
    monkeypatch.setattr(tasks, "generate_split", lambda m, split, *a, **k: [ex.output.upper() for ex in split.examples])
    out = evaluate(model, user, TrainConfig(max_new_tokens=4, eval_splits=["test"], rouge=rouge))
    other = "rouge-score" if rouge == "rouge" else "rouge"
    by = {impl: 100 * sum(tasks.rouge_l(ex.output.upper(), ex.output, impl) for ex in user.test.examples) / 3
          for impl in ("rouge", "rouge-score")}
    assert by["rouge-score"] == pytest.approx(100.0) and by["rouge"] < 50  # case-sensitive: far apart
    assert out["test_rouge_l"] == pytest.approx(by[rouge])
    assert out[f"test_rouge_l_{other.replace('-', '_')}"] == pytest.approx(by[other])
