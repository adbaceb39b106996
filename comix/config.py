"""Run configuration: YAML recipes plus ``key=value`` overrides, validated with one-line errors.

Sections map to dataclasses (``data`` -> SplitConfig, ``train`` -> TrainConfig, ``lora`` ->
LoRAConfig, ``comigs``); an unknown key or a value of the wrong type names the key and what is
allowed. With no file the defaults are the *main job*: SmolLM2-135M on the built-in multilingual
split, Pretrained / Local / FedAvg / CoMiGS-1G1S at a scale that runs in ~10 min on 2 CPU cores.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .algorithms import METHODS, REGISTRY, TrainConfig, section_of
from .data import SplitConfig
from .models import LoRAConfig
from .aggregation import ServerConfig
from .combinations import combination_problem
from .privacy import PrivacyConfig
from .recipes import RECIPES, ConfigFileMissing, recipe_path  # noqa: F401 (RECIPES: the built-in recipes)


class ConfigError(ValueError):
    pass


def per_seed_split(data: SplitConfig) -> bool:
    """Does each seed of a grid split and partition the data its own way? ``data.seed: run`` (the
    training seed is the data seed) or a mapping {training seed: data seed} (a stated list of
    partition seeds: a grid whose first seed ran on one split keeps it, the later seeds their own)."""
    return data.seed == "run" or isinstance(data.seed, dict)


def with_data_seed(cfg: "RunConfig", seed: int) -> "RunConfig":
    """``cfg`` for training seed ``seed``: with ``data.seed: run`` the data are split and
    partitioned with that seed, with a mapping with the data seed it gives ``seed`` (each seed of a
    grid its own partition and test set), else ``cfg``."""
    if not per_seed_split(cfg.data):
        return cfg
    if isinstance(cfg.data.seed, dict):
        if seed not in cfg.data.seed:
            raise ConfigError(f"data.seed gives no data seed for seed {seed} (it maps {sorted(cfg.data.seed)})")
        seed = cfg.data.seed[seed]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=seed))


def check_data_seeds(cfg: "RunConfig") -> None:
    """A data-seed mapping names every seed of the grid (``seeds``, or the run's ``seed``): checked
    once the grid is known (``--seeds`` comes after the config), before any data loads."""
    if isinstance(cfg.data.seed, dict):
        seeds = sorted(cfg.seeds or [cfg.seed])
        if missing := [s for s in seeds if s not in cfg.data.seed]:
            raise ConfigError(f"data.seed gives no data seed for seed(s) {missing}: give one for each of {seeds}")


def first_split_seed(cfg: "RunConfig") -> int:
    """The training seed whose split a run loads first: ``seed``, unless a data-seed mapping
    leaves it out of a grid (``seeds``) that then starts with its own first seed."""
    if isinstance(cfg.data.seed, dict) and cfg.seed not in cfg.data.seed and cfg.seeds:
        return cfg.seeds[0]
    return cfg.seed


@dataclass
class ComigsConfig:
    experts: int | list[int] = 2      # per-user list for comigs-1gxs, e.g. [2, 2, 4, 4]
    top_k: int = 2                    # experts each token is routed to
    share_router: bool = False        # average the routers too (FedAvg-MoE's "all" strategy)


def _options_section(cls) -> type:
    """A config section made from a method's constructor options (one source of defaults)."""
    skip = {"self", "lora", "train", "n_clients"}
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name not in skip]
    return dataclasses.make_dataclass(f"{cls.__name__}Options", [(p.name, object, field(default=p.default))
                                                                 for p in params])


SECTIONS = {cls.section: _options_section(cls) for cls, _ in REGISTRY.values()
            if cls.section and cls.section != "comigs"}


def _main_job_train() -> TrainConfig:
    # Small scale for 2 CPU cores (~10 min): 3 rounds x 4 local steps of 4 x 128 tokens; the
    # router is updated every 6 expert iterations (paper: every 30, at 10 per round) with 3
    # validation steps; test perplexity once, after the last round.
    return TrainConfig(rounds=3, local_steps=4, batch_size=4, seq_len=128, tau=6, router_steps=3,
                       eval_every=3, eval_batch_size=8, eval_splits=["test"])


def _main_job_data() -> SplitConfig:
    return SplitConfig(valid_tokens=16_384, test_tokens=2_048)


