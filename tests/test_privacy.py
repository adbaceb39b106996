"""Client-level DP (comix/privacy.py): the clip on every upload, the noise's std, the accountant,
the exact non-private limit, the refusals and privacy.md."""
import json
import math

import pytest
import torch

from comix.algorithms import TrainConfig, average, make_algorithm
from comix.config import ConfigError, load_config
from comix.engines.states import StateStore
from comix.engines.inprocess import InProcess
from comix.engines.server import sample_clients, serve
from comix.models import LoRAConfig
from comix.privacy import (GaussianSumNoise, PrivacyConfig, calibrate, clip_upload, epsilon, epsilon_after,
                           resolve_privacy)
from comix.specs import build_algorithm, spec_dirname
from test_server import setup  # noqa: F401 (the shared tiny fixture: tiny Llama, three users)

TRAIN = dict(rounds=2, local_steps=2, batch_size=2, seq_len=16, eval_every=2, eval_batch_size=4)


class Recorder(InProcess):
    """Keeps every round's payloads and replies as the server received them."""

    def __init__(self, *a):
        super().__init__(*a)
        self.sent, self.got = [], []

    def train(self, payloads):
        self.sent.append({c: dict(p) for c, p in payloads.items()})
        replies = super().train(payloads)
        self.got.append({c: dict(r[0]) for c, r in replies.items()})
        return replies


def run(setup, tmp_path, method="fedavg", privacy=PrivacyConfig(), **train):
    model, users = setup
    algo = make_algorithm(method, LoRAConfig(r=4), TrainConfig(**{**TRAIN, **train}), len(users))
    algo.privacy = privacy
    transport = Recorder(algo, model, users, 0, StateStore())
    result = serve(algo, transport, [u.name for u in users], tmp_path, seed=0)
    return algo, transport, result


def update_norm(upload, start):
    return math.sqrt(sum(float((t.float() - start[n].float()).pow(2).sum()) for n, t in upload.items()))


# -- clipping -------------------------------------------------------------------------------------
def test_every_upload_s_whole_update_is_clipped_on_the_device(setup, tmp_path):
    clip = 1e-3  # far below the updates' norms, so every client is clipped
    algo, tr, _ = run(setup, tmp_path, privacy=PrivacyConfig(clip=clip))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["update_norm"] > 10 * clip for r in rows)  # the unclipped norm, reported by the device
    for sent, got in zip(tr.sent, tr.got):
        for c, up in got.items():
            # over all shared tensors together (per-tensor clipping would let the total reach clip x sqrt(#tensors))
            assert update_norm(up, sent[c]) <= clip * (1 + 1e-4)
            assert update_norm(up, sent[c]) >= clip * (1 - 1e-4)  # scaled to the bound, not zeroed


def test_clip_scales_the_update_not_the_tensor_and_spares_exempt_tensors():
    start = {"a": torch.ones(4), "b": torch.zeros(3)}
    upload = {"a": torch.ones(4) + 3.0, "b": torch.full((3,), 4.0), "rsea.x": torch.full((2,), 100.0)}
    out, norm = clip_upload(upload, start, 1.0, exempt=lambda n: n.startswith("rsea."))
    assert norm == pytest.approx(math.sqrt(4 * 9 + 3 * 16))
    assert update_norm({k: out[k] for k in "ab"}, start) == pytest.approx(1.0)
    assert torch.allclose(out["a"] - 1, torch.full((4,), 3.0 / norm))  # the update scaled, the start kept
    assert torch.equal(out["rsea.x"], upload["rsea.x"])
    same, _ = clip_upload(upload, start, 1e6)
    assert same is upload  # within the bound: untouched


class Poisoner(Recorder):
    """Client 0's upload is a poisoned update: its honest update times 1,000 (kept: ``got``)."""

    def train(self, payloads):
        replies = super().train(payloads)
        up, metrics = replies[0]
        replies[0] = ({n: payloads[0][n] + 1000 * (t - payloads[0][n]) for n, t in up.items()}, metrics)
        return replies


def _distance(a, b):
    return math.sqrt(sum(float((a[n].float() - b[n].float()).pow(2).sum()) for n in a))


