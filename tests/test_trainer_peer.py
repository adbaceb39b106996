"""bench/trainer_peer.py's peer: a ``transformers.Trainer`` built for each client round trains the
same update as comix's client round (fused AdamW, linear decay within the round, clipping), so the
bench's time and memory compare like with like. A peer that diverged (another schedule, unclipped,
the batches in another order) would make its ratio meaningless; this catches that."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_trainer_built_each_round_trains_what_comixs_client_round_trains(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import trainer_peer as peer
    algo, model, data, start, batches = peer.setting(2, 3, model="tiny-llama", batch=2, seq_len=16)
    ours = peer.comix_round(algo, model, data, start, batches[0])
    theirs = peer.trainer_round(algo, model, start, batches[0], tmp_path)
    assert peer.moved(start, ours) > 1e-3  # the round trained
    assert peer.rel_diff(ours, theirs) < 1e-6
    # the order of the batches is part of the update: reversed, the peer trains something else
    other = peer.trainer_round(algo, model, start, batches[0][::-1], tmp_path)
    assert peer.rel_diff(ours, other) > 1e-4