@dataclass
class RunConfig:
    model: str = "smollm2-135m"        # smollm2-135m (offline default), gemma3-270m, a tiny-* model, a hub id or folder
    dropout: float = 0.0               # base-model dropout, every architecture (paper: nanoGPT's 0)
    corpus: str = "multilingual"       # a built-in corpus or instruction set, a folder of user files, a hub dataset
    # method specs to run, e.g. [local, fedavg, 'hetlora:reg=0.05']
    methods: list[str] = field(default_factory=lambda: ["pretrained", "local", "fedavg", "comigs-1g1s"])
    seed: int = 42                     # training seed (initial adapters, batches, sampling)
    seeds: list[int] = field(default_factory=list)  # `comix compare`: the seeds of the grid (default [seed])
    run_dir: str = ""                  # default: runs/<corpus>-<timestamp>
    threads: int = 0                   # torch threads; 0 = torch's default
    device: str = "auto"               # auto (CUDA when present) | cpu | cuda | cuda:N
    precision: str = "fp32"            # fp32 | bf16 | fp16 (comix/runtime.py: fp32 adapter masters)
    # the frozen base's block linears: none | int8 | q4 | nf4 (models/quant.py), one per client
    # ([none, nf4, ...]), or auto: each device of the fleet the least-compressed that fits it (comix/fleet.py)
    quant: str | list[str] = "none"
    # slices each training batch is computed in (gradient accumulation: one optimiser step a batch,
    # the activations of a slice), one per client, or auto: each device of the fleet the fewest
    # its memory budget needs, before a more compressed base (comix/fleet.py)
    micro_batches: int | str | list[int] = 1
    fleet: str = ""                    # a fleet file or a built-in fleet: device budgets, throughput, availability, deadline (comix/fleet.py)
    compile: bool | None = None        # torch.compile the mixtures' slot work; None (= auto): on CUDA only
    graphs: bool | None = None         # a cohort's training step captured as one CUDA graph; None (= auto): on CUDA
    gpus_per_client: float = 0.0       # Flower simulation: GPU share of each virtual device (num_gpus)
    offload: bool = False              # keep idle clients' states on disk
    keep_checkpoints: bool = False     # keep checkpoint.pt and client states after a method finishes
    engine: str = "inprocess"          # inprocess | flower-sim (Flower's Ray simulation, comix[flower-sim])
    data: SplitConfig = field(default_factory=_main_job_data)
    train: TrainConfig = field(default_factory=_main_job_train)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    comigs: ComigsConfig = field(default_factory=ComigsConfig)
    pcl: object = field(default_factory=SECTIONS["pcl"])
    fdlora: object = field(default_factory=SECTIONS["fdlora"])                    # fdlora-comigs
    fdlora_fedamole: object = field(default_factory=SECTIONS["fdlora_fedamole"])  # fdlora-fedamole
    hetlora: object = field(default_factory=SECTIONS["hetlora"])
    flexlora: object = field(default_factory=SECTIONS["flexlora"])
    fedamole: object = field(default_factory=SECTIONS["fedamole"])
    fedprompt: object = field(default_factory=SECTIONS["fedprompt"])
    fedptuning: object = field(default_factory=SECTIONS["fedptuning"])
    deepfusion: object = field(default_factory=SECTIONS["deepfusion"])
    fedjets: object = field(default_factory=SECTIONS["fedjets"])
    flora: object = field(default_factory=SECTIONS["flora"])
    fedalt: object = field(default_factory=SECTIONS["fedalt"])
    feddpa: object = field(default_factory=SECTIONS["feddpa"])
    fedlease: object = field(default_factory=SECTIONS["fedlease"])
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # client-level DP (comix/privacy.py)
    server: ServerConfig = field(default_factory=ServerConfig)     # combining rule and optimiser (comix/aggregation.py)
    # the train.* keys the recipe or command line set (written by comix into a run's config.yaml):
    # every other optimiser key takes the method's own default (Algorithm.train_defaults)
    explicit_train: list[str] = field(default_factory=list)

    def options(self, method: str) -> dict:
        """The config section of ``method`` as keyword options (empty when it has none)."""
        section = section_of(method)
        return dataclasses.asdict(getattr(self, section)) if section else {}

    def validate(self) -> "RunConfig":
        if not self.methods:
            raise ConfigError("methods is empty: name at least one method (e.g. methods=[fedavg])")
        for m in self.methods:
            if m.split(":")[0] not in METHODS:
                raise ConfigError(f"methods: unknown method {m!r} (allowed: {', '.join(METHODS)})")
        if isinstance(self.data.seed, dict):  # each grid seed its stated data seed, before any data loads
            if not all(isinstance(k, int) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for k, v in self.data.seed.items()):
                raise ConfigError(f"data.seed maps training seeds to data seeds (whole numbers >= 0), got {self.data.seed}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        for key in ("lr", "router_lr"):
            if not getattr(self.train, key) > 0:
                raise ConfigError(f"train.{key} must be > 0, got {getattr(self.train, key)}")
        if self.engine not in ("inprocess", "flower-sim"):
            raise ConfigError(f"engine must be inprocess or flower-sim, got {self.engine!r}")
        t = self.train
        for key in ("rounds", "local_steps", "batch_size", "seq_len", "tau", "eval_every", "eval_batch_size"):
            if getattr(t, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
        if t.clients_per_round < 0 or not 0 < t.client_fraction <= 1:
            raise ConfigError(f"train.clients_per_round must be >= 0 and train.client_fraction in (0, 1], "
                              f"got {t.clients_per_round} and {t.client_fraction}")
        if not isinstance(t.eval_clients, int) or t.eval_clients < 0:
            raise ConfigError(f"train.eval_clients must be >= 0 (0: every client every evaluated round), "
                              f"got {t.eval_clients}")
        if not isinstance(t.prox_mu, (int, float)) or t.prox_mu < 0:
            raise ConfigError(f"train.prox_mu must be >= 0 (0: no proximal term), got {t.prox_mu!r}")
        if t.router_steps < 0:
            raise ConfigError(f"train.router_steps must be >= 0, got {t.router_steps}")
        from .eval.tasks import ROUGE
        if t.rouge not in ROUGE:
            raise ConfigError(f"train.rouge must be one of {', '.join(ROUGE)}, got {t.rouge!r}")
        from .tracking import check_tracker
        for key in ("tensorboard", "mlflow", "wandb"):
            if getattr(t, key):
                check_tracker(key)
        if t.wandb_mode not in ("offline", "online"):
            raise ConfigError(f"train.wandb_mode must be offline or online, got {t.wandb_mode!r}")
        if not t.eval_splits or any(s not in ("valid", "test") for s in t.eval_splits):
            raise ConfigError(f"train.eval_splits must list valid and/or test, got {t.eval_splits}")
        if self.fleet:
            from .fleet import load_fleet
            try:
                load_fleet(self.fleet)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        from .models.quant import check_quant
        if self.quant == "auto" and not self.fleet:
            raise ConfigError("quant=auto picks each device's base precision from its memory budget: give a fleet "
                              "(fleet=<file> or a built-in fleet)")
        for q in dict.fromkeys([self.quant] if isinstance(self.quant, str) else self.quant):
            if q != "auto" and check_quant(q):
                raise ConfigError(check_quant(q))
        if self.micro_batches == "auto" and not self.fleet:
            raise ConfigError("micro_batches=auto slices each device's batches as its memory budget needs: give a "
                              "fleet (fleet=<file> or a built-in fleet)")
        for m in [self.micro_batches] if isinstance(self.micro_batches, (int, str)) else self.micro_batches:
            if m != "auto" and (not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= self.train.batch_size):
                raise ConfigError(f"micro_batches must be auto or a whole number from 1 to train.batch_size "
                                  f"({self.train.batch_size}), or one per client; got {m!r}")
        from .runtime import PRECISIONS
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.compile == "auto":
            self.compile = None
        if self.compile not in (None, True, False):
            raise ConfigError(f"compile must be auto, true or false, got {self.compile!r}")
        if self.graphs == "auto":
            self.graphs = None
        if self.graphs not in (None, True, False):
            raise ConfigError(f"graphs must be auto, true or false, got {self.graphs!r}")
        if self.graphs and self.device == "cpu":
            raise ConfigError("graphs=true captures CUDA graphs: it needs device=cuda (or auto on a machine with CUDA)")
        if not 0.0 <= self.gpus_per_client <= 1.0:
            raise ConfigError(f"gpus_per_client must be in [0, 1], got {self.gpus_per_client}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
        if not 0 <= t.min_lr_ratio <= 1 or not 0 <= t.warmup_frac < 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1] and train.warmup_frac in [0, 1), "
                              f"got {t.min_lr_ratio} and {t.warmup_frac}")
        if t.grad_clip < 0 or t.weight_decay < 0:
            raise ConfigError(f"train.grad_clip and train.weight_decay must be >= 0, got {t.grad_clip} and "
                              f"{t.weight_decay}")
        if t.schedule not in ("cosine", "round_decay", "round_linear") or not 0 < t.lr_decay <= 1 or t.max_new_tokens < 1:
            raise ConfigError(f"train.schedule must be cosine, round_decay or round_linear, train.lr_decay in (0, 1] and "
                              f"train.max_new_tokens >= 1, got {t.schedule!r}, {t.lr_decay}, {t.max_new_tokens}")
        if t.optimizer_state not in ("run", "round"):
            raise ConfigError(f"train.optimizer_state must be run or round, got {t.optimizer_state!r}")
        if t.client_sampling not in ("fixed", "poisson"):
            raise ConfigError(f"train.client_sampling must be fixed or poisson, got {t.client_sampling!r}")
        problem = self.privacy.problem() or self.server.problem()
        if problem:
            raise ConfigError(problem)
        problem = combination_problem(self)  # settings valid alone that cannot run together
        if problem:
            raise ConfigError(problem)
        if t.cohort != "auto" and (not isinstance(t.cohort, int) or isinstance(t.cohort, bool) or t.cohort < 1):
            raise ConfigError(f"train.cohort must be auto or a whole number >= 1 (1: one client at a time), got {t.cohort!r}")
        if t.cohort != 1 and self.engine != "inprocess":
            raise ConfigError(f"train.cohort={t.cohort} trains clients together in one process: engine=inprocess only "
                              f"(engine={self.engine} runs each device in its own process)")
        if t.load_balance not in ("none", "uniform", "generalist"):
            raise ConfigError(f"train.load_balance must be none, uniform or generalist, got {t.load_balance!r}")
        return self


def _type_ok(value, default) -> bool:
    if default is None or isinstance(default, (list, tuple)) and value is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, list) and all(isinstance(v, int) for v in value))  # int | list[int]
    if isinstance(default, list):
        return isinstance(value, list)
    return isinstance(value, type(default))


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    names = [f.name for f in dataclasses.fields(obj)]
    key = prefix + head
    if head not in names:
        raise ConfigError(f"unknown config key {key!r} (allowed: {', '.join(prefix + n for n in names)})")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if rest:
            return _set(current, rest, value, key + ".")
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} is a section; give a mapping or {key}.<field>=...")
        for k, v in value.items():
            _set(current, k, v, key + ".")
        return
    if rest:
        raise ConfigError(f"config key {key!r} has no sub-keys")
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    default = getattr(type(obj)(), head) if dataclasses.is_dataclass(obj) else current
    per_client = (key == "quant" and isinstance(value, list) and all(isinstance(v, str) for v in value)) or \
        (key == "micro_batches" and (value == "auto" or isinstance(value, list) and all(isinstance(v, int) for v in value))) or \
        (key == "train.client_runtime" and isinstance(value, list) and all(isinstance(v, str) for v in value)) or \
        (key == "train.cohort" and value == "auto") or (key == "data.seed" and (value == "run" or isinstance(value, dict)))
    if not per_client and not _type_ok(value, default if default is not None else current):
        want = type(default).__name__ if default is not None else "a value"
        raise ConfigError(f"config key {key!r} expects {want}, got {value!r}")
    setattr(obj, head, value)