def test_the_server_s_norm_bound_keeps_one_poisoned_client_from_moving_the_aggregate(setup, tmp_path):
    model, users = setup

    def run_with(transport_cls, out, **privacy):
        algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(**TRAIN), len(users))
        algo.privacy = PrivacyConfig(**privacy)
        tr = transport_cls(algo, model, users, 0, StateStore())
        serve(algo, tr, [u.name for u in users], tmp_path / out, seed=0)
        return tr, [json.loads(x) for x in (tmp_path / out / "server.jsonl").read_text().splitlines()]
    honest, _ = run_with(Recorder, "honest")
    bound = 2 * max(update_norm(up, honest.sent[0][c]) for c, up in honest.got[0].items())
    bounded, rows = run_with(Poisoner, "bounded", server_clip=bound)
    loose, _ = run_with(Poisoner, "loose")
    n = len(users)
    moved = _distance(bounded.sent[1][0], honest.sent[1][0])  # round 2's payload: round 1's aggregate
    # the poisoned update, clipped to the bound, and the honest one it replaced, each weighing 1 / n
    assert 0 < moved <= 2 * bound / n * (1 + 1e-4)
    assert _distance(loose.sent[1][0], honest.sent[1][0]) > 100 * bound / n  # without it: moved 1,000x
    assert rows[0]["server_clipped"] == 1  # the poisoned client only: the honest ones are within the bound
    for c in (1, 2):  # honest uploads are aggregated untouched
        assert all(torch.equal(bounded.got[0][c][k], honest.got[0][c][k]) for k in honest.got[0][c])


def test_the_server_s_bound_is_off_by_default_and_refused_under_secure_aggregation():
    assert PrivacyConfig().server_clip == math.inf and not PrivacyConfig(server_clip=1.0).active
    assert "masked sum" in PrivacyConfig(server_clip=1.0, secure_aggregation=True).problem()
    assert "server_clip" in PrivacyConfig(server_clip=0.0).problem()


# -- noise ----------------------------------------------------------------------------------------
def test_noise_is_added_to_the_sum_with_std_sigma_times_clip():
    sigma, clip, n = 0.7, 2.0, 4
    uploads = {c: {"w": torch.zeros(200_000)} for c in range(n)}
    noisy = average(uploads, GaussianSumNoise(sigma * clip, seed=1, rnd=1))["w"]
    # on the sum, then divided by the n clients: std sigma x clip / n (on the mean it would be sigma x clip)
    assert noisy.std().item() == pytest.approx(sigma * clip / n, rel=0.01)
    assert abs(noisy.mean().item()) < 5 * sigma * clip / n / math.sqrt(200_000)
    again = average(uploads, GaussianSumNoise(sigma * clip, seed=1, rnd=1))["w"]
    assert torch.equal(noisy, again)  # seeded by (seed, round): every engine draws the same
    assert not torch.equal(noisy, average(uploads, GaussianSumNoise(sigma * clip, seed=1, rnd=2))["w"])


def test_the_server_s_aggregate_carries_the_noise(setup, tmp_path):
    sigma, clip = 0.5, 1e-3
    algo, tr, _ = run(setup, tmp_path / "dp", privacy=PrivacyConfig(clip=clip, noise_multiplier=sigma))
    n = len(tr.got[0])
    for r in range(1):
        name = next(iter(tr.got[r][0]))
        mean = torch.stack([up[name].float() for up in tr.got[r].values()]).mean(0)
        noise = tr.sent[r + 1][0][name].float() - mean  # round r + 1's payload minus the clean mean
        assert noise.std().item() == pytest.approx(sigma * clip / n, rel=0.15)


def test_each_round_and_each_tensor_draws_fresh_noise(setup, tmp_path):
    """DP-FedAvg's guarantee composes over rounds only if every round's noise is a new draw: the
    noise the server added (a round's next payload minus the clean mean) differs between rounds
    and between the tensors of one round, and is uncorrelated across rounds. An engine that hands
    every round the same round number (or a generator re-seeded per tensor) fails this."""
    sigma, clip = 0.5, 1e-3
    algo, tr, _ = run(setup, tmp_path / "dp", privacy=PrivacyConfig(clip=clip, noise_multiplier=sigma), rounds=3,
                      eval_every=3)
    noises = []
    for r in range(2):
        names = sorted(tr.got[r][0])
        mean = {n: torch.stack([up[n].float() for up in tr.got[r].values()]).mean(0) for n in names}
        noises.append({n: tr.sent[r + 1][0][n].float() - mean[n] for n in names})
    names = sorted(noises[0])
    a, b = (torch.cat([noise[n].reshape(-1) for n in names]) for noise in noises)
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]).__abs__() < 0.1
    same_shape = [n for n in names if noises[0][n].shape == noises[0][names[0]].shape]
    assert len(same_shape) > 1 and not torch.allclose(noises[0][same_shape[0]], noises[0][same_shape[1]])
    seeded = [GaussianSumNoise(1.0, seed=s, rnd=1)(torch.zeros(100)) for s in (1, 2)]
    assert not torch.equal(*seeded)  # and the run's seed enters the draw, not the round alone


def test_no_noise_and_no_clip_reproduce_the_non_private_run_exactly(setup, tmp_path):
    _, plain, res = run(setup, tmp_path / "plain")
    _, loose, res2 = run(setup, tmp_path / "loose", privacy=PrivacyConfig(clip=1e9, noise_multiplier=0.0))
    assert res["per_user"] == res2["per_user"]
    for a, b in zip(plain.got, loose.got):
        assert all(torch.equal(a[c][n], b[c][n]) for c in a for n in a[c])


# -- the accountant -------------------------------------------------------------------------------
def test_epsilon_is_dp_accounting_s_for_the_run_s_sampling():
    import dp_accounting as dpa
    from dp_accounting import rdp
    from dp_accounting.rdp.rdp_privacy_accountant import NeighborRel

    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 100))
    assert epsilon(1.0, 100, 1e-5, "poisson", 100, 100, 0.1) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    # fixed clients per round: replace-one neighbours, sensitivity 2 x clip, so sigma / 2
    acc = rdp.RdpAccountant(neighboring_relation=NeighborRel.REPLACE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(100, 10, dpa.GaussianDpEvent(0.5)), 100))
    assert epsilon(1.0, 100, 1e-5, "fixed", 100, 10, 0.1) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    # full participation: no amplification, more epsilon than any subsampled run
    assert epsilon(1.0, 100, 1e-5, "full") > epsilon(1.0, 100, 1e-5, "poisson", 100, 100, 0.1)
    assert epsilon(2.0, 10, 1e-5) < epsilon(1.0, 10, 1e-5) < epsilon(1.0, 20, 1e-5)


def test_the_accountant_follows_the_engine_s_client_sampling():
    fixed = TrainConfig(clients_per_round=3)
    poisson = TrainConfig(client_sampling="poisson", client_fraction=0.3)
    p = PrivacyConfig(noise_multiplier=1.0, clip=1.0)
    assert epsilon_after(p, 5, 10, fixed) == epsilon(1.0, 5, 1e-5, "fixed", 10, 3, 0.3)
    assert epsilon_after(p, 5, 10, poisson) == epsilon(1.0, 5, 1e-5, "poisson", 10, 10, 0.3)
    assert epsilon_after(p, 5, 10, TrainConfig()) == epsilon(1.0, 5, 1e-5, "full")
    counts = {len(sample_clients(10, poisson, 0, r)) for r in range(1, 40)}
    assert len(counts) > 2 and all(len(sample_clients(10, fixed, 0, r)) == 3 for r in range(1, 10))


def test_epsilon_per_round_in_metrics_and_a_privacy_record(setup, tmp_path):
    p = PrivacyConfig(clip=0.01, noise_multiplier=1.0)
    algo, tr, _ = run(setup, tmp_path, privacy=p)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["epsilon"] == epsilon_after(p, r["round"], 3, algo.train)
    assert rows[-1]["epsilon"] > rows[0]["epsilon"]
    record = (tmp_path / "privacy.md").read_text()
    assert "DP-FedAvg, clip 0.01" in record and f"{rows[-1]['epsilon']:.4g}" in record
    uploaded = {n for got in tr.got for up in got.values() for n in up}
    listed = {ln.split(" | ")[0][2:] for ln in record.splitlines() if ln.startswith("| model.")}
    assert listed == uploaded  # exactly the tensors that left, each named