def split_outside_brackets(text: str) -> list[str]:
    """``"a,b=[1,2],c"`` -> ["a", "b=[1,2]", "c"]: commas inside brackets stay; pieces stripped."""
    pieces, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            pieces.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return pieces + [cur.strip()]


def method_list(text: str) -> list[str]:
    """``[fedavg,hetlora:ranks=[16,16,32,32],reg=0.05]`` -> ["fedavg", "hetlora:ranks=[16,16,32,32],reg=0.05"]:
    commas inside brackets stay, and a piece that does not start with a method name (``reg=0.05``)
    is one more option of the spec before it."""
    inner = text.strip()[1:-1] if text.strip().endswith("]") else text.strip()[1:]
    specs: list[str] = []
    for piece in filter(None, (p.strip("'\"") for p in split_outside_brackets(inner))):
        head = piece.split(":")[0].split("=")[0]
        if specs and ":" in specs[-1] and head not in METHODS:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def load_config(path: str | None = None, overrides: list[str] = (), text: str | None = None) -> RunConfig:
    """A validated RunConfig from a YAML file or a built-in recipe's name (or YAML ``text``, e.g.
    sent to a Flower device)."""
    cfg, explicit = RunConfig(), set()
    if path or text is not None:
        if text is None:
            try:
                path = str(recipe_path(path))
            except ConfigFileMissing as err:
                raise ConfigError(str(err)) from None
            text = Path(path).read_text()
        where = f"config file {path}" if path else "config text"
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{where} is not valid YAML{at}: {getattr(err, 'problem', None) or str(err).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must hold a mapping of keys")
        for k, v in raw.items():
            _set(cfg, k, v)
        if "explicit_train" not in raw:  # a recipe: its train keys are the user's (a run's config.yaml lists its own)
            explicit |= set(raw.get("train") or {}) | {k[6:] for k in raw if k.startswith("train.")}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        if k.strip() == "methods" and v.strip().startswith("[") and ":" in v:
            value = method_list(v)  # specs with options need no quoting
        else:
            try:
                value = yaml.safe_load(v)
            except yaml.YAMLError:
                value = v
        _set(cfg, k.strip(), value)
        if k.strip() == "train" and isinstance(value, dict):
            explicit |= set(value)
        elif k.strip().startswith("train."):
            explicit.add(k.strip()[6:].split(".")[0])
    cfg.explicit_train = sorted(set(cfg.explicit_train) | explicit)
    try:
        for sec in (cfg.data, cfg.train, cfg.lora):  # re-run dataclass checks after edits
            if hasattr(sec, "__post_init__"):
                sec.__post_init__()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg.validate()


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)