def test_target_epsilon_calibrates_the_noise_or_refuses():
    train = TrainConfig(rounds=20)
    p = resolve_privacy(PrivacyConfig(clip=1.0, target_epsilon=8.0), 10, train)
    assert epsilon_after(p, 20, 10, train) <= 8.0 < epsilon_after(
        PrivacyConfig(clip=1.0, noise_multiplier=p.noise_multiplier * 0.99), 20, 10, train)
    with pytest.raises(ValueError, match="cannot be met"):
        resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=0.3, target_epsilon=1.0), 10, train)
    assert calibrate(8.0, 20, 1e-5, "full", 10, 10, 1.0) == pytest.approx(p.noise_multiplier, rel=1e-5)


# -- bad input and refusals -----------------------------------------------------------------------
def test_a_target_epsilon_whose_noise_drowns_every_update_is_refused_before_any_work(tmp_path, capsys):
    """epsilon 0.001 calibrates sigma ~1e5: every upload would turn into noise (then NaN). One line
    with the sigma and why, exit 2, no run folder; a sigma at the bound still runs."""
    from test_cli import _fails
    run = tmp_path / "run"
    line = _fails(capsys, ["run", "model=tiny-llama", "methods=[fedavg]", "privacy.clip=1.0",
                           "privacy.target_epsilon=0.001", f"run_dir={run}"], "would be drowned")
    assert "sigma = " in line and "more than the 4 clients averaged per round" in line
    assert not run.exists()
    train = TrainConfig(rounds=3)
    assert resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=4.0), 4, train).noise_multiplier == 4.0
    with pytest.raises(ValueError, match="would be drowned"):
        resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=4.5), 4, train)
    poisson = TrainConfig(rounds=3, client_sampling="poisson", client_fraction=0.1)
    assert resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=9.0), 100, poisson).noise_multiplier == 9.0
    with pytest.raises(ValueError, match="10 clients averaged"):
        resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=11.0), 100, poisson)
    # fewer than one client expected a round (Poisson, rate x N = 0.5): sigma up to 1 still runs (its
    # noise is at most the bound of one whole update), above 1 it is refused
    sparse = TrainConfig(rounds=3, client_sampling="poisson", client_fraction=0.05)
    assert resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=1.0), 10, sparse).noise_multiplier == 1.0
    with pytest.raises(ValueError, match="would be drowned"):
        resolve_privacy(PrivacyConfig(clip=1.0, noise_multiplier=1.2), 10, sparse)


@pytest.mark.parametrize("override,words", [
    ("privacy.clip=0", "privacy.clip must be > 0"),
    ("privacy.noise_multiplier=-1", "noise_multiplier must be >= 0"),
    ("privacy.delta=1.0", "privacy.delta must be in (0, 1)"),
    ("privacy.target_epsilon=-2", "target_epsilon must be >= 0"),
    ("privacy.noise_multiplier=1.0", "need a finite privacy.clip"),
])
def test_bad_privacy_settings_are_one_line(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[override])


@pytest.mark.parametrize("method,words", [("deepfusion", "sample-level DP-SGD"), ("local", "shares nothing"),
                                          ("hetlora", "not a mean"), ("centralized", "uploads nothing"),
                                          ("flora", "stacks the uploads"), ("fedlease", "within clusters")])
def test_methods_that_cannot_offer_dp_refuse_in_one_line(method, words):
    cfg = load_config(overrides=[f"methods=[{method}]", "privacy.clip=1.0", "privacy.noise_multiplier=1.0"])
    with pytest.raises(ConfigError, match=words):
        build_algorithm(cfg, method, 4)


def test_every_dp_capable_method_averages_through_the_noisy_aggregate():
    """A method that says it offers DP but averaged around ``aggregate`` would upload noise-free sums."""
    from comix.algorithms import REGISTRY

    capable = [m for m, (cls, _) in REGISTRY.items() if cls.dp_refusal() is None]
    assert {"fedavg", "fedit", "comigs-1g1s", "fedamole", "fdlora-fedamole", "ffa-lora", "fedalt"} <= set(capable)
    for m in ("fedavg", "fedit", "comigs-1g1s", "ffa-lora", "fedsa-lora", "fdlora-comigs", "fdlora-fedamole"):
        algo = make_algorithm(m, LoRAConfig(r=2), TrainConfig(rounds=2), 2)
        calls = []
        algo.aggregation_noise = lambda t, calls=calls: calls.append(t.shape) or t
        up = {c: {"model.layers.0.mlp.gate_proj.lora_A": torch.ones(2, 4)} for c in range(2)}
        state, _ = algo.server_init(up)
        algo.server_round(state, up)
        assert calls, f"{m} aggregated without the noise"


def test_compare_sets_utility_against_epsilon_beside_the_noise_free_run():
    from comix.comparison import privacy_table

    p = {"clip": 0.05, "noise_multiplier": 1.0, "delta": 1e-5}
    results = {"fedavg": {42: {"metric": "test_ppl", "mean": 10.0}},
               "fedavg:privacy.noise_multiplier=1": {42: {"metric": "test_ppl", "mean": 12.0, "privacy": p,
                                                         "epsilon": 3.5}},
               "local": {42: {"metric": "test_ppl", "mean": 11.0}}}
    table = privacy_table(results)
    assert "| fedavg | - | - | inf (no DP) | 10.00 |" in table
    assert "| fedavg sigma=1 | 0.05 | 1 | 3.5 | 12.00 |" in table and "| epsilon (delta 1e-05) |" in table
    assert "local" not in table  # a method never run privately has no row
    assert privacy_table({"fedavg": results["fedavg"]}) == ""


def test_a_calibrated_run_states_its_sigma_epsilon_and_clipped_updates(tmp_path, capsys):
    """The sigma calibrated to a target epsilon is printed and kept in config.lock.json (resume
    still matches); results.md has the epsilon column; privacy.md counts the clipped updates per
    round (exactly those whose norm was above the clip) and explains fixed-k sampling's epsilon;
    a method that uploads nothing says so instead of listing zero-byte uploads."""
    from comix.cli import main
    from test_cli import TINY, _user_dirs
    run = tmp_path / "run"
    spec = "fedavg:privacy.clip=0.3,privacy.target_epsilon=30"
    tight = "fedavg:privacy.clip=0.01,privacy.noise_multiplier=0.5"  # every update above the clip
    args = [f"corpus={_user_dirs(tmp_path / 'data')}", f"run_dir={run}", *TINY, f"methods=[local,'{spec}','{tight}']",
            "train.clients_per_round=2"]
    assert main(["run", *args]) == 0
    err = capsys.readouterr().err
    lock = json.loads((run / "config.lock.json").read_text())
    sigma = lock[f"calibrated.{spec}.privacy.noise_multiplier"]
    assert f"noise multiplier {sigma:g} (fixed sampling" in " ".join(err.split())
    assert "| mean | epsilon |" in (run / "results.md").read_text()
    counts = []
    for folder, clip in ((run / spec_dirname(spec), 0.3), (run / spec_dirname(tight), 0.01)):
        record = (folder / "privacy.md").read_text()
        assert "replace-one neighbours" in record
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        for rnd in (1, 2):
            norms = [r["update_norm"] for r in rows if r["round"] == rnd and "update_norm" in r]
            line = next(ln for ln in record.splitlines() if ln.startswith(f"| {rnd} | "))
            counts.append(sum(n > clip for n in norms))
            assert f" {counts[-1]} of {len(norms)} |" in line
    assert counts[-1] == 2 and counts[0] < 2  # the planted clips: none or some, then all
    assert "Uploads: none" in (run / "local" / "privacy.md").read_text()
    assert main(["run", "--resume", str(run)]) == 0  # the calibrated sigma is no config change
